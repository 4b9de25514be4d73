//! Autodiff for the fused ops: the forward runs the inner backend's op (a kernel on Cube
//! backends), the backward its handwritten derivative.

use crate::bias_gelu::FusedOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, TensorMetadata};
use burn::tensor::Shape;

#[derive(Debug)]
struct BiasGeluBackward;

impl<B: FusedOps> Backward<B, 2> for BiasGeluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, bias) = ops.state;
        let n = bias.shape().num_elements();
        let grad_x = B::bias_gelu_backward(x, bias, grad);
        if let Some(node) = node_bias {
            let rows = grad_x.shape().num_elements() / n.max(1);
            let flat = B::float_reshape(grad_x.clone(), Shape::from([rows, n]));
            let summed = B::float_sum_dim(flat, 0);
            grads.register::<B>(node.id, B::float_reshape(summed, Shape::from([n])));
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, grad_x);
        }
    }
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (bias, bias_node) = bias.into_parts();
        match BiasGeluBackward
            .prepare::<C>([x_node, bias_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::bias_gelu(x.clone(), bias.clone());
                prep.finish((x, bias), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::bias_gelu(x, bias)),
        }
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // Second derivatives are not needed: the result is not tracked.
        let (x, _) = x.into_parts();
        let (bias, _) = bias.into_parts();
        let (grad, _) = grad.into_parts();
        Self::from_inner(B::bias_gelu_backward(x, bias, grad))
    }
}
