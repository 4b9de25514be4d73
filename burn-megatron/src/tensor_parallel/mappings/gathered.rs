//! The product of an all-gathered sequence with a weight, which keeps this rank's positions
//! instead of the gathered copy: backward gathers again for the weight gradient. Megatron's
//! `LinearWithGradAccumulationAndAsyncCommunication` under sequence parallelism does the
//! same; a Burn matmul after [`gather_from_sequence_parallel_region`](super::gather_from_sequence_parallel_region)
//! would keep the whole sequence, and sequence parallelism would then save little. The
//! products are the kernels' (`LinearOps::matmul_2d`: cuBLASLt on CUDA).

use super::{Mapping, TensorParallelOps};
use crate::comm::Comm;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Flex, TensorMetadata, backend_extension};
use burn::tensor::Shape;
use burn_megatron_kernels::{GradAccumOps, LinearOps};

/// The gathered product as a backend op (see [`gather_sequence_matmul`](super::gather_sequence_matmul)).
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait SequenceGatherMatmulOps: TensorParallelOps + LinearOps + GradAccumOps {
    /// `x` `[s / tp, b, h]` (this rank's positions) gathered to `[s, b, h]`, times `weight`
    /// `[h, o]`: `[s, b, o]`. With `f32_weight_grad` the weight's gradient is summed and
    /// returned in f32 (gradient accumulation fusion).
    fn sequence_gather_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        f32_weight_grad: bool,
        comm: Comm,
    ) -> FloatTensor<Self>;
}

impl SequenceGatherMatmulOps for Flex {
    fn sequence_gather_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        _: bool,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(x, weight, &comm)
    }
}

#[cfg(feature = "cube")]
impl SequenceGatherMatmulOps for burn::backend::Cube {
    fn sequence_gather_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        _: bool,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(x, weight, &comm)
    }
}

/// `x` gathered over the sequence (dim 0), as `[s · b, h]`.
fn gathered<B: SequenceGatherMatmulOps>(
    x: FloatTensor<B>,
    comm: &Comm,
) -> (FloatTensor<B>, [usize; 2]) {
    let gather = Mapping::GatherFromSp {
        tensor_parallel_output_grad: true,
    };
    let x = B::tensor_parallel_mapping(x, gather, comm.clone());
    let dims = x.shape().to_vec();
    let (s, b, h) = (dims[0], dims[1], dims[2]);
    (B::float_reshape(x, Shape::from([s * b, h])), [s, b])
}

fn forward<B: SequenceGatherMatmulOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    comm: &Comm,
) -> FloatTensor<B> {
    let o = weight.shape().to_vec()[1];
    let (x, [s, b]) = gathered::<B>(x, comm);
    B::float_reshape(B::matmul_2d(x, weight), Shape::from([s, b, o]))
}

#[derive(Debug)]
struct GatherMatmulBackward;

impl<B: SequenceGatherMatmulOps> Backward<B, 2> for GatherMatmulBackward {
    /// This rank's positions, the weight, an f32 weight gradient, and the group.
    type State = (FloatTensor<B>, FloatTensor<B>, bool, Comm);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_parent, w_parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, f32_weight_grad, comm) = ops.state;
        let dims = grad.shape().to_vec();
        let (s, b, o) = (dims[0], dims[1], dims[2]);
        let grad = B::float_reshape(grad, Shape::from([s * b, o]));
        // Every rank has the same parents tracked, so the collectives below pair up.
        if let Some(parent) = w_parent {
            let (x, _) = gathered::<B>(x, &comm);
            let dw = match f32_weight_grad {
                true => B::weight_grad_f32(x, grad.clone()),
                false => B::matmul_2d(B::float_transpose(x), grad.clone()),
            };
            grads.register::<B>(parent.id, dw);
        }
        if let Some(parent) = x_parent {
            let h = weight.shape().to_vec()[0];
            let dx = B::matmul_2d(grad, B::float_transpose(weight));
            let dx = B::float_reshape(dx, Shape::from([s, b, h]));
            // The ranks' partial input gradients, summed, each rank keeping its positions.
            let dx = B::tensor_parallel_mapping(dx, Mapping::ReduceScatterToSp, comm);
            grads.register::<B>(parent.id, dx);
        }
    }
}

impl<B: SequenceGatherMatmulOps, C: CheckpointStrategy> SequenceGatherMatmulOps for Autodiff<B, C> {
    fn sequence_gather_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        f32_weight_grad: bool,
        comm: Comm,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (weight, w_node) = weight.into_parts();
        // Compute-bound: a checkpointed graph keeps the output rather than re-running the
        // collective during backward, which peers would not join.
        match GatherMatmulBackward
            .prepare::<C>([x_node, w_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = forward::<B>(x.clone(), weight.clone(), &comm);
                prep.finish((x, weight, f32_weight_grad, comm), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward::<B>(x, weight, &comm)),
        }
    }
}
