//! Autodiff for LayerNorm: the forward runs the inner backend's op and saves `x`, `gamma`
//! and the per-row mean and `1/σ` (f32) it returns; the backward runs the inner backend's
//! backward op (one fused pass on Flex, kernels on Cube) for all three gradients at once.

use super::LayerNormOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct LayerNormBackward;

impl<B: LayerNormOps> Backward<B, 3> for LayerNormBackward {
    /// (x, gamma, mean, rstd).
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, gamma, mean, rstd) = ops.state;
        let (dx, dgamma, dbeta) = B::layer_norm_backward(x, gamma, mean, rstd, grad);
        for (node, grad) in [(node_x, dx), (node_gamma, dgamma), (node_beta, dbeta)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: LayerNormOps, C: CheckpointStrategy> LayerNormOps for Autodiff<B, C> {
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (x, x_node) = x.into_parts();
        let (gamma, gamma_node) = gamma.into_parts();
        let (beta, beta_node) = beta.into_parts();
        // `mean` and `rstd` are by-products for the backward: returned untracked.
        match LayerNormBackward
            .prepare::<C>([x_node, gamma_node, beta_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, mean, rstd) =
                    B::layer_norm_forward(x.clone(), gamma.clone(), beta, epsilon);
                let y = prep.finish((x, gamma, mean.clone(), rstd.clone()), y);
                (y, Self::from_inner(mean), Self::from_inner(rstd))
            }
            OpsKind::UnTracked(prep) => {
                let (y, mean, rstd) = B::layer_norm_forward(x, gamma, beta, epsilon);
                (
                    prep.finish(y),
                    Self::from_inner(mean),
                    Self::from_inner(rstd),
                )
            }
        }
    }

    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // Second derivatives are not needed: the results are not tracked.
        let (dx, dgamma, dbeta) = B::layer_norm_backward(
            x.into_parts().0,
            gamma.into_parts().0,
            mean.into_parts().0,
            rstd.into_parts().0,
            grad.into_parts().0,
        );
        (
            Self::from_inner(dx),
            Self::from_inner(dgamma),
            Self::from_inner(dbeta),
        )
    }
}
