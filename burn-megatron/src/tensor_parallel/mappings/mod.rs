//! Megatron's conjugate communication ops, differentiable in Burn's autodiff graph.
//!
//! | function | forward | backward |
//! | --- | --- | --- |
//! | [`copy_to_tensor_model_parallel_region`] | identity | all-reduce |
//! | [`reduce_from_tensor_model_parallel_region`] | all-reduce | identity |
//! | [`scatter_to_tensor_model_parallel_region`] | split last dim | all-gather last dim |
//! | [`gather_from_tensor_model_parallel_region`] | all-gather last dim | split last dim |
//! | [`scatter_to_sequence_parallel_region`] | split dim 0 | all-gather dim 0 |
//! | [`gather_from_sequence_parallel_region`] | all-gather dim 0 | reduce-scatter dim 0 (or split) |
//! | [`reduce_scatter_to_sequence_parallel_region`] | reduce-scatter dim 0 | all-gather dim 0 |
//! | [`all_to_all`] | rows of dim 0 to each member | the reverse exchange |
//! | [`gather_sequence_matmul`] | all-gather dim 0, times a weight | all-gather again, reduce-scatter dim 0 |
//!
//! On a group of one every function returns its input untouched: no op is recorded, no data
//! moves. Every rank of the group must call the same mappings in the same order, with tensors
//! that are all tracked or all untracked (the backward collective runs only for tracked ones).
//! Where mappings of several groups meet in one graph, every rank's graph must also have the
//! same shape around them: Burn's backward runs nodes by depth, so a branch on data (or an
//! empty `cat` or `slice`, which Burn leaves out of the graph) can order two groups'
//! collectives differently on two ranks, a deadlock (see `moe/dispatcher.rs`).
//! A failed collective inside the graph panics with the [`CommError`](crate::comm::CommError)
//! message; under [`launch::threads`](crate::launch::threads) that is reported with the rank
//! and the peers fail promptly.

#[cfg(feature = "cuda")]
mod device;
mod gathered;
pub(crate) mod host;
mod ops;

#[cfg(test)]
mod tests;

pub use gathered::SequenceGatherMatmulOps;
pub use ops::TensorParallelOps;

use crate::comm::Comm;
use crate::tensor_parallel::TpError;
use burn::backend::Dispatch;
use burn::tensor::Tensor;

/// One of Megatron's communication mappings (the forward half; see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mapping {
    /// Identity forward, all-reduce backward.
    CopyTo,
    /// All-reduce forward, identity backward.
    ReduceFrom,
    /// Split the last dim forward, all-gather it backward.
    ScatterToTp,
    /// All-gather the last dim forward, split it backward.
    GatherFromTp,
    /// Split dim 0 forward, all-gather it backward.
    ScatterToSp,
    /// All-gather dim 0 forward; backward reduce-scatters dim 0 when the output gradient is
    /// tensor-parallel (partial sums on each rank), else splits it.
    GatherFromSp {
        /// Whether the gradient arriving at the output is partial on each TP rank.
        tensor_parallel_output_grad: bool,
    },
    /// Reduce-scatter dim 0 forward, all-gather it backward.
    ReduceScatterToSp,
}

impl Mapping {
    /// The mapping whose forward is this one's backward.
    pub fn conjugate(self) -> Mapping {
        match self {
            Mapping::CopyTo => Mapping::ReduceFrom,
            Mapping::ReduceFrom => Mapping::CopyTo,
            Mapping::ScatterToTp => Mapping::GatherFromTp,
            Mapping::GatherFromTp => Mapping::ScatterToTp,
            Mapping::ScatterToSp | Mapping::ReduceScatterToSp => Mapping::GatherFromSp {
                tensor_parallel_output_grad: true,
            },
            Mapping::GatherFromSp {
                tensor_parallel_output_grad: true,
            } => Mapping::ReduceScatterToSp,
            Mapping::GatherFromSp {
                tensor_parallel_output_grad: false,
            } => Mapping::ScatterToSp,
        }
    }

    /// Megatron's name of the function.
    pub fn name(self) -> &'static str {
        match self {
            Mapping::CopyTo => "copy_to_tensor_model_parallel_region",
            Mapping::ReduceFrom => "reduce_from_tensor_model_parallel_region",
            Mapping::ScatterToTp => "scatter_to_tensor_model_parallel_region",
            Mapping::GatherFromTp => "gather_from_tensor_model_parallel_region",
            Mapping::ScatterToSp => "scatter_to_sequence_parallel_region",
            Mapping::GatherFromSp { .. } => "gather_from_sequence_parallel_region",
            Mapping::ReduceScatterToSp => "reduce_scatter_to_sequence_parallel_region",
        }
    }
}

/// Applies `mapping` to `x` over `comm`'s group (differentiably).
pub fn apply<const D: usize>(x: Tensor<D>, mapping: Mapping, comm: &Comm) -> Tensor<D> {
    if comm.group().size() == 1 {
        return x;
    }
    Tensor::from_dispatch(Dispatch::tensor_parallel_mapping(
        x.into_dispatch(),
        mapping,
        comm.clone(),
    ))
}

/// Identity forward; all-reduce of the gradient backward (entering a TP region).
pub fn copy_to_tensor_model_parallel_region<const D: usize>(x: Tensor<D>, tp: &Comm) -> Tensor<D> {
    apply(x, Mapping::CopyTo, tp)
}

/// All-reduce forward (leaving a TP region); identity backward.
pub fn reduce_from_tensor_model_parallel_region<const D: usize>(
    x: Tensor<D>,
    tp: &Comm,
) -> Tensor<D> {
    apply(x, Mapping::ReduceFrom, tp)
}

/// Keeps this rank's slice of the last dim; all-gathers the gradient backward.
pub fn scatter_to_tensor_model_parallel_region<const D: usize>(
    x: Tensor<D>,
    tp: &Comm,
) -> Tensor<D> {
    apply(x, Mapping::ScatterToTp, tp)
}

/// All-gathers the last dim (in rank order); keeps this rank's slice of the gradient.
pub fn gather_from_tensor_model_parallel_region<const D: usize>(
    x: Tensor<D>,
    tp: &Comm,
) -> Tensor<D> {
    apply(x, Mapping::GatherFromTp, tp)
}

/// Keeps this rank's slice of dim 0 (the sequence); all-gathers the gradient backward.
pub fn scatter_to_sequence_parallel_region<const D: usize>(x: Tensor<D>, tp: &Comm) -> Tensor<D> {
    apply(x, Mapping::ScatterToSp, tp)
}

/// All-gathers dim 0. Backward reduce-scatters the gradient when
/// `tensor_parallel_output_grad` (the output feeds a TP region, so each rank's gradient is
/// partial), else keeps this rank's slice.
pub fn gather_from_sequence_parallel_region<const D: usize>(
    x: Tensor<D>,
    tp: &Comm,
    tensor_parallel_output_grad: bool,
) -> Tensor<D> {
    apply(
        x,
        Mapping::GatherFromSp {
            tensor_parallel_output_grad,
        },
        tp,
    )
}

/// Reduce-scatters dim 0 (leaving a TP region into the sequence-parallel one); all-gathers
/// the gradient backward.
pub fn reduce_scatter_to_sequence_parallel_region<const D: usize>(
    x: Tensor<D>,
    tp: &Comm,
) -> Tensor<D> {
    apply(x, Mapping::ReduceScatterToSp, tp)
}

/// `x` (`[s / tp, b, h]`, this rank's positions of a sequence-first tensor) all-gathered
/// over the sequence and multiplied by `weight` (`[h, o]`): `[s, b, o]`, as
/// `gather_from_sequence_parallel_region(x, tp, true).matmul(weight)` gives, without keeping
/// the gathered copy for backward: backward all-gathers `x` again for the weight gradient and
/// reduce-scatters the input gradient (Megatron's column-parallel layer under sequence
/// parallelism). With `f32_weight_grad` the weight's gradient is summed and returned in f32,
/// as [`linear_with_grad_accumulation`](burn_megatron_kernels::linear_with_grad_accumulation)
/// returns it (Megatron's `gradient_accumulation_fusion`). The group may be of one.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::tensor_parallel::mappings::gather_sequence_matmul;
/// use std::sync::Arc;
///
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let device = Device::flex().autodiff();
/// let x = Tensor::<3>::ones([4, 2, 3], &device);
/// let w = Tensor::<2>::ones([3, 5], &device).require_grad();
/// let y = gather_sequence_matmul(x, w.clone(), false, &tp);
/// assert_eq!(y.dims(), [4, 2, 5]);
/// let gw = w.grad(&y.sum().backward()).unwrap(); // eight tokens of ones
/// assert_eq!(gw.into_data().iter::<f32>().collect::<Vec<_>>(), vec![8.0; 15]);
/// ```
pub fn gather_sequence_matmul(
    x: Tensor<3>,
    weight: Tensor<2>,
    f32_weight_grad: bool,
    tp: &Comm,
) -> Tensor<3> {
    Tensor::from_dispatch(Dispatch::sequence_gather_matmul(
        x.into_dispatch(),
        weight.into_dispatch(),
        f32_weight_grad,
        tp.clone(),
    ))
}

/// Sends `input_splits[j]` rows (dim 0) of `x` to member `j` of `comm`'s group and returns
/// the rows the members sent this one, `output_splits[i]` from member `i`, in group order
/// (Megatron's `all_to_all(group, input, output_split_sizes, input_split_sizes)`). Backward
/// sends each row's gradient back. Every member's splits are checked against its peers'
/// before any data moves.
///
/// # Errors
/// Splits that do not have one entry per member, or input splits that do not add up to
/// `x`'s rows.
pub fn all_to_all<const D: usize>(
    x: Tensor<D>,
    input_splits: &[usize],
    output_splits: &[usize],
    comm: &Comm,
) -> Result<Tensor<D>, TpError> {
    let n = comm.group().size();
    let rows = x.dims()[0];
    if input_splits.len() != n || output_splits.len() != n {
        return Err(TpError::Invalid(format!(
            "all_to_all over {}: {} input and {} output splits for {n} members",
            comm.group(),
            input_splits.len(),
            output_splits.len()
        )));
    }
    if input_splits.iter().sum::<usize>() != rows {
        return Err(TpError::Invalid(format!(
            "all_to_all over {}: input splits {input_splits:?} for {rows} rows",
            comm.group()
        )));
    }
    if n == 1 {
        return Ok(x);
    }
    Ok(Tensor::from_dispatch(Dispatch::all_to_all(
        x.into_dispatch(),
        input_splits.to_vec(),
        output_splits.to_vec(),
        comm.clone(),
    )))
}
