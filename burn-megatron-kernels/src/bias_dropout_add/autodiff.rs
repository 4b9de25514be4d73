//! Autodiff for bias + dropout + residual and for plain dropout: the backward keeps only
//! (prob, seed, bias size) and regenerates the mask, so no activation-sized tensor is saved.

use super::{BiasDropoutAddOps, MaskWindow};
use crate::ops::sum_to_last_dim;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, TensorMetadata};

/// Parents `[x, residual]`, plus `bias` when `N == 3`.
#[derive(Debug)]
struct BiasDropoutAddBackward<const N: usize>;

impl<B: BiasDropoutAddOps, const N: usize> Backward<B, N> for BiasDropoutAddBackward<N> {
    /// (prob, seed, bias size).
    type State = (f32, u64, usize);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (prob, seed, n) = ops.state;
        let mut parents = ops.parents.into_iter();
        let (node_x, node_residual) = (parents.next().flatten(), parents.next().flatten());
        let node_bias = parents.next().flatten();
        if node_x.is_some() || node_bias.is_some() {
            let grad_x = B::dropout(grad.clone(), prob, seed, MaskWindow::WHOLE);
            if let Some(node) = node_bias {
                grads.register::<B>(node.id, sum_to_last_dim::<B>(grad_x.clone(), n));
            }
            if let Some(node) = node_x {
                grads.register::<B>(node.id, grad_x);
            }
        }
        if let Some(node) = node_residual {
            grads.register::<B>(node.id, grad);
        }
    }
}

/// Plain dropout: the gradient is the same dropout of the incoming gradient.
#[derive(Debug)]
struct DropoutBackward;

impl<B: BiasDropoutAddOps> Backward<B, 1> for DropoutBackward {
    /// (prob, seed, window).
    type State = (f32, u64, MaskWindow);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (prob, seed, window) = ops.state;
        if let [Some(node)] = ops.parents {
            grads.register::<B>(node.id, B::dropout(grad, prob, seed, window));
        }
    }
}

/// Runs `forward` on the inner backend and records it under `nodes` when any is tracked.
fn record<B: BiasDropoutAddOps, C: CheckpointStrategy, const N: usize>(
    nodes: [NodeGuard; N],
    state: (f32, u64, usize),
    forward: impl FnOnce() -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match BiasDropoutAddBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, forward()),
        OpsKind::UnTracked(prep) => prep.finish(forward()),
    }
}

impl<B: BiasDropoutAddOps, C: CheckpointStrategy> BiasDropoutAddOps for Autodiff<B, C> {
    fn bias_dropout_add(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        has_bias: bool,
        residual: FloatTensor<Self>,
        prob: f32,
        seed: u64,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (residual, residual_node) = residual.into_parts();
        let (bias, bias_node) = bias.into_parts();
        let forward = || B::bias_dropout_add(x, bias.clone(), has_bias, residual, prob, seed);
        if has_bias {
            let state = (prob, seed, bias.shape().num_elements());
            record::<B, C, 3>([x_node, residual_node, bias_node], state, forward)
        } else {
            // The stand-in bias is not an input: no gradient flows to it.
            drop(bias_node);
            record::<B, C, 2>([x_node, residual_node], (prob, seed, 0), forward)
        }
    }

    fn dropout(
        v: FloatTensor<Self>,
        prob: f32,
        seed: u64,
        window: MaskWindow,
    ) -> FloatTensor<Self> {
        let (v, node) = v.into_parts();
        let dropped = B::dropout(v, prob, seed, window);
        match DropoutBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((prob, seed, window), dropped),
            OpsKind::UnTracked(prep) => prep.finish(dropped),
        }
    }
}
