//! Tensor-parallel transformer building blocks (activations `[s, b, h]`, Megatron's layout).

mod attention;
mod transformer;

pub use attention::{ParallelAttention, ParallelAttentionConfig};
pub use transformer::{LayerNormPosition, ParallelMlp, TransformerLayer, TransformerLayerConfig};
