//! Parallel attributes of parameters, queryable by [`ParamId`].
//!
//! Parallel layers record, for each parameter they create, whether it is a tensor-parallel
//! shard (and along which dimension), whether its gradient is partial under sequence
//! parallelism, and whether it is a shared embedding. The optimizer reads these to count
//! each gradient once in the global norm, and data-parallel code to finish reductions —
//! without the user annotating anything. A parameter never registered is *duplicated*: every
//! tensor-parallel rank holds the same full copy.

use burn::module::ParamId;
use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

/// How one parameter is laid out across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParallelAttrs {
    /// Each tensor-parallel rank holds a different slice (`true`), or the same copy.
    pub tensor_model_parallel: bool,
    /// The dimension of the full tensor that is split, when `tensor_model_parallel`.
    pub partition_dim: Option<usize>,
    /// A duplicated parameter used on sequence-parallel activations: each rank's gradient
    /// covers only its part of the sequence and must be all-reduced over the TP group
    /// (LayerNorm weights, row-parallel biases).
    pub sequence_parallel: bool,
    /// A word embedding tied between the first and the last pipeline stage (Megatron's
    /// `shared_embedding`, set on both copies): `finalize_model_grads` sums its gradient
    /// over the embedding group.
    pub shared_embedding: bool,
    /// The last stage's copy of a tied weight (Megatron's `shared`): the first stage's copy
    /// already counts it in the global gradient norm, so this one never does.
    pub shared: bool,
}

impl ParallelAttrs {
    /// A tensor-parallel shard split along `dim` of the full tensor.
    pub fn sharded(dim: usize) -> Self {
        Self {
            tensor_model_parallel: true,
            partition_dim: Some(dim),
            ..Self::default()
        }
    }

    /// A duplicated parameter whose gradient is partial under sequence parallelism.
    pub fn sequence_parallel() -> Self {
        Self {
            sequence_parallel: true,
            ..Self::default()
        }
    }

    /// Whether this rank's copy contributes to the global gradient norm on a rank with the
    /// given tensor-parallel rank: shards always, duplicates only on TP rank 0, the second
    /// copy of a tied weight never.
    pub fn counts_in_grad_norm(&self, tp_rank: usize) -> bool {
        !self.shared && (self.tensor_model_parallel || tp_rank == 0)
    }

    /// These attributes marked as a tied embedding's copy: on the first stage
    /// (`second_copy` false) or on the last (`true`, left out of the gradient norm).
    pub fn tied_embedding(mut self, second_copy: bool) -> Self {
        self.shared_embedding = true;
        self.shared = second_copy;
        self
    }
}

fn registry() -> &'static RwLock<HashMap<ParamId, ParallelAttrs>> {
    static REGISTRY: OnceLock<RwLock<HashMap<ParamId, ParallelAttrs>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Records the attributes of parameter `id` (replacing earlier ones).
pub fn set_parallel_attrs(id: ParamId, attrs: ParallelAttrs) {
    registry()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, attrs);
}

/// The attributes of parameter `id`; a parameter never registered is duplicated.
///
/// ```
/// use burn::module::ParamId;
/// use burn_megatron::tensor_parallel::{ParallelAttrs, parallel_attrs, set_parallel_attrs};
/// let id = ParamId::new();
/// assert_eq!(parallel_attrs(id), ParallelAttrs::default());
/// set_parallel_attrs(id, ParallelAttrs::sharded(1));
/// assert!(parallel_attrs(id).tensor_model_parallel);
/// ```
pub fn parallel_attrs(id: ParamId) -> ParallelAttrs {
    registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .copied()
        .unwrap_or_default()
}
