//! Autodiff for SwiGLU: the forward runs the inner backend's op and saves `gate` and `up`;
//! the backward runs the inner backend's backward op (one pass on Flex, one kernel on Cube)
//! for both gradients at once.

use super::SwigluOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct SwigluBackward;

impl<B: SwigluOps> Backward<B, 2> for SwigluBackward {
    /// (gate, up).
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = B::swiglu_backward(gate, up, grad);
        if let Some(node) = node_gate {
            grads.register::<B>(node.id, d_gate);
        }
        if let Some(node) = node_up {
            grads.register::<B>(node.id, d_up);
        }
    }
}

impl<B: SwigluOps, C: CheckpointStrategy> SwigluOps for Autodiff<B, C> {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gate, gate_node) = gate.into_parts();
        let (up, up_node) = up.into_parts();
        match SwigluBackward
            .prepare::<C>([gate_node, up_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::swiglu(gate.clone(), up.clone());
                prep.finish((gate, up), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate, up)),
        }
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Second derivatives are not needed: the results are not tracked.
        let (d_gate, d_up) =
            B::swiglu_backward(gate.into_parts().0, up.into_parts().0, grad.into_parts().0);
        (Self::from_inner(d_gate), Self::from_inner(d_up))
    }
}
