//! The data-parallel reduction of the distributed optimizer: each bucket of a [`ShardPlan`]
//! reduce-scattered (all-reduced when it holds parameters tied across stages).
//!
//! Gradients stay full-size tensors in `GradientsParams` (ZeRO-1 shards optimizer state,
//! not gradients): after the reduction a parameter's gradient holds the reduced values on
//! the elements this rank owns and zeros elsewhere. The tensor-parallel reduction of
//! sequence-parallel gradients that follows keeps that meaning, since every tensor-parallel
//! peer owns the same elements (their modules have the same shapes, so the same plan).

use super::DataParallelConfig;
use super::finalize::finalize_non_dp;
use super::shard::ShardPlan;
use crate::comm::tensor::{buffer_to_tensor, data_to_buffer};
use crate::comm::{Buffer, Comm, CommDType, CommError, ReduceOp, comm_dtype};
use crate::param_grads::{put_flat, take_flat};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::device::ReadBack;

/// Reduces every bucket of `plan` over `dp` (averaged by default): reduce-scattered, or
/// all-reduced for tied parameters. Returns the number of collectives issued.
pub fn reduce_scatter_gradients(
    plan: &ShardPlan,
    grads: &mut GradientsParams,
    dp: &Comm,
    config: &DataParallelConfig,
) -> Result<usize, CommError> {
    let op = if config.average {
        ReduceOp::Avg
    } else {
        ReduceOp::Sum
    };
    reduce_scatter_with(plan, grads, dp, config, op)
}

/// [`reduce_scatter_gradients`] with reduction `op`.
pub(super) fn reduce_scatter_with(
    plan: &ShardPlan,
    grads: &mut GradientsParams,
    dp: &Comm,
    config: &DataParallelConfig,
    op: ReduceOp,
) -> Result<usize, CommError> {
    let invalid = |reason: String| CommError::InvalidArgument {
        group: dp.group().to_string(),
        op: "reduce_scatter",
        reason,
    };
    plan.check_group(dp.group(), "reduce_scatter")?;
    if plan.size() == 1 {
        return Ok(0);
    }
    let mut issued = 0;
    for (b, bucket) in plan.buckets().iter().enumerate() {
        let dtype = if config.reduce_in_fp32 {
            CommDType::F32
        } else {
            comm_dtype(bucket.dtype)
                .ok_or_else(|| invalid(format!("{:?} gradients cannot be reduced", bucket.dtype)))?
        };
        let mut flat = Buffer::zeros(dtype, bucket.len);
        let mut device = None;
        for p in &bucket.params {
            let Some((g, _)) = take_flat(grads, p.id, p.rank) else {
                continue;
            };
            device.get_or_insert_with(|| g.device());
            let g = if dtype == CommDType::F32 {
                g.cast(DType::F32)
            } else {
                g
            };
            flat.write_at(p.offset, &data_to_buffer(g.read_back()).map_err(invalid)?);
        }
        // Every rank reduces every bucket, gradients or not, so the calls match.
        let (reduced, base) = if bucket.all_reduced {
            dp.all_reduce(&mut flat, op)?;
            (flat, 0..bucket.len)
        } else {
            (dp.reduce_scatter(flat, op)?, plan.shard_range(b))
        };
        issued += 1;
        let Some(device) = device else { continue };
        for p in &bucket.params {
            // The elements of `p` this rank holds reduced, in `p`'s own coordinates.
            let start = base.start.max(p.offset);
            let end = base.end.min(p.offset + p.numel);
            let mut values = Buffer::zeros(dtype, p.numel);
            if start < end {
                let part = reduced.slice(start - base.start..end - base.start);
                values.write_at(start - p.offset, &part);
            }
            let t: Tensor<1> = buffer_to_tensor(values, [p.numel], &device);
            put_flat(grads, p.id, t.cast(bucket.dtype), &p.dims);
        }
    }
    Ok(issued)
}

/// [`finalize_model_grads`](super::advanced::finalize_model_grads) for the distributed optimizer:
/// each model chunk's plan reduced over `dp` ([`reduce_scatter_gradients`]), then the
/// sequence-parallel and embedding reductions of `module` (all chunks).
pub fn finalize_model_grads_distributed<M: Module>(
    plans: &[ShardPlan],
    module: &M,
    grads: &mut GradientsParams,
    dp: &Comm,
    tp: &Comm,
    embedding: Option<&Comm>,
    config: &DataParallelConfig,
) -> Result<(), CommError> {
    for plan in plans {
        reduce_scatter_gradients(plan, grads, dp, config)?;
    }
    finalize_non_dp(module, grads, tp, embedding, config)
}
