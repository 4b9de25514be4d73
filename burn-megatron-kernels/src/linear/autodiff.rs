//! Autodiff for the linear and batched products: both backward products through the inner
//! backend's own product op (`matmul_2d` or `batched_matmul`).

use super::LinearOps;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};

/// A product op of the inner backend.
type Product<B> = fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>;

/// `c = a·b` over the last two dims (equal leading dims): `da = dc·bᵀ`, `db = aᵀ·dc`, both
/// through `product` (Burn's matmul backward, without its broadcast reduction).
#[derive(Debug)]
struct ProductBackward<B: Backend> {
    product: Product<B>,
}

impl<B: LinearOps> Backward<B, 2> for ProductBackward<B> {
    /// The forward's `(a, b)`, each kept only if the other's gradient needs it.
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let [node_a, node_b] = ops.parents;
        let last = grad.shape().num_dims() - 1;
        if let (Some(node), Some(a)) = (node_b, a) {
            let at = B::float_swap_dims(a, last - 1, last);
            grads.register::<B>(node.id, (self.product)(at, grad.clone()));
        }
        if let (Some(node), Some(b)) = (node_a, b) {
            let bt = B::float_swap_dims(b, last - 1, last);
            grads.register::<B>(node.id, (self.product)(grad, bt));
        }
    }
}

/// `forward(a, b)` on the inner backend, tracked with [`ProductBackward`] of `backward`.
fn tracked<B: LinearOps, C: CheckpointStrategy>(
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    forward: Product<B>,
    backward: Product<B>,
) -> FloatTensor<Autodiff<B, C>> {
    // a is needed only for b's gradient, and b only for a's.
    let (keep_a, keep_b) = (b.is_tracked(), a.is_tracked());
    let (a, a_node) = a.into_parts();
    let (b, b_node) = b.into_parts();
    match (ProductBackward { product: backward })
        .prepare::<C>([a_node, b_node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let c = forward(a.clone(), b.clone());
            prep.finish((keep_a.then_some(a), keep_b.then_some(b)), c)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(a, b)),
    }
}

impl<B: LinearOps, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    /// Tracked as Burn's own matmul is.
    fn matmul_2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
    }

    /// `y = x·w`: `dx = dy·wᵀ`, `dw = xᵀ·dy`, both through `matmul_2d`.
    fn linear_2d(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(x, weight, B::linear_2d, B::matmul_2d)
    }

    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(a, b, B::batched_matmul, B::batched_matmul)
    }
}
