//! Tensor-parallel transformer building blocks (activations `[s, b, h]`, Megatron's layout).

mod attention;
mod bert;
mod bert_hf;
mod transformer;

pub use attention::{ParallelAttention, ParallelAttentionConfig};
pub use bert::{Bert, BertConfig, BertOutput};
pub use bert_hf::{
    HfBertConfig, HfError, hf_state_dict, load_hf_bert, load_hf_weights, save_hf_bert,
};
pub use transformer::{
    LayerNormPosition, Norm, NormKind, ParallelMlp, TransformerLayer, TransformerLayerConfig,
};
