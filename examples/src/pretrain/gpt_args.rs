//! `gpt_pretrain`'s command line: Megatron's `pretrain_gpt.py` flags on top of the shared
//! training flags, checked, and the `GptConfig` they describe.

use super::args::{Domain, TrainArgs, check_float};
use super::moe_args::MoeArgs;
use burn_megatron::data::BatchLayout;
use burn_megatron::models::{
    ActivationFunc, AttnMaskType, GptConfig, HfGptConfig, LayerNormPosition, NormKind,
    ParallelAttentionConfig, ParallelMlpConfig, PositionEmbeddingType, TransformerLayerConfig,
};
use burn_megatron::tensor_parallel::{MasterInit, padded_vocab_size};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;

/// The smallest byte-level BPE: the 256 bytes and `<|endoftext|>`.
const MIN_BPE_VOCAB: usize = 257;

/// `--position-embedding-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PositionEmbedding {
    /// A learned table (GPT-2).
    #[value(name = "learned_absolute")]
    LearnedAbsolute,
    /// Rotary embeddings (Llama).
    Rope,
}

/// `--normalization`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Normalization {
    /// LayerNorm.
    #[value(name = "LayerNorm")]
    LayerNorm,
    /// RMSNorm.
    #[value(name = "RMSNorm")]
    RmsNorm,
}

/// The flags that make `gpt_pretrain`'s GPT a Llama: rotary positions, RMSNorm, SwiGLU, no
/// biases, an output layer of its own (grouped-query attention is a separate choice).
pub const LLAMA_STYLE: &[&str] = &[
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
];

/// GPT-family pretraining (GPT-2 style by default, Llama style with `--position-embedding-type
/// rope --normalization RMSNorm --swiglu --group-query-attention --num-query-groups N
/// --disable-bias-linear --untie-embeddings-and-output-weights`) with tensor, pipeline and
/// data parallelism. Without `--data-path` it trains on a procedurally generated corpus
/// with a byte-level BPE trained on it first.
#[derive(Debug, Clone, Parser)]
#[command(name = "gpt_pretrain", version, args_override_self = true)]
pub struct GptArgs {
    /// The flags every pretraining example has.
    #[command(flatten)]
    pub train: TrainArgs,
    /// Grouped-query attention: `--num-query-groups` key/value heads.
    #[arg(long)]
    pub group_query_attention: bool,
    /// Key/value heads with `--group-query-attention` (divisible by the TP size).
    #[arg(long, default_value_t = 1)]
    pub num_query_groups: usize,
    /// Channels per head (default: hidden / heads).
    #[arg(long)]
    pub kv_channels: Option<usize>,
    /// How positions enter the model.
    #[arg(long, value_enum, default_value_t = PositionEmbedding::LearnedAbsolute)]
    pub position_embedding_type: PositionEmbedding,
    /// RoPE base.
    #[arg(long, default_value_t = 10000.0)]
    pub rotary_base: f64,
    /// The fraction of each head RoPE rotates.
    #[arg(long, default_value_t = 1.0)]
    pub rotary_percent: f64,
    /// LayerNorm or RMSNorm.
    #[arg(long, value_enum, default_value_t = Normalization::LayerNorm)]
    pub normalization: Normalization,
    /// The norms' epsilon.
    #[arg(long, default_value_t = 1e-5)]
    pub norm_epsilon: f64,
    /// SwiGLU MLP (gated, SiLU) instead of GeLU.
    #[arg(long)]
    pub swiglu: bool,
    /// GeLU's tanh approximation (GPT-2's) instead of the erf form.
    #[arg(long)]
    pub openai_gelu: bool,
    /// An output layer of its own instead of the word embeddings.
    #[arg(long)]
    pub untie_embeddings_and_output_weights: bool,
    /// No biases in the linear layers.
    #[arg(long)]
    pub disable_bias_linear: bool,
    /// Query/key/value biases even with `--disable-bias-linear` (Qwen2).
    #[arg(long)]
    pub add_qkv_bias: bool,
    /// Fine-tune from a Hugging Face Llama / Mistral / Qwen2 / GPT-2 directory: its
    /// `config.json` sets the model's shape (the shape flags are not used), its weights the
    /// initial ones, its `tokenizer.json` the tokenizer (unless `--tokenizer-model`).
    #[arg(long)]
    pub load_hf: Option<PathBuf>,
    /// Write the trained model as a Hugging Face directory (needs
    /// `--pipeline-model-parallel-size 1`; convert a pipelined run's checkpoint with the
    /// `checkpoint` tool's `to-hf`).
    #[arg(long)]
    pub save_hf: Option<PathBuf>,
    /// Tokens generated for each of the samples printed at the end (0: none).
    #[arg(long, default_value_t = 32)]
    pub generate_tokens: usize,
    /// Mixture of experts.
    #[command(flatten)]
    pub moe: MoeArgs,
}

impl GptArgs {
    /// The model these flags describe, for a vocabulary of `vocab_size` real entries.
    pub fn model_config(&self, vocab_size: usize) -> Result<GptConfig, String> {
        let a = &self.train;
        let base = match &self.load_hf {
            Some(dir) => HfGptConfig::from_file(&dir.join("config.json"))
                .map_err(|e| format!("--load-hf: {e}"))?
                .to_gpt_config(a.tensor_model_parallel_size),
            None => {
                let rope = self.position_embedding_type == PositionEmbedding::Rope;
                let attention = ParallelAttentionConfig::new(a.num_attention_heads)
                    .with_attn_mask_type(AttnMaskType::Causal)
                    .with_num_query_groups(
                        self.group_query_attention.then_some(self.num_query_groups),
                    )
                    .with_kv_channels(self.kv_channels)
                    .with_add_qkv_bias(self.add_qkv_bias);
                let mlp = ParallelMlpConfig::new(a.ffn_hidden_size.unwrap_or(4 * a.hidden_size))
                    .with_gated_linear_unit(self.swiglu)
                    .with_activation_func(match (self.swiglu, self.openai_gelu) {
                        (true, _) => ActivationFunc::Silu,
                        (false, true) => ActivationFunc::GeluTanh,
                        (false, false) => ActivationFunc::Gelu,
                    });
                let transformer = TransformerLayerConfig::new(a.hidden_size, attention, mlp)
                    .with_layernorm_position(LayerNormPosition::Pre)
                    .with_normalization(match self.normalization {
                        Normalization::LayerNorm => NormKind::LayerNorm,
                        Normalization::RmsNorm => NormKind::RmsNorm,
                    })
                    .with_layernorm_epsilon(self.norm_epsilon)
                    .with_add_bias_linear(!self.disable_bias_linear)
                    .with_initializer(MasterInit::Normal {
                        mean: 0.0,
                        std: a.init_method_std,
                    });
                GptConfig::new(
                    a.num_layers,
                    a.max_position_embeddings.unwrap_or(a.seq_length),
                    padded_vocab_size(
                        vocab_size,
                        a.make_vocab_size_divisible_by,
                        a.tensor_model_parallel_size,
                    ),
                    transformer,
                )
                .with_vocab_size(Some(vocab_size))
                .with_position_embedding_type(if rope {
                    PositionEmbeddingType::Rope
                } else {
                    PositionEmbeddingType::LearnedAbsolute
                })
                .with_rotary_base(self.rotary_base)
                .with_rotary_percent(self.rotary_percent)
                .with_untie_embeddings_and_output_weights(self.untie_embeddings_and_output_weights)
            }
        };
        Ok(base
            .map_transformer(|mut t| {
                t.attention.attention_dropout = a.attention_dropout;
                t.attention.attention_backend = a.attention_backend.into();
                t.attention.attention_query_chunk = a.attention_query_chunk;
                t.with_hidden_dropout(a.hidden_dropout)
                    .with_sequence_parallel(a.sequence_parallel_on())
                    .with_recompute(a.recompute())
                    .with_gradient_accumulation_fusion(a.gradient_accumulation_fusion)
                    .with_moe(self.moe.config())
                    .with_seed(a.seed)
            })
            .with_moe_layer_freq(self.moe.moe_layer_freq))
    }

    /// Every check that can fail before training starts, with a message naming the flags
    /// (the model's own checks with it: heads, query groups and TP; rotary shape).
    pub fn validate(&self) -> Result<BatchLayout, String> {
        let a = &self.train;
        let layout = a.validate()?;
        check_float("--rotary-base", self.rotary_base, Domain::Positive)?;
        check_float("--rotary-percent", self.rotary_percent, Domain::Share)?;
        check_float("--norm-epsilon", self.norm_epsilon, Domain::Positive)?;
        let saved = (a.load.as_ref()).is_some_and(|d| d.join("tokenizer.json").is_file());
        let trains_tokenizer = a.vocab_file.is_none() && self.load_hf.is_none() && !saved;
        if trains_tokenizer && a.vocab_size < MIN_BPE_VOCAB {
            return Err(format!(
                "--vocab-size ({}) must be at least {MIN_BPE_VOCAB}: the byte-level BPE trained \
                 on the corpus holds the 256 bytes and its end-of-text token",
                a.vocab_size
            ));
        }
        let tp = a.tensor_model_parallel_size;
        let heads = a.num_attention_heads;
        if self.load_hf.is_none() {
            let groups = if self.group_query_attention {
                self.num_query_groups
            } else {
                heads
            };
            if groups == 0 || !heads.is_multiple_of(groups) {
                return Err(format!(
                    "--num-attention-heads ({heads}) must be divisible by --num-query-groups ({groups})"
                ));
            }
            if !heads.is_multiple_of(tp) {
                return Err(format!(
                    "--num-attention-heads ({heads}) must be divisible by --tensor-model-parallel-size ({tp})"
                ));
            }
            if !groups.is_multiple_of(tp) {
                return Err(format!(
                    "--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp}): each rank keeps whole key/value heads"
                ));
            }
            if self.kv_channels.is_none() && !a.hidden_size.is_multiple_of(heads) {
                return Err(format!(
                    "--hidden-size ({}) must be divisible by --num-attention-heads ({heads}) (or set --kv-channels)",
                    a.hidden_size
                ));
            }
        }
        self.moe.validate(
            (a.expert_model_parallel_size, a.expert_tensor_parallel_size),
            tp,
            a.seq_length,
        )?;
        if self.moe.num_experts.is_some() && !self.disable_bias_linear && self.load_hf.is_none() {
            return Err(
                "--num-experts needs --disable-bias-linear: the experts have no biases".into(),
            );
        }
        let config = self.model_config(1)?;
        if config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute
            && a.seq_length > config.max_position_embeddings
        {
            return Err(format!(
                "--seq-length ({}) exceeds --max-position-embeddings ({}) with learned absolute positions",
                a.seq_length, config.max_position_embeddings
            ));
        }
        config.check(tp).map_err(|e| format!("the model: {e}"))?;
        if self.save_hf.is_some() && a.pipeline_model_parallel_size > 1 {
            return Err("--save-hf needs --pipeline-model-parallel-size 1 (convert a pipelined run's checkpoint with `checkpoint to-hf`)".into());
        }
        Ok(layout)
    }
}
