//! Autodiff for flash attention: one node for the whole attention, keeping its inputs, its
//! output and the rows' log-sum-exp, from which the backward replays the probabilities.

use super::FlashAttentionOps;
use crate::attention::AttentionParams;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Autodiff, AutodiffBackend};

#[derive(Debug)]
struct FlashBackward;

/// What the backward reads.
#[derive(Debug, Clone)]
struct Saved<B: FlashAttentionOps> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    pad: BoolTensor<B>,
    padded: bool,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    params: AttentionParams,
}

impl<B: FlashAttentionOps> Backward<B, 3> for FlashBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let (dq, dk, dv) = B::flash_attention_backward(
            s.q, s.k, s.v, s.pad, s.padded, s.out, s.lse, grad, s.params,
        );
        for (node, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: FlashAttentionOps, C: CheckpointStrategy> FlashAttentionOps for Autodiff<B, C> {
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, q_node) = q.into_parts();
        let (k, k_node) = k.into_parts();
        let (v, v_node) = v.into_parts();
        let (out, lse) = B::flash_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            key_padding.clone(),
            padded,
            params,
        );
        let tracked = match FlashBackward
            .prepare::<C>([q_node, k_node, v_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let saved = Saved {
                    q,
                    k,
                    v,
                    pad: key_padding,
                    padded,
                    out: out.clone(),
                    lse: lse.clone(),
                    params,
                };
                prep.finish(saved, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (tracked, Self::from_inner(lse))
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        // Second derivatives are not needed: the results are not tracked.
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dq, dk, dv) = B::flash_attention_backward(
            inner(q),
            inner(k),
            inner(v),
            key_padding,
            padded,
            inner(out),
            inner(lse),
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
