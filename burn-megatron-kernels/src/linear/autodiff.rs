//! Autodiff for the linear product: both backward products through `matmul_2d` on the
//! inner backend.

use super::LinearOps;
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;

/// `y = x·w`: `dx = dy·wᵀ`, `dw = xᵀ·dy`.
#[derive(Debug)]
struct LinearBackward;

impl<B: LinearOps> Backward<B, 2> for LinearBackward {
    /// The forward's `(x [tokens, in], w [in, out])`, each kept only if the other's
    /// gradient needs it.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let [node_x, node_w] = ops.parents;
        if let (Some(node), Some(x)) = (node_w, x) {
            grads.register::<B>(node.id, B::matmul_2d(B::float_transpose(x), grad.clone()));
        }
        if let (Some(node), Some(w)) = (node_x, w) {
            grads.register::<B>(node.id, B::matmul_2d(grad, B::float_transpose(w)));
        }
    }
}

impl<B: LinearOps, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    /// Tracked as Burn's own matmul is.
    fn matmul_2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
    }

    fn linear_2d(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        // x is needed only for w's gradient, and w only for x's.
        let (keep_x, keep_w) = (weight.is_tracked(), x.is_tracked());
        let (x, x_node) = x.into_parts();
        let (w, w_node) = weight.into_parts();
        match LinearBackward
            .prepare::<C>([x_node, w_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::linear_2d(x.clone(), w.clone());
                prep.finish((keep_x.then_some(x), keep_w.then_some(w)), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_2d(x, w)),
        }
    }
}
