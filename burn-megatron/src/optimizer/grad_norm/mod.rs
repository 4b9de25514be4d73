//! The global gradient norm across tensor- and pipeline-parallel ranks, and clipping by it.
//!
//! Each gradient is counted once in the whole model: a tensor-parallel shard always counts
//! (the shards partition the full tensor), a duplicated parameter only on tensor-parallel
//! rank 0, and the second copy of a shared embedding never. The local sums are then reduced
//! over the model-parallel group (tp × pp), as Megatron's `get_grad_norm_fp32` does.

mod agree;

use crate::comm::{Comm, CommError, CommunicatorExt, ReduceOp};
use crate::param_grads::{float_params, update_flat, with_flat};
use crate::tensor_parallel::parallel_attrs;
pub(crate) use agree::{LocalParts, NormGroups, agree_norm};
use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::device::ReadBack;
use burn_megatron_kernels::multi_tensor_sum_of_squares;

/// Which norm to clip by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormType {
    /// Euclidean norm.
    L2,
    /// Largest absolute value.
    Inf,
}

impl NormType {
    /// How ranks' local parts combine: sums of squares add, maxima take the max.
    pub(crate) fn reduce_op(self) -> ReduceOp {
        match self {
            NormType::L2 => ReduceOp::Sum,
            NormType::Inf => ReduceOp::Max,
        }
    }

    /// Two parts of a norm as one: their sum (L2's sums of squares) or larger (Inf).
    pub(crate) fn combine(self, a: f64, b: f64) -> f64 {
        match self {
            NormType::L2 => a + b,
            NormType::Inf => a.max(b),
        }
    }

    /// The norm from its reduced part (the square root of a sum of squares for L2).
    pub(crate) fn finish(self, total: f64) -> f64 {
        match self {
            NormType::L2 => total.sqrt(),
            NormType::Inf => total,
        }
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
    grad_norm_of(
        &float_params(module),
        grads,
        tp_rank,
        model_parallel,
        norm_type,
    )
}

/// [`global_grad_norm`] over already-collected `(ParamId, rank)` pairs.
pub(crate) fn grad_norm_of(
    params: &[(ParamId, usize)],
    grads: &GradientsParams,
    tp_rank: usize,
    model_parallel: &Comm,
    norm_type: NormType,
) -> Result<f64, CommError> {
    let local = local_norm_stats(params, grads, tp_rank, norm_type, false).norm_part;
    // The reduction is in f32, as Megatron's `get_grad_norm_fp32`.
    let mut v = vec![local as f32];
    model_parallel.all_reduce_vec(&mut v, norm_type.reduce_op())?;
    Ok(norm_type.finish(f64::from(v[0])))
}

/// This rank's part of the gradient norm and whether any of its gradients is inf or NaN.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalNormStats {
    /// Some gradient of this rank (counted in the norm or not) holds inf or NaN, or squares
    /// past f32's range (the fused optimizer's test too).
    pub non_finite: bool,
    /// The sum of squares (L2) or the largest |g| (Inf) of the counted gradients.
    pub norm_part: f64,
}

/// [`LocalNormStats`] of `grads`. With `check_all` (an optimizer step) every gradient's
/// finiteness is checked too: under L2 the one sum-of-squares pass and read-back give both,
/// under Inf it is one more such pass. Without it (the norm alone) only the counted
/// gradients are read, and `non_finite` is false.
pub(crate) fn local_norm_stats(
    params: &[(ParamId, usize)],
    grads: &GradientsParams,
    tp_rank: usize,
    norm_type: NormType,
    check_all: bool,
) -> LocalNormStats {
    let present: Vec<(bool, Tensor<1>)> = params
        .iter()
        .filter_map(|&(id, dims)| {
            let counted = parallel_attrs(id).counts_in_grad_norm(tp_rank);
            with_flat(grads, id, dims, |g| (counted, g.cast(DType::F32)))
        })
        .collect();
    // Sums of squares of every gradient when overflow is checked (any may hold it), else of
    // the counted ones, and only for L2.
    let squared: Vec<(bool, f32)> = if check_all || norm_type == NormType::L2 {
        let (counted, tensors): (Vec<bool>, Vec<Tensor<1>>) = present
            .iter()
            .filter(|(c, _)| check_all || *c)
            .map(|(c, g)| (*c, g.clone()))
            .unzip();
        let sums: Vec<f32> = if tensors.is_empty() {
            Vec::new()
        } else {
            multi_tensor_sum_of_squares(&tensors)
                .expect("the gradients of one module share a device")
                .read_back()
                .iter::<f32>()
                .collect()
        };
        counted.into_iter().zip(sums).collect()
    } else {
        Vec::new()
    };
    let norm_part = match norm_type {
        NormType::L2 => squared
            .iter()
            .filter(|(c, _)| *c)
            .map(|&(_, s)| f64::from(s))
            .sum(),
        NormType::Inf => largest_magnitude(present.iter().filter(|(c, _)| *c).map(|(_, g)| g)),
    };
    LocalNormStats {
        non_finite: check_all && squared.iter().any(|(_, s)| !s.is_finite()),
        norm_part,
    }
}

/// The largest |g| over `grads` (0 for none), in one host read.
pub(crate) fn largest_magnitude<'a>(grads: impl Iterator<Item = &'a Tensor<1>>) -> f64 {
    let maxes: Vec<Tensor<1>> = grads
        .filter(|g| g.dims()[0] > 0)
        .map(|g| g.clone().abs().max())
        .collect();
    if maxes.is_empty() {
        return 0.0;
    }
    let maxes = Tensor::cat(maxes, 0).read_back();
    maxes.iter::<f32>().map(f64::from).fold(0.0, f64::max)
}

/// `max_norm / (total_norm + 1e-6)` when that is below 1, else 1 (also when `max_norm` is 0:
/// clipping off).
pub(crate) fn clip_coefficient(max_norm: f64, total_norm: f64) -> f64 {
    let coeff = max_norm / (total_norm + 1e-6);
    if max_norm > 0.0 && coeff < 1.0 {
        coeff
    } else {
        1.0
    }
}

/// Scales every gradient by `max_norm / (norm + 1e-6)` when that is below 1 (Megatron's
/// `clip_grad_by_total_norm_fp32`). Returns the coefficient applied (1 when none).
pub fn clip_grads_by_total_norm<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
    total_norm: f64,
) -> f64 {
    clip_grads_of(&float_params(module), grads, max_norm, total_norm)
}

/// [`clip_grads_by_total_norm`] over already-collected `(ParamId, rank)` pairs.
pub(crate) fn clip_grads_of(
    params: &[(ParamId, usize)],
    grads: &mut GradientsParams,
    max_norm: f64,
    total_norm: f64,
) -> f64 {
    let coeff = clip_coefficient(max_norm, total_norm);
    if coeff == 1.0 {
        return 1.0;
    }
    for &(id, rank) in params {
        let _ = update_flat::<std::convert::Infallible>(grads, id, rank, |g| Ok(g * coeff));
    }
    coeff
}

#[cfg(test)]
mod tests;
