//! Autodiff for the scaled masked softmax: the output (not the scores) is saved, and the
//! backward runs the inner backend's backward op (a kernel on Cube backends).

use super::ScaledMaskedSoftmaxOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct SoftmaxBackward;

impl<B: ScaledMaskedSoftmaxOps> Backward<B, 1> for SoftmaxBackward {
    /// (output, key padding, padded, scale, causal).
    type State = (FloatTensor<B>, BoolTensor<B>, bool, f32, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (output, key_padding, padded, scale, causal) = ops.state;
        if let Some(node) = node {
            let dx =
                B::scaled_masked_softmax_backward(output, grad, key_padding, padded, scale, causal);
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: ScaledMaskedSoftmaxOps, C: CheckpointStrategy> ScaledMaskedSoftmaxOps for Autodiff<B, C> {
    fn scaled_masked_softmax(
        scores: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self> {
        let (scores, node) = scores.into_parts();
        match SoftmaxBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let pad = key_padding.clone();
                let out = B::scaled_masked_softmax(scores, pad, padded, scale, causal);
                prep.finish((out.clone(), key_padding, padded, scale, causal), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::scaled_masked_softmax(
                scores,
                key_padding,
                padded,
                scale,
                causal,
            )),
        }
    }

    fn scaled_masked_softmax_backward(
        output: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self> {
        // Second derivatives are not needed: the result is not tracked.
        let (output, _) = output.into_parts();
        let (grad, _) = grad.into_parts();
        Self::from_inner(B::scaled_masked_softmax_backward(
            output,
            grad,
            key_padding,
            padded,
            scale,
            causal,
        ))
    }
}
