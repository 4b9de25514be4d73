//! Tensor-parallel transformer building blocks (activations `[s, b, h]`, Megatron's layout).

mod attention;
mod bert;
mod bert_hf;
mod transformer;

pub use attention::{ParallelAttention, ParallelAttentionConfig};
pub use bert::{
    Bert, BertConfig, BertEmbeddings, BertHead, BertOutput, BertStageOutput, MaskedPositions,
};
pub use bert_hf::{
    HfBertConfig, HfError, hf_state_dict, load_hf_bert, load_hf_weights, save_hf_bert,
};
pub use transformer::{
    LayerNormPosition, Norm, NormKind, ParallelMlp, TransformerLayer, TransformerLayerConfig,
};

use crate::tensor_parallel::TpError;

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
