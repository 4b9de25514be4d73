//! Parallel attributes of parameters, queryable by [`ParamId`].
//!
//! Parallel layers record, for each parameter they own, whether it is a tensor-parallel
//! shard (and along which dimension), whether its gradient is partial under sequence
//! parallelism, and whether it is a shared embedding. The optimizer reads these to count
//! each gradient once in the global norm, and data-parallel code to finish reductions —
//! without the user annotating anything. A parameter never registered is *duplicated*: every
//! tensor-parallel rank holds the same full copy.
//!
//! The table is keyed by id, and ids change under a module's feet: Burn's record loading
//! (`load_record`, `load_file`) gives each parameter the id it was saved with, which in a new
//! process was never registered. So a layer states its parameters' attributes not only when
//! it is built but again at every forward (a read and a compare when nothing changed): every
//! parameter that has a gradient went through a forward since it got its current id, and the
//! readers all run after backward. A custom layer does the same with
//! [`set_layout_attrs`] in its `forward`.

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

    /// These attributes with the layout (`tensor_model_parallel`, `partition_dim`,
    /// `sequence_parallel`) of `layout`, keeping the tie flags of `self`.
    pub fn with_layout_of(self, layout: ParallelAttrs) -> Self {
        Self {
            shared_embedding: self.shared_embedding,
            shared: self.shared,
            ..layout
        }
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

/// Changes the attributes of `id` in place (an id never registered starts as duplicated);
/// takes the write lock only when `update` changed something, so layers can call it at every
/// forward.
pub fn update_parallel_attrs(id: ParamId, update: impl FnOnce(ParallelAttrs) -> ParallelAttrs) {
    let old = parallel_attrs(id);
    let new = update(old);
    if new != old {
        set_parallel_attrs(id, new);
    }
}

/// Records the layout part of `layout` for `id` and keeps its tie flags: what a layer states
/// about the parameters it owns, at init and at every forward (see the module docs), while
/// the model that ties two copies of a weight states the tie.
///
/// ```
/// use burn::module::ParamId;
/// use burn_megatron::tensor_parallel::{ParallelAttrs, parallel_attrs, set_layout_attrs};
/// let id = ParamId::new();
/// set_layout_attrs(id, ParallelAttrs::sharded(0));
/// assert_eq!(parallel_attrs(id), ParallelAttrs::sharded(0));
/// ```
pub fn set_layout_attrs(id: ParamId, layout: ParallelAttrs) {
    update_parallel_attrs(id, |a| a.with_layout_of(layout));
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
