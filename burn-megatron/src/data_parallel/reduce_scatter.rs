//! The data-parallel reduction of the distributed optimizer: each bucket of a [`ShardPlan`]
//! reduce-scattered (all-reduced when it holds parameters tied across stages).
//!
//! Gradients stay full-size tensors in `GradientsParams` (ZeRO-1 shards optimizer state,
//! not gradients): after the reduction a parameter's gradient holds the reduced values on
//! the elements this rank owns and zeros elsewhere. The tensor-parallel reduction of
//! sequence-parallel gradients that follows keeps that meaning, since every tensor-parallel
//! peer owns the same elements (their modules have the same shapes, so the same plan).

use super::DataParallelConfig;
use super::shard_plan::ShardPlan;
use crate::comm::tensor;
use crate::comm::{Buffer, Comm, CommError, ReduceOp, comm_dtype};
use crate::param_grads::{put_flat, take_flat, zero_padded};
use burn::optim::GradientsParams;
use burn::tensor::DType;

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
            DType::F32
        } else {
            comm_dtype(bucket.dtype).ok_or_else(|| {
                invalid(format!("{:?} gradients cannot be reduced", bucket.dtype))
            })?;
            bucket.dtype
        };
        // Every rank reduces every bucket, gradients or not, so the calls match.
        let mut present = Vec::new();
        for p in &bucket.params {
            if let Some((g, _)) = take_flat(grads, p.id, p.rank) {
                present.push((p.offset, g));
            }
        }
        let Some(device) = present.first().map(|(_, g)| g.device()) else {
            let mut flat = Buffer::zeros(comm_dtype(dtype).expect("checked above"), bucket.len);
            if bucket.all_reduced {
                dp.all_reduce(&mut flat, op)?;
            } else {
                dp.reduce_scatter(flat, op)?;
            }
            issued += 1;
            continue;
        };
        // The bucket on the device: each gradient at its offset, zeros elsewhere (padding,
        // and parameters without a gradient).
        let flat = zero_padded(bucket.len, dtype, &device, present);
        let (reduced, base) = if bucket.all_reduced {
            (tensor::all_reduce(&**dp, flat, op)?, 0..bucket.len)
        } else {
            let shard = tensor::reduce_scatter(&**dp, flat, 0, op)?;
            (shard, plan.shard_range(b))
        };
        issued += 1;
        for p in &bucket.params {
            // The elements of `p` this rank holds reduced, in `p`'s own coordinates; zeros
            // around them.
            let start = base.start.max(p.offset);
            let end = base.end.min(p.offset + p.numel);
            let mine = (start < end).then(|| {
                let part = reduced.clone().narrow(0, start - base.start, end - start);
                (start - p.offset, part)
            });
            let values = zero_padded(p.numel, dtype, &device, mine.into_iter().collect());
            put_flat(grads, p.id, values.cast(bucket.dtype), &p.dims);
        }
    }
    Ok(issued)
}
