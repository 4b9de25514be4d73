//! Gradient reductions a tensor-parallel model needs before the optimizer step.

use super::parallel_attrs;
use crate::comm::{Comm, CommError, ReduceOp};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

struct Collect<F: Fn(ParamId) -> bool> {
    keep: F,
    ids: Vec<(ParamId, usize)>,
}

impl<F: Fn(ParamId) -> bool> ModuleVisitor for Collect<F> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if (self.keep)(param.id) {
            self.ids.push((param.id, D));
        }
    }
}

/// All-reduces (sums) over the tensor-parallel group the gradients of the parameters marked
/// [`sequence_parallel`](super::ParallelAttrs::sequence_parallel): under sequence parallelism
/// each rank's gradient of a duplicated parameter (LayerNorm weights, row-parallel bias)
/// covers only its part of the sequence. Megatron does this in `finalize_model_grads`.
pub fn allreduce_sequence_parallel_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    tp: &Comm,
) -> Result<(), CommError> {
    let mut collect = Collect {
        keep: |id| parallel_attrs(id).sequence_parallel,
        ids: Vec::new(),
    };
    module.visit(&mut collect);
    for (id, rank) in collect.ids {
        match rank {
            1 => reduce::<1>(grads, id, tp)?,
            2 => reduce::<2>(grads, id, tp)?,
            3 => reduce::<3>(grads, id, tp)?,
            _ => reduce::<4>(grads, id, tp)?,
        }
    }
    Ok(())
}

fn reduce<const D: usize>(
    grads: &mut GradientsParams,
    id: ParamId,
    tp: &Comm,
) -> Result<(), CommError> {
    if let Some(g) = grads.remove::<D>(id) {
        grads.register::<D>(
            id,
            crate::comm::tensor::all_reduce(&**tp, g, ReduceOp::Sum)?,
        );
    }
    Ok(())
}
