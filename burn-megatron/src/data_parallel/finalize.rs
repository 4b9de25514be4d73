//! The gradient reductions of data parallelism (and the tensor-parallel and embedding-group
//! ones that finish a step), behind [`ParallelTraining::finalize`](crate::training::ParallelTraining::finalize).

use super::overlap::OverlapReducer;
use super::shard_plan::ShardPlan;
use super::{DataParallelConfig, reduce_scatter};
use crate::comm::tensor;
use crate::comm::{Comm, CommError, ReduceOp};
use crate::param_grads::{float_params, put_flat, take_flat};
use crate::tensor_parallel::{allreduce_sequence_parallel_grads, parallel_attrs};
use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

/// Groups parameters (with their element counts, in module order) into buckets: in reverse
/// order, as gradients become ready in backward, a bucket closing once it holds at least
/// `bucket_size` elements. Returns indices into `numels`.
///
/// ```
/// use burn_megatron::data_parallel::advanced::bucket_layout;
/// assert_eq!(bucket_layout(&[10, 20, 30, 5], 25), vec![vec![3, 2], vec![1, 0]]);
/// ```
pub fn bucket_layout(numels: &[usize], bucket_size: usize) -> Vec<Vec<usize>> {
    let mut buckets = Vec::new();
    let (mut current, mut filled) = (Vec::new(), 0);
    for i in (0..numels.len()).rev() {
        current.push(i);
        filled += numels[i];
        if filled >= bucket_size {
            buckets.push(std::mem::take(&mut current));
            filled = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// A gradient taken out for its bucket: flat, in the dtype it is reduced in.
struct Grad {
    id: ParamId,
    dims: Vec<usize>,
    dtype: DType,
    flat: Tensor<1>,
}

/// Reduces the gradients of `params` over `comm` in contiguous buckets; returns the number of
/// collectives issued. Each bucket is concatenated on the device and reduced by
/// [`tensor::all_reduce`]: in device memory over NCCL, with one host read per bucket
/// elsewhere.
fn reduce_in_buckets(
    params: &[(ParamId, usize)],
    grads: &mut GradientsParams,
    comm: &Comm,
    config: &DataParallelConfig,
    op: ReduceOp,
) -> Result<usize, CommError> {
    let mut ready = Vec::new();
    for &(id, rank) in params {
        if let Some((g, dims)) = take_flat(grads, id, rank) {
            let dtype = g.dtype();
            let flat = if config.reduce_in_fp32 {
                g.cast(DType::F32)
            } else {
                g
            };
            ready.push(Grad {
                id,
                dims,
                dtype,
                flat,
            });
        }
    }
    let numels: Vec<usize> = ready.iter().map(|g| g.flat.dims()[0]).collect();
    let mut issued = 0;
    let mut slots: Vec<Option<Grad>> = ready.into_iter().map(Some).collect();
    let reduced_dtype =
        |slots: &[Option<Grad>], i: usize| slots[i].as_ref().map(|g| g.flat.dtype());
    for bucket in bucket_layout(&numels, config.bucket_elements(comm.group().size())) {
        // One bucket may mix dtypes only when not reducing in fp32: split it by dtype.
        let mut by_dtype: Vec<Vec<usize>> = Vec::new();
        for &i in &bucket {
            let d = reduced_dtype(&slots, i);
            match by_dtype
                .iter_mut()
                .find(|b| reduced_dtype(&slots, b[0]) == d)
            {
                Some(b) => b.push(i),
                None => by_dtype.push(vec![i]),
            }
        }
        for part in by_dtype {
            let taken: Vec<Grad> = part
                .iter()
                .map(|&i| slots[i].take().expect("each gradient is in one bucket"))
                .collect();
            let flat = Tensor::cat(taken.iter().map(|g| g.flat.clone()).collect(), 0);
            let flat = tensor::all_reduce(&**comm, flat, op)?;
            issued += 1;
            let mut at = 0;
            for g in taken {
                let len = g.flat.dims()[0];
                let reduced = flat.clone().narrow(0, at, len).cast(g.dtype);
                put_flat(grads, g.id, reduced, &g.dims);
                at += len;
            }
        }
    }
    Ok(issued)
}

/// All-reduces every gradient of `module` over the data-parallel group `dp` (averaged by
/// default), in buckets. Returns the number of collectives issued.
pub fn all_reduce_gradients<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    dp: &Comm,
    config: &DataParallelConfig,
) -> Result<usize, CommError> {
    if dp.group().size() == 1 {
        return Ok(0);
    }
    let op = if config.average {
        ReduceOp::Avg
    } else {
        ReduceOp::Sum
    };
    reduce_in_buckets(&dense_params(module), grads, dp, config, op)
}

/// The parameters the dense data-parallel group reduces: all but the experts'.
pub(crate) fn dense_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    float_params(module)
        .into_iter()
        .filter(|&(id, _)| !parallel_attrs(id).expert)
        .collect()
}

/// How [`finalize_model_grads`] and [`finalize_expert_grads`] reduce over the
/// data-parallel group: Megatron's three ways, chosen by `--overlap-grad-reduce` and
/// `--use-distributed-optimizer`.
#[derive(Debug, Clone, Copy)]
pub enum DpReduction<'a> {
    /// All-reduced over the group after backward, in buckets.
    AllReduce(&'a Comm),
    /// Reduce-scattered over the group by each model chunk's plan (the distributed
    /// optimizer): this rank keeps the reduced values of the elements it owns, zeros
    /// elsewhere.
    ReduceScatter(&'a Comm, &'a [ShardPlan]),
    /// Started during backward by these reducers, one per model chunk (Megatron's
    /// `start_grad_sync`): waited for here (its `finish_grad_sync`).
    Overlapped(&'a [OverlapReducer]),
}

/// Reduces the gradients of `module`'s expert parameters over the expert data-parallel
/// group (Megatron's `expt_dp_group`), all-reduced or reduce-scattered by the experts' plans
/// ([`ShardPlan::experts`]); the experts' reduction does not overlap backward. Each expert
/// saw the tokens of every dense data-parallel replica of its expert-parallel group, so the
/// sum is scaled by `1 / data_parallel_size` (the dense DP × CP size) when `config.average`,
/// as Megatron-Core's `expert_gradient_scaling_factor`: the result is the gradient of the
/// replicas' mean loss, as the dense parameters' average is.
///
/// [`finalize_model_grads`] reduces only the dense parameters; a model with experts calls
/// this too (as [`ParallelTraining::finalize`](crate::training::ParallelTraining::finalize)
/// does).
pub fn finalize_expert_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    reduction: DpReduction<'_>,
    data_parallel_size: usize,
    config: &DataParallelConfig,
) -> Result<(), CommError> {
    let experts = expert_params(module);
    match reduction {
        DpReduction::AllReduce(expert_dp) => {
            if !experts.is_empty() && expert_dp.group().size() > 1 {
                reduce_in_buckets(&experts, grads, expert_dp, config, ReduceOp::Sum)?;
            }
        }
        DpReduction::ReduceScatter(expert_dp, plans) => {
            for plan in plans {
                reduce_scatter::reduce_scatter_with(plan, grads, expert_dp, config, ReduceOp::Sum)?;
            }
        }
        DpReduction::Overlapped(_) => {
            return Err(CommError::InvalidArgument {
                group: "expert data-parallel".into(),
                op: "finalize_expert_grads",
                reason: "the experts' reduction does not overlap backward: pass AllReduce or \
                         ReduceScatter"
                    .into(),
            });
        }
    }
    scale_expert_grads(&experts, grads, data_parallel_size, config)
}

/// The expert parameters of `module` (id, tensor rank), which [`finalize_expert_grads`]
/// reduces and the dense reductions leave alone.
pub(crate) fn expert_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    float_params(module)
        .into_iter()
        .filter(|&(id, _)| parallel_attrs(id).expert)
        .collect()
}

/// The experts' gradients summed over their replicas, × `1 / data_parallel_size` when
/// `config.average` (see [`finalize_expert_grads`]).
fn scale_expert_grads(
    experts: &[(ParamId, usize)],
    grads: &mut GradientsParams,
    data_parallel_size: usize,
    config: &DataParallelConfig,
) -> Result<(), CommError> {
    if !config.average || data_parallel_size <= 1 {
        return Ok(());
    }
    let scale = 1.0 / data_parallel_size as f64;
    for &(id, rank) in experts {
        crate::param_grads::update_flat(grads, id, rank, |g| Ok::<_, CommError>(g * scale))?;
    }
    Ok(())
}

/// Megatron's `finalize_model_grads`: the data-parallel reduction `reduction` asks for,
/// then the tensor-parallel all-reduce of sequence-parallel parameters' gradients, then the
/// embedding-group all-reduce of shared-embedding gradients (tied word embeddings across
/// pipeline stages; pass `None` without pipelines). Expert parameters are left to
/// [`finalize_expert_grads`].
pub fn finalize_model_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    reduction: DpReduction<'_>,
    tp: &Comm,
    embedding: Option<&Comm>,
    config: &DataParallelConfig,
) -> Result<(), CommError> {
    match reduction {
        DpReduction::AllReduce(dp) => {
            all_reduce_gradients(module, grads, dp, config)?;
        }
        DpReduction::ReduceScatter(dp, plans) => {
            for plan in plans {
                reduce_scatter::reduce_scatter_gradients(plan, grads, dp, config)?;
            }
        }
        DpReduction::Overlapped(reducers) => {
            for reducer in reducers {
                reducer.finish(grads)?;
            }
        }
    }
    // Megatron's `_allreduce_layernorm_grads`: the sequence-parallel parameters' partial
    // gradients summed over the tensor-parallel group.
    allreduce_sequence_parallel_grads(module, grads, tp)?;
    allreduce_embedding_grads(module, grads, embedding, config)
}

/// Megatron's `_allreduce_embedding_grads`: the gradients of a word embedding tied across
/// the first and last pipeline stages, summed over the embedding group.
fn allreduce_embedding_grads<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    embedding: Option<&Comm>,
    config: &DataParallelConfig,
) -> Result<(), CommError> {
    if let Some(embd) = embedding.filter(|c| c.group().size() > 1) {
        let shared: Vec<(ParamId, usize)> = dense_params(module)
            .into_iter()
            .filter(|&(id, _)| parallel_attrs(id).shared_embedding)
            .collect();
        reduce_in_buckets(&shared, grads, embd, config, ReduceOp::Sum)?;
    }
    Ok(())
}
