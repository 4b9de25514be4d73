//! Tensor-parallel transformer building blocks (activations `[s, b, h]`, Megatron's layout).

mod attention;
mod bert;
mod transformer;

pub use attention::{ParallelAttention, ParallelAttentionConfig};
pub use bert::{Bert, BertConfig, BertOutput};
pub use transformer::{
    LayerNormPosition, Norm, NormKind, ParallelMlp, TransformerLayer, TransformerLayerConfig,
};
