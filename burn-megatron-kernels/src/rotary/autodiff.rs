//! Autodiff for the rotary embedding: the tables are constants (their graph, if any, is
//! cut), the forward's gradient is the inner backend's transposed rotation of the output's.

use super::RotaryOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct RotaryBackward;

impl<B: RotaryOps> Backward<B, 1> for RotaryBackward {
    /// (cos, sin).
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        if let Some(node) = node {
            grads.register::<B>(node.id, B::rotary_backward(grad, cos, sin));
        }
    }
}

impl<B: RotaryOps, C: CheckpointStrategy> RotaryOps for Autodiff<B, C> {
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        match RotaryBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::rotary(x, cos.clone(), sin.clone());
                prep.finish((cos, sin), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rotary(x, cos, sin)),
        }
    }

    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // Second derivatives are not needed: the result is not tracked.
        Self::from_inner(B::rotary_backward(
            grad.into_primitive(),
            cos.into_primitive(),
            sin.into_primitive(),
        ))
    }
}
