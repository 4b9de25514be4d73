//! `gpt_config.json` as checkpoints wrote it before the config was composed (2026-12-04):
//! one flat list of every field, the layer's among the model's.

use super::{GptConfig, PositionEmbeddingType};
use crate::activation::ActivationFunc;
use crate::models::attention::{AttnMaskType, ParallelAttentionConfig};
use crate::models::mlp::ParallelMlpConfig;
use crate::models::norm::NormKind;
use crate::models::rotary::RopeScaling;
use crate::models::transformer::{LayerNormPosition, TransformerLayerConfig};
use crate::moe::MoeConfig;
use crate::recompute::RecomputeConfig;
use crate::tensor_parallel::MasterInit;
use burn::config::ConfigError;
use std::path::Path;

/// The flat layout, with the defaults the flat config had.
#[derive(serde::Deserialize)]
#[serde(default)]
struct FlatGptConfig {
    num_layers: usize,
    hidden_size: usize,
    num_attention_heads: usize,
    ffn_hidden_size: usize,
    max_position_embeddings: usize,
    padded_vocab_size: usize,
    vocab_size: Option<usize>,
    num_query_groups: Option<usize>,
    kv_channels: Option<usize>,
    position_embedding_type: PositionEmbeddingType,
    rotary_base: f64,
    rotary_percent: f64,
    rope_scaling: Option<RopeScaling>,
    normalization: NormKind,
    layernorm_epsilon: f64,
    gated_linear_unit: bool,
    activation_func: ActivationFunc,
    add_bias_linear: bool,
    add_qkv_bias: bool,
    untie_embeddings_and_output_weights: bool,
    hidden_dropout: f64,
    attention_dropout: f64,
    sequence_parallel: bool,
    gradient_accumulation_fusion: bool,
    init_method_std: f64,
    seed: u64,
    recompute: RecomputeConfig,
    moe: Option<MoeConfig>,
    moe_layer_freq: usize,
}

impl Default for FlatGptConfig {
    fn default() -> Self {
        Self {
            num_layers: 0,
            hidden_size: 0,
            num_attention_heads: 0,
            ffn_hidden_size: 0,
            max_position_embeddings: 0,
            padded_vocab_size: 0,
            vocab_size: None,
            num_query_groups: None,
            kv_channels: None,
            position_embedding_type: PositionEmbeddingType::LearnedAbsolute,
            rotary_base: 10000.0,
            rotary_percent: 1.0,
            rope_scaling: None,
            normalization: NormKind::LayerNorm,
            layernorm_epsilon: 1e-5,
            gated_linear_unit: false,
            activation_func: ActivationFunc::Gelu,
            add_bias_linear: true,
            add_qkv_bias: false,
            untie_embeddings_and_output_weights: false,
            hidden_dropout: 0.1,
            attention_dropout: 0.1,
            sequence_parallel: false,
            gradient_accumulation_fusion: false,
            init_method_std: 0.02,
            seed: 1234,
            recompute: RecomputeConfig::new(),
            moe: None,
            moe_layer_freq: 1,
        }
    }
}

impl From<FlatGptConfig> for GptConfig {
    fn from(f: FlatGptConfig) -> Self {
        let attention = ParallelAttentionConfig::new(f.num_attention_heads)
            .with_num_query_groups(f.num_query_groups)
            .with_kv_channels(f.kv_channels)
            .with_attn_mask_type(AttnMaskType::Causal)
            .with_add_qkv_bias(f.add_qkv_bias)
            .with_attention_dropout(f.attention_dropout);
        let mlp = ParallelMlpConfig::new(f.ffn_hidden_size)
            .with_gated_linear_unit(f.gated_linear_unit)
            .with_activation_func(f.activation_func);
        let transformer = TransformerLayerConfig::new(f.hidden_size, attention, mlp)
            .with_add_bias_linear(f.add_bias_linear)
            .with_layernorm_position(LayerNormPosition::Pre)
            .with_normalization(f.normalization)
            .with_layernorm_epsilon(f.layernorm_epsilon)
            .with_hidden_dropout(f.hidden_dropout)
            .with_sequence_parallel(f.sequence_parallel)
            .with_gradient_accumulation_fusion(f.gradient_accumulation_fusion)
            .with_initializer(MasterInit::Normal {
                mean: 0.0,
                std: f.init_method_std,
            })
            .with_seed(f.seed)
            .with_moe(f.moe)
            .with_recompute(f.recompute);
        GptConfig::new(
            f.num_layers,
            f.max_position_embeddings,
            f.padded_vocab_size,
            transformer,
        )
        .with_vocab_size(f.vocab_size)
        .with_position_embedding_type(f.position_embedding_type)
        .with_rotary_base(f.rotary_base)
        .with_rotary_percent(f.rotary_percent)
        .with_rope_scaling(f.rope_scaling)
        .with_untie_embeddings_and_output_weights(f.untie_embeddings_and_output_weights)
        .with_moe_layer_freq(f.moe_layer_freq)
    }
}

impl GptConfig {
    /// A config a checkpoint saved (`gpt_pretrain --save` writes `gpt_config.json`): this
    /// layout, or the flat one of checkpoints saved before 2026-12-04, which held the
    /// layer's fields beside the model's.
    pub fn load_saved(path: &Path) -> Result<Self, ConfigError> {
        super::super::load_saved_config::<Self, FlatGptConfig>(path)
    }
}
