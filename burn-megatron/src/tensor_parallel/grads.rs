//! Gradient reductions a tensor-parallel model needs before the optimizer step.

use super::parallel_attrs;
use crate::comm::{Comm, CommError, ReduceOp};
use crate::param_grads::{float_params, update_flat};
use burn::module::Module;
use burn::optim::GradientsParams;

/// All-reduces (sums) over the tensor-parallel group the gradients of the parameters marked
/// [`sequence_parallel`](super::ParallelAttrs::sequence_parallel): under sequence parallelism
/// each rank's gradient of a duplicated parameter (LayerNorm weights, row-parallel bias)
/// covers only its part of the sequence. Megatron does this in `finalize_model_grads`.
///
/// Only the built-in layers mark their parameters so. The drop-in layers sum these
/// gradients inside the autodiff graph instead (`dropin/nn/sequence.rs`), so that a plain
/// Burn loop steps on whole gradients; this function leaves them alone.
pub fn allreduce_sequence_parallel_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    tp: &Comm,
) -> Result<(), CommError> {
    for (id, rank) in float_params(module) {
        if parallel_attrs(id).sequence_parallel {
            update_flat(grads, id, rank, |g| {
                crate::comm::tensor::all_reduce(&**tp, g, ReduceOp::Sum)
            })?;
        }
    }
    Ok(())
}
