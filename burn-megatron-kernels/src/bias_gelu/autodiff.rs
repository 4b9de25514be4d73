//! Autodiff for bias + GeLU: the forward runs the inner backend's op (a kernel on Cube
//! backends), the backward its handwritten derivative.

use super::{BiasGeluOps, Gelu};
use crate::ops::sum_to_last_dim;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, TensorMetadata};

#[derive(Debug)]
struct BiasGeluBackward;

impl<B: BiasGeluOps> Backward<B, 2> for BiasGeluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, Gelu);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, bias, form) = ops.state;
        let n = bias.shape().num_elements();
        let grad_x = B::bias_gelu_backward(x, bias, grad, form);
        if let Some(node) = node_bias {
            grads.register::<B>(node.id, sum_to_last_dim::<B>(grad_x.clone(), n));
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, grad_x);
        }
    }
}

impl<B: BiasGeluOps, C: CheckpointStrategy> BiasGeluOps for Autodiff<B, C> {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (bias, bias_node) = bias.into_parts();
        match BiasGeluBackward
            .prepare::<C>([x_node, bias_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::bias_gelu(x.clone(), bias.clone(), form);
                prep.finish((x, bias, form), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::bias_gelu(x, bias, form)),
        }
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        form: Gelu,
    ) -> FloatTensor<Self> {
        // Second derivatives are not needed: the result is not tracked.
        let (x, _) = x.into_parts();
        let (bias, _) = bias.into_parts();
        let (grad, _) = grad.into_parts();
        Self::from_inner(B::bias_gelu_backward(x, bias, grad, form))
    }
}
