//! The global gradient norm across tensor- and pipeline-parallel ranks, and clipping by it.
//!
//! Each gradient is counted once in the whole model: a tensor-parallel shard always counts
//! (the shards partition the full tensor), a duplicated parameter only on tensor-parallel
//! rank 0, and the second copy of a shared embedding never. The local sums are then reduced
//! over the model-parallel group (tp × pp), as Megatron's `get_grad_norm_fp32` does.

use crate::comm::{Comm, CommError, CommunicatorExt, ReduceOp};
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

/// Which norm to clip by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormType {
    /// Euclidean norm.
    L2,
    /// Largest absolute value.
    Inf,
}

/// Every float parameter of a module with its rank (number of dims).
pub(crate) fn float_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Collect(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push((param.id, D));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Runs `f` on the gradient of parameter `id` (of rank `dims`) flattened to 1-d, if any.
pub(crate) fn with_grad<R>(
    grads: &GradientsParams,
    id: ParamId,
    dims: usize,
    f: impl FnOnce(Tensor<1>) -> R,
) -> Option<R> {
    match dims {
        1 => grads.get::<1>(id).map(f),
        2 => grads.get::<2>(id).map(|g| f(g.flatten(0, 1))),
        3 => grads.get::<3>(id).map(|g| f(g.flatten(0, 2))),
        4 => grads.get::<4>(id).map(|g| f(g.flatten(0, 3))),
        _ => None,
    }
}

/// The global gradient norm of `module`'s gradients on a rank of tensor-parallel rank
/// `tp_rank`, reduced over `model_parallel` (the tp × pp group). Per-tensor sums are f32, summed
/// over tensors in f64, and reduced across ranks in f32.
pub fn global_grad_norm<M: Module>(
    module: &M,
    grads: &GradientsParams,
    tp_rank: usize,
    model_parallel: &Comm,
    norm_type: NormType,
) -> Result<f64, CommError> {
    let mut local = 0.0f64;
    for (id, dims) in float_params(module) {
        if !parallel_attrs(id).counts_in_grad_norm(tp_rank) {
            continue;
        }
        let part = with_grad(grads, id, dims, |g| {
            let g = g.cast(DType::F32);
            let v = match norm_type {
                NormType::L2 => g.powi_scalar(2).sum(),
                NormType::Inf => g.abs().max(),
            };
            f64::from(v.into_scalar::<f32>())
        });
        if let Some(p) = part {
            local = match norm_type {
                NormType::L2 => local + p,
                NormType::Inf => local.max(p),
            };
        }
    }
    // The reduction is in f32, as Megatron's `get_grad_norm_fp32`.
    let mut v = vec![local as f32];
    let op = match norm_type {
        NormType::L2 => ReduceOp::Sum,
        NormType::Inf => ReduceOp::Max,
    };
    model_parallel.all_reduce_vec(&mut v, op)?;
    let total = f64::from(v[0]);
    Ok(match norm_type {
        NormType::L2 => total.sqrt(),
        NormType::Inf => total,
    })
}

/// Scales every gradient by `max_norm / (norm + 1e-6)` when that is below 1 (Megatron's
/// `clip_grad_by_total_norm_fp32`). Returns the coefficient applied (1 when none).
pub fn clip_grads_by_total_norm<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
    total_norm: f64,
) -> f64 {
    let coeff = max_norm / (total_norm + 1e-6);
    if coeff >= 1.0 {
        return 1.0;
    }
    for (id, dims) in float_params(module) {
        match dims {
            1 => scale::<1>(grads, id, coeff),
            2 => scale::<2>(grads, id, coeff),
            3 => scale::<3>(grads, id, coeff),
            4 => scale::<4>(grads, id, coeff),
            _ => {}
        }
    }
    coeff
}

fn scale<const D: usize>(grads: &mut GradientsParams, id: ParamId, coeff: f64) {
    if let Some(g) = grads.remove::<D>(id) {
        grads.register::<D>(id, g * coeff);
    }
}

#[cfg(test)]
mod tests;
