//! `bert_config.json` as checkpoints wrote it before the config was composed (2026-12-04):
//! one flat list of every field, the layers' among the model's.

use super::BertConfig;
use crate::models::attention::ParallelAttentionConfig;
use crate::models::mlp::ParallelMlpConfig;
use crate::models::norm::NormKind;
use crate::models::transformer::{LayerNormPosition, TransformerLayerConfig};
use crate::recompute::RecomputeConfig;
use crate::tensor_parallel::MasterInit;
use burn::config::ConfigError;
use std::path::Path;

/// The flat layout, with the defaults the flat config had.
#[derive(serde::Deserialize)]
#[serde(default)]
struct FlatBertConfig {
    num_layers: usize,
    hidden_size: usize,
    num_attention_heads: usize,
    ffn_hidden_size: usize,
    max_position_embeddings: usize,
    padded_vocab_size: usize,
    num_tokentypes: usize,
    hidden_dropout: f64,
    attention_dropout: f64,
    normalization: NormKind,
    layernorm_epsilon: f64,
    layernorm_position: LayerNormPosition,
    sequence_parallel: bool,
    gradient_accumulation_fusion: bool,
    init_method_std: f64,
    seed: u64,
    recompute: RecomputeConfig,
}

impl Default for FlatBertConfig {
    fn default() -> Self {
        Self {
            num_layers: 0,
            hidden_size: 0,
            num_attention_heads: 0,
            ffn_hidden_size: 0,
            max_position_embeddings: 0,
            padded_vocab_size: 0,
            num_tokentypes: 2,
            hidden_dropout: 0.1,
            attention_dropout: 0.1,
            normalization: NormKind::LayerNorm,
            layernorm_epsilon: 1e-12,
            layernorm_position: LayerNormPosition::Post,
            sequence_parallel: false,
            gradient_accumulation_fusion: false,
            init_method_std: 0.02,
            seed: 1234,
            recompute: RecomputeConfig::new(),
        }
    }
}

impl From<FlatBertConfig> for BertConfig {
    fn from(f: FlatBertConfig) -> Self {
        let attention = ParallelAttentionConfig::new(f.num_attention_heads)
            .with_attention_dropout(f.attention_dropout);
        let transformer = TransformerLayerConfig::new(
            f.hidden_size,
            attention,
            ParallelMlpConfig::new(f.ffn_hidden_size),
        )
        .with_layernorm_position(f.layernorm_position)
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
        .with_recompute(f.recompute);
        BertConfig::new(
            f.num_layers,
            f.max_position_embeddings,
            f.padded_vocab_size,
            transformer,
        )
        .with_num_tokentypes(f.num_tokentypes)
    }
}

impl BertConfig {
    /// A config a checkpoint saved (`bert_pretrain --save` writes `bert_config.json`): this
    /// layout, or the flat one of checkpoints saved before 2026-12-04, which held the
    /// layers' fields beside the model's.
    pub fn load_saved(path: &Path) -> Result<Self, ConfigError> {
        super::super::load_saved_config::<Self, FlatBertConfig>(path)
    }
}
