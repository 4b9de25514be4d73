//! Autodiff for RMSNorm: the forward runs the inner backend's op and saves `x`, `gamma` and
//! the per-row `1/rms` (f32) it returns; the backward runs the inner backend's backward op
//! (one fused pass on Flex, kernels on Cube) for both gradients at once.

use super::RmsNormOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct RmsNormBackward;

impl<B: RmsNormOps> Backward<B, 2> for RmsNormBackward {
    /// (x, gamma, inv_rms).
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, inv_rms) = ops.state;
        let (dx, dgamma) = B::rms_norm_backward(x, gamma, inv_rms, grad);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<B>(node.id, dgamma);
        }
    }
}

impl<B: RmsNormOps, C: CheckpointStrategy> RmsNormOps for Autodiff<B, C> {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, x_node) = x.into_parts();
        let (gamma, gamma_node) = gamma.into_parts();
        // `inv_rms` is a by-product for the backward: returned untracked.
        match RmsNormBackward
            .prepare::<C>([x_node, gamma_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, inv_rms) = B::rms_norm_forward(x.clone(), gamma.clone(), epsilon);
                let y = prep.finish((x, gamma, inv_rms.clone()), y);
                (y, Self::from_inner(inv_rms))
            }
            OpsKind::UnTracked(prep) => {
                let (y, inv_rms) = B::rms_norm_forward(x, gamma, epsilon);
                (prep.finish(y), Self::from_inner(inv_rms))
            }
        }
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        inv_rms: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Second derivatives are not needed: the results are not tracked.
        let (dx, dgamma) = B::rms_norm_backward(
            x.into_parts().0,
            gamma.into_parts().0,
            inv_rms.into_parts().0,
            grad.into_parts().0,
        );
        (Self::from_inner(dx), Self::from_inner(dgamma))
    }
}
