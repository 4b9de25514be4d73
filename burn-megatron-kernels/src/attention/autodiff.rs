//! Autodiff for the chunked attention: one node for the whole attention, keeping only its
//! inputs; the backward recomputes each block's probabilities (the inner backend's
//! `chunked_attention_backward`).

use super::{AttentionParams, ChunkedAttentionOps};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct AttentionBackward;

/// The forward's inputs: `(q, k, v, key padding, padded, params)`.
type Inputs<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    BoolTensor<B>,
    bool,
    AttentionParams,
);

impl<B: ChunkedAttentionOps> Backward<B, 3> for AttentionBackward {
    type State = Inputs<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, pad, padded, params) = ops.state;
        let (dq, dk, dv) = B::chunked_attention_backward(q, k, v, pad, padded, grad, params);
        for (node, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: ChunkedAttentionOps, C: CheckpointStrategy> ChunkedAttentionOps for Autodiff<B, C> {
    fn chunked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        params: AttentionParams,
    ) -> FloatTensor<Self> {
        let (q, q_node) = q.into_parts();
        let (k, k_node) = k.into_parts();
        let (v, v_node) = v.into_parts();
        let out = B::chunked_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            key_padding.clone(),
            padded,
            params,
        );
        match AttentionBackward
            .prepare::<C>([q_node, k_node, v_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((q, k, v, key_padding, padded, params), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn chunked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        grad: FloatTensor<Self>,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // Second derivatives are not needed: the results are not tracked.
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dq, dk, dv) = B::chunked_attention_backward(
            inner(q),
            inner(k),
            inner(v),
            key_padding,
            padded,
            inner(grad),
            params,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }
}
