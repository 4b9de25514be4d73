//! Shared helpers of the examples and benchmarks under `examples/examples/`.

use burn_megatron::models::{
    ActivationFunc, AttnMaskType, GptConfig, LayerNormPosition, NormKind, ParallelAttentionConfig,
    ParallelMlpConfig, PositionEmbeddingType, TransformerLayerConfig,
};

/// The median of `samples` (the upper one for an even count). Panics on an empty slice.
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The benchmarks' Llama-style GPT: rotary positions, RMSNorm, a SwiGLU MLP, `groups`
/// key/value heads shared by the `heads` query heads, no biases, an untied output layer, and
/// no dropout.
pub fn llama(
    layers: usize,
    hidden: usize,
    (heads, groups): (usize, usize),
    ffn: usize,
    max_positions: usize,
    padded_vocab: usize,
) -> GptConfig {
    // ANCHOR: llama_config
    let attention = ParallelAttentionConfig::new(heads)
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_num_query_groups(Some(groups))
        .with_attention_dropout(0.0);
    let mlp = ParallelMlpConfig::new(ffn)
        .with_gated_linear_unit(true)
        .with_activation_func(ActivationFunc::Silu);
    let layer = TransformerLayerConfig::new(hidden, attention, mlp)
        .with_layernorm_position(LayerNormPosition::Pre)
        .with_normalization(NormKind::RmsNorm)
        .with_layernorm_epsilon(1e-5)
        .with_add_bias_linear(false)
        .with_hidden_dropout(0.0)
        .with_seed(1234);
    GptConfig::new(layers, max_positions, padded_vocab, layer)
        .with_position_embedding_type(PositionEmbeddingType::Rope)
        .with_untie_embeddings_and_output_weights(true)
    // ANCHOR_END: llama_config
}

pub mod alloc;
pub mod checkpoint_tool;
pub mod dataset_tool;
pub mod dropin;
pub mod memory;
pub mod phases;
pub mod plan;
pub mod preprocess;
pub mod pretrain;
pub mod torch_ref;
