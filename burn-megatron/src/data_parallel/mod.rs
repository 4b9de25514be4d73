//! Data parallelism: gradients reduced over the data-parallel group only, a few large
//! collectives at a time (contiguous buckets), and Megatron's `finalize_model_grads`.
//!
//! A training loop configures it in [`ParallelTrainingConfig`](crate::training::ParallelTrainingConfig)
//! (`overlap_grad_reduce`, `use_distributed_optimizer`, this module's [`DataParallelConfig`])
//! and calls [`ParallelTraining::finalize`](crate::training::ParallelTraining::finalize)
//! after each step's backward. What that does:
//!
//! - [`advanced::finalize_model_grads`] reduces after backward, once per optimizer step, so
//!   gradient accumulation over micro-batches (sum the micro-batch `GradientsParams`, then
//!   finalize) costs one reduction.
//! - [`advanced::OverlapReducer`] instead starts each bucket's reduction during the last
//!   micro-batch's backward, as soon as its gradients are in.
//! - With the distributed optimizer an [`advanced::ShardPlan`] decides which elements each
//!   rank owns, and the buckets are reduce-scattered.
//!
//! [`advanced::DpReduction`] names the three; [`advanced::finalize_model_grads`] takes one.

pub(crate) mod batch_norm;
mod finalize;
mod overlap;
mod reduce_scatter;
mod replicas;
mod shard_plan;
#[cfg(test)]
mod tests;

pub(crate) use finalize::{dense_params, expert_params};

/// The pieces [`ParallelTraining`](crate::training::ParallelTraining) assembles, for a loop
/// that holds its reducers and shard plans itself: `ParallelTraining::finalize` is
/// `finalize_model_grads` with the configuration's [`DpReduction`](advanced::DpReduction)
/// (after backward, overlapped with it, or reduce-scattered for the distributed optimizer)
/// and, for a model with experts, `finalize_expert_grads`.
pub mod advanced {
    pub use super::batch_norm::sync_batch_norm;
    pub use super::finalize::{
        DpReduction, all_reduce_gradients, bucket_layout, finalize_expert_grads,
        finalize_model_grads,
    };
    pub use super::overlap::OverlapReducer;
    pub use super::reduce_scatter::reduce_scatter_gradients;
    pub use super::replicas::{broadcast_params, check_replicas};
    pub use super::shard_plan::{OptimizerShards, Piece, PlannedBucket, PlannedParam, ShardPlan};
    /// What [`OverlapReducer::activate`] returns: the reducer stays active on this thread
    /// until it is dropped.
    pub use crate::grad_hooks::ActiveGuard;
}

/// How gradients are reduced over the data-parallel group.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataParallelConfig {
    /// Elements per bucket; `None` is Megatron's default, max(40 M, 1 M × dp).
    pub bucket_size: Option<usize>,
    /// Average over the group (`true`, Megatron's default) or sum.
    pub average: bool,
    /// Reduce bf16/f16 gradients in f32 (they come back in their dtype). The overlapped
    /// reducer always reduces in f32, into its FP32 main gradients, whatever this says.
    pub reduce_in_fp32: bool,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        Self {
            bucket_size: None,
            average: true,
            reduce_in_fp32: false,
        }
    }
}

impl DataParallelConfig {
    /// The bucket size in elements for a data-parallel group of `dp` ranks.
    pub fn bucket_elements(&self, dp: usize) -> usize {
        self.bucket_size
            .unwrap_or_else(|| (40_000_000usize).max(1_000_000 * dp))
    }
}
