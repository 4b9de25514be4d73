//! Tensor parallelism: Megatron's communication mappings as differentiable Burn ops, and
//! Megatron's parallel layers, for a model written Megatron's way (the built-in models are).
//!
//! - [`mappings`]: copy / reduce / scatter / gather, tensor- and sequence-parallel.
//! - [`ColumnParallelLinear`], [`RowParallelLinear`]: split linear layers.
//! - [`MasterInit`], [`derive_seed`]: initialisation independent of the TP size.
//! - [`VocabParallelEmbedding`], [`vocab_parallel_cross_entropy`]: the vocabulary split by rows.
//! - [`VocabParallelSampler`], [`vocab_parallel_argmax`], [`vocab_parallel_accuracy`]: tokens
//!   chosen from split logits without gathering the vocabulary.
//! - [`RngTracker`]: dropout masks shared or distinct across TP ranks, as the region needs.
//! - [`ParallelAttrs`]: per-parameter parallel attributes, queryable by `ParamId`.
//!
//! A model written with `burn::nn` is split by [`crate::dropin`] instead, which uses these
//! layers' forward.
//!
//! Sequence parallelism has no folder of its own; it happens in four places. The mappings
//! split and gather the sequence (the `*_sequence_parallel_region` ones, and
//! [`mappings::gather_sequence_matmul`] in a column layer's forward); a model scatters its
//! embeddings' output and gathers before its head (`models/gpt/forward.rs`, `models/bert.rs`;
//! the drop-in encoder and decoder in `dropin/nn/sequence.rs`); the norms between the split
//! layers see a rank's positions only, so their gradients are partial: the built-in models'
//! are summed by [`allreduce_sequence_parallel_grads`] in `finalize_model_grads`, the drop-in
//! layers' inside the graph.

mod attrs;
mod cross_entropy;
mod embedding;
mod grads;
mod init;
mod layers;
mod lora;
pub mod mappings;
mod random;
mod sampling;
mod vocab;

pub use attrs::{LayoutOwner, ParallelAttrs, parallel_attrs, set_layout_attrs};
pub(crate) use attrs::{copy_parallel_attrs, real_part, update_parallel_attrs};
pub use cross_entropy::{
    LabelSmoothing, VocabParallelCrossEntropyOps, vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_padded,
};
pub use embedding::{IdCheck, VocabParallelEmbedding, VocabParallelEmbeddingConfig};
pub(crate) use embedding::{checked_index, vocab_lookup};
pub use grads::allreduce_sequence_parallel_grads;
pub use init::{MasterInit, derive_seed};
pub(crate) use init::{slice_cols, slice_rows};
pub use layers::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
};
pub(crate) use layers::{
    LinearShard, ParallelLinear, Partition, check_input_width, gathered_product, matmul_bias,
    product,
};
pub(crate) use lora::{adapter_attrs, no_adapter, refuse_adapter, split_weight, state_adapter};
pub use random::{MODEL_PARALLEL_SEED_OFFSET, RngRegion, RngTracker};
pub use sampling::{
    Sampling, VocabParallelSampler, vocab_parallel_accuracy, vocab_parallel_argmax,
};
pub use vocab::{
    DEFAULT_VOCAB_DIVISIBLE_BY, PADDED_VOCAB_LOGIT, mask_vocab_padding, padded_vocab_size,
    vocab_range,
};

use crate::comm::CommError;
use burn::module::{Param, ParamId};
use burn::tensor::{Device, Shape, Tensor, TensorData};

/// Why a tensor-parallel layer could not be built or gathered.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// A size does not split over the tensor-parallel ranks.
    #[error("{0}")]
    Indivisible(String),
    /// A configuration value outside its domain (e.g. a dropout probability of 1).
    #[error("{0}")]
    Invalid(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// A shard cut from a plain layer's parameter, as a parameter of its own: detached from the
/// plain layer's graph, and trainable where the device can train (a plain device cannot).
pub(crate) fn shard_param<const D: usize>(shard: Tensor<D>) -> Param<Tensor<D>> {
    let shard = shard.detach();
    Param::from_tensor(match shard.is_autodiff() {
        true => shard.require_grad(),
        false => shard,
    })
}

/// A trainable parameter of `shape` whose host values `values` draws on first use: a layer
/// built and then loaded (from a record by
/// [`dropin::load_sharded`](crate::dropin::load_sharded), or a checkpoint) never draws them
/// or holds them (its layer states its attributes).
pub(crate) fn lazy_host_param<const D: usize>(
    shape: [usize; D],
    device: &Device,
    values: impl FnOnce() -> Vec<f32> + Send + Sync + 'static,
) -> Param<Tensor<D>> {
    let init = move |device: &Device, require_grad: bool| {
        Tensor::<D>::from_data(TensorData::new(values(), shape), device)
            .set_require_grad(require_grad)
    };
    Param::uninitialized(
        ParamId::new(),
        init,
        device.clone(),
        true,
        Shape::from(shape),
    )
}

/// A trainable parameter of `shape` from host values (its layer states its attributes).
pub(crate) fn host_param<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
) -> Param<Tensor<D>> {
    Param::from_tensor(Tensor::<D>::from_data(
        TensorData::new(values, shape),
        device,
    ))
}
