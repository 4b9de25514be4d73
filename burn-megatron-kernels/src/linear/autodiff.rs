//! Autodiff for the linear product: both backward products through `matmul_2d` on the
//! inner backend.

use super::LinearOps;
use burn::backend::Autodiff;
use burn::backend::TensorMetadata;
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

/// `c = a·b` over batch dims: `da = dc·bᵀ`, `db = aᵀ·dc` (Burn's matmul backward, without
/// its broadcast reduction: the batch dims are equal).
#[derive(Debug)]
struct BatchedBackward;

impl<B: LinearOps> Backward<B, 2> for BatchedBackward {
    /// The forward's `(a, b)`, each kept only if the other's gradient needs it.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let [node_a, node_b] = ops.parents;
        let last = grad.shape().num_dims() - 1;
        if let (Some(node), Some(a)) = (node_b, a) {
            let at = B::float_swap_dims(a, last - 1, last);
            grads.register::<B>(node.id, B::batched_matmul(at, grad.clone()));
        }
        if let (Some(node), Some(b)) = (node_a, b) {
            let bt = B::float_swap_dims(b, last - 1, last);
            grads.register::<B>(node.id, B::batched_matmul(grad, bt));
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

    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        // a is needed only for b's gradient, and b only for a's.
        let (keep_a, keep_b) = (b.is_tracked(), a.is_tracked());
        let (a, a_node) = a.into_parts();
        let (b, b_node) = b.into_parts();
        match BatchedBackward
            .prepare::<C>([a_node, b_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let c = B::batched_matmul(a.clone(), b.clone());
                prep.finish((keep_a.then_some(a), keep_b.then_some(b)), c)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::batched_matmul(a, b)),
        }
    }
}
