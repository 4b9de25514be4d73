//! Autodiff for weight-gradient accumulation, which runs inside a backward (on the inner
//! backend, untracked), and for the linear product whose backward calls it.

use super::GradAccumOps;
use crate::LinearOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

/// `y = x·w`: `dx = dy·wᵀ`, `dw = xᵀ·dy` summed in f32, an f32 tensor.
#[derive(Debug)]
struct LinearBackward;

impl<B: GradAccumOps + LinearOps> Backward<B, 2> for LinearBackward {
    /// The forward's `(x [tokens, in], w [in, out])`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let [node_x, node_w] = ops.parents;
        if let Some(node) = node_w {
            grads.register::<B>(node.id, B::weight_grad_f32(x, grad.clone()));
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::matmul_2d(grad, B::float_transpose(w)));
        }
    }
}

impl<B: GradAccumOps + LinearOps, C: CheckpointStrategy> GradAccumOps for Autodiff<B, C> {
    fn accumulate_weight_grad(
        main_grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::accumulate_weight_grad(
            main_grad.into_primitive(),
            x.into_primitive(),
            dy.into_primitive(),
        ))
    }

    fn weight_grad_f32(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::weight_grad_f32(x.into_primitive(), dy.into_primitive()))
    }

    fn linear_fp32_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (w, w_node) = weight.into_parts();
        match LinearBackward
            .prepare::<C>([x_node, w_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::linear_fp32_weight_grad(x.clone(), w.clone());
                prep.finish((x, w), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_fp32_weight_grad(x, w)),
        }
    }
}
