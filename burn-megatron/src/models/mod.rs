//! Tensor-parallel transformer building blocks (activations `[s, b, h]`, Megatron's layout).

mod attention;
mod bert;
mod bert_hf;
mod gpt;
mod gpt_hf;
mod hf_host;
mod mlp;
mod norm;
mod rotary;
mod transformer;

pub use attention::{
    AttentionInputs, AttnBackend, AttnMaskType, CpAttention, LayerKvCache, ParallelAttention,
    ParallelAttentionConfig,
};
pub use bert::{
    Bert, BertConfig, BertEmbeddings, BertHead, BertOutput, BertStageOutput, MaskedPositions,
};
pub use bert_hf::{
    HfBertConfig, HfError, hf_bert_state_dict, load_hf_bert, load_hf_bert_weights, save_hf_bert,
};
pub use gpt::{
    GenerateConfig, GenerateError, Generated, Gpt, GptConfig, GptEmbedding, GptHead,
    GptStageOutput, KvCache, PositionEmbeddingType, Positions, generate, generate_stages,
};
pub use gpt_hf::{
    HfArchitecture, HfExperts, HfGptConfig, hf_gpt_state_dict, load_hf_gpt, load_hf_gpt_weights,
    save_hf_gpt,
};
pub use hf_host::read_hf_tensors;
pub use mlp::{ParallelMlp, ParallelMlpConfig};
pub use norm::{FusedLayerNorm, Norm, NormKind};
pub use rotary::{RopeScaling, RotaryEmbedding, RotaryEmbeddingConfig, RotaryTables};
pub use transformer::{
    ActivationFunc, LayerNormPosition, TransformerLayer, TransformerLayerConfig, forward_layers,
};

use crate::tensor_parallel::{LayoutOwner, TpError, VocabParallelEmbedding};
use burn::config::{Config, ConfigError};

/// A model config a checkpoint saved at `path`: the composed layout (with a `transformer`
/// field), or the flat `Flat` one that checkpoints saved before 2026-12-04 hold.
pub(crate) fn load_saved_config<C, Flat>(path: &std::path::Path) -> Result<C, ConfigError>
where
    C: Config + From<Flat>,
    Flat: serde::de::DeserializeOwned,
{
    let invalid =
        |e: serde_json::Error| ConfigError::InvalidFormat(format!("{}: {e}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::FileNotFound(format!("{}: {e}", path.display())))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(invalid)?;
    match value.get("transformer") {
        Some(_) => C::load(path),
        None => serde_json::from_value::<Flat>(value)
            .map(C::from)
            .map_err(invalid),
    }
}

/// Refuses dropout probabilities outside `[0, 1)` at init, so a forward never meets one.
pub(crate) fn check_dropout(probs: &[(&str, f64)]) -> Result<(), TpError> {
    for &(name, p) in probs {
        if !(0.0..1.0).contains(&p) {
            return Err(TpError::Invalid(format!(
                "{name} must be in [0, 1), got {p}"
            )));
        }
    }
    Ok(())
}

/// Refuses a norm epsilon that is not finite and positive at init (`RmsNormConfig::init`
/// would panic on it, and the fused norms' forward would).
pub(crate) fn check_epsilon(epsilon: f64) -> Result<(), TpError> {
    if !(epsilon.is_finite() && epsilon > 0.0) {
        return Err(TpError::Invalid(format!(
            "layernorm_epsilon must be finite and positive, got {epsilon}"
        )));
    }
    Ok(())
}

/// Marks a copy of the word embeddings tied across the first and last stage.
fn tie(owner: &LayoutOwner, embedding: &VocabParallelEmbedding, second_copy: bool) {
    owner.update(embedding.weight.id, |a| a.tied_embedding(second_copy));
}

/// The global name of the parameter at `path` of a model of chunks whose first layers are
/// `first_layers` (module paths of a `Vec` of chunks, `"1.layers.0.…"`, or of one chunk):
/// layers by global index, and the last stage's tied copy (`tied_copy`) under the first
/// stage's name (`tied_name`).
fn global_param_name(
    first_layers: &[usize],
    path: &str,
    tied_copy: &str,
    tied_name: &str,
) -> String {
    let (chunk, rest) = match path.split_once('.') {
        Some((c, rest)) if c.parse::<usize>().is_ok() => (c.parse().unwrap_or(0), rest),
        _ => (0, path),
    };
    let first = first_layers.get(chunk).copied().unwrap_or(0);
    if let Some((i, tail)) = rest
        .strip_prefix("layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(i, tail)| i.parse::<usize>().ok().map(|i| (i, tail)))
    {
        return format!("layers.{}.{tail}", first + i);
    }
    if let Some(tail) = rest.strip_prefix(tied_copy) {
        return format!("{tied_name}{tail}");
    }
    rest.to_string()
}

/// A pipeline chunk's forward takes token ids where it holds the embeddings (the first
/// virtual stage) and the previous stage's hidden states elsewhere: the error for any
/// other combination.
fn stage_input_error(embeddings: bool, tokens: bool, hidden: bool) -> TpError {
    TpError::Invalid(format!(
        "the forward of a chunk {} the embeddings needs {}, got token ids: {tokens}, hidden states: {hidden}",
        if embeddings { "with" } else { "without" },
        if embeddings {
            "token ids only"
        } else {
            "hidden states only"
        },
    ))
}
