//! The mappings as a Burn backend extension: each op's forward runs on the inner backend,
//! and the `Autodiff` implementation records the conjugate op as its backward.

use super::Mapping;
use super::host::{all_to_all_rows, forward};
use crate::comm::Comm;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension};

/// Megatron's tensor- and sequence-parallel communication as backend ops.
///
/// Each method is the forward of one [`Mapping`]; on `Autodiff` its backward is the
/// conjugate mapping. Prefer the free functions of [`mappings`](super), which skip the op
/// entirely on a group of one.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait TensorParallelOps: Backend {
    /// Runs `mapping` on `x` over the group of `comm`.
    fn tensor_parallel_mapping(
        x: FloatTensor<Self>,
        mapping: Mapping,
        comm: Comm,
    ) -> FloatTensor<Self>;

    /// Sends `send[j]` rows (dim 0) of `x` to member `j` of `comm`'s group and returns the
    /// `recv[i]` rows each member `i` sent, in group order (expert parallelism's token
    /// exchange); on `Autodiff` its backward is the reverse exchange.
    fn all_to_all(
        x: FloatTensor<Self>,
        send: Vec<usize>,
        recv: Vec<usize>,
        comm: Comm,
    ) -> FloatTensor<Self>;
}

impl TensorParallelOps for Flex {
    fn tensor_parallel_mapping(
        x: FloatTensor<Self>,
        mapping: Mapping,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(mapping, x, &comm)
    }

    fn all_to_all(
        x: FloatTensor<Self>,
        send: Vec<usize>,
        recv: Vec<usize>,
        comm: Comm,
    ) -> FloatTensor<Self> {
        all_to_all_rows::<Self>(x, &send, &recv, &comm)
    }
}

// CUDA tensors over NCCL stay on the device; everything else goes through host memory.
#[cfg(feature = "cube")]
impl TensorParallelOps for burn::backend::Cube {
    fn tensor_parallel_mapping(
        x: FloatTensor<Self>,
        mapping: Mapping,
        comm: Comm,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = super::device::collectives(&x, &comm) {
            return super::device::forward(mapping, x, &comm, dev);
        }
        forward::<Self>(mapping, x, &comm)
    }

    fn all_to_all(
        x: FloatTensor<Self>,
        send: Vec<usize>,
        recv: Vec<usize>,
        comm: Comm,
    ) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = super::device::collectives(&x, &comm) {
            return super::device::all_to_all(x, &send, &recv, &comm, dev);
        }
        all_to_all_rows::<Self>(x, &send, &recv, &comm)
    }
}

#[derive(Debug)]
struct MappingBackward;

impl<B: TensorParallelOps> Backward<B, 1> for MappingBackward {
    type State = (Mapping, Comm);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (mapping, comm) = ops.state;
        if let Some(parent) = parent {
            let grad = B::tensor_parallel_mapping(grad, mapping.conjugate(), comm);
            grads.register::<B>(parent.id, grad);
        }
    }
}

#[derive(Debug)]
struct AllToAllBackward;

impl<B: TensorParallelOps> Backward<B, 1> for AllToAllBackward {
    type State = (Vec<usize>, Vec<usize>, Comm);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (send, recv, comm) = ops.state;
        if let Some(parent) = parent {
            // Each row's gradient goes back where the row came from.
            grads.register::<B>(parent.id, B::all_to_all(grad, recv, send, comm));
        }
    }
}

impl<B: TensorParallelOps, C: CheckpointStrategy> TensorParallelOps for Autodiff<B, C> {
    fn tensor_parallel_mapping(
        x: FloatTensor<Self>,
        mapping: Mapping,
        comm: Comm,
    ) -> FloatTensor<Self> {
        let (primitive, node) = x.into_parts();
        // Compute-bound: a checkpointed graph keeps the output rather than re-running the
        // collective during backward, which peers would not join.
        match MappingBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::tensor_parallel_mapping(primitive, mapping, comm.clone());
                prep.finish((mapping, comm), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::tensor_parallel_mapping(primitive, mapping, comm))
            }
        }
    }

    fn all_to_all(
        x: FloatTensor<Self>,
        send: Vec<usize>,
        recv: Vec<usize>,
        comm: Comm,
    ) -> FloatTensor<Self> {
        let (primitive, node) = x.into_parts();
        match AllToAllBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::all_to_all(primitive, send.clone(), recv.clone(), comm.clone());
                prep.finish((send, recv, comm), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::all_to_all(primitive, send, recv, comm)),
        }
    }
}
