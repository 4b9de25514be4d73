//! The gradient-ready hook as a Burn backend extension: identity forward; backward hands
//! the parameter's gradient (as a tensor on its device) to the sink (the reducer), and
//! passes it on unchanged only if the sink did not keep it.
//!
//! Burn runs backward by graph depth, deepest first. A hook whose only parent were the
//! parameter (a leaf, depth 0) would run at the very end; giving it the layer's input as a
//! second parent puts it right below the op that consumes the parameter, so it runs as soon
//! as that op has produced the gradient — while the rest of backward is still to come.

use super::Hook;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Shape, Tensor};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};

/// Gradient-ready hooks for overlapping the data-parallel reduction with backward.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait GradHookOps: Backend {
    /// Returns `param`; in backward, reports its gradient to `hook`. `anchor` (the layer's
    /// input) only places the hook in the graph and receives no gradient.
    fn grad_ready_hook(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        hook: Hook,
    ) -> FloatTensor<Self>;
}

impl GradHookOps for Flex {
    fn grad_ready_hook(
        param: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: Hook,
    ) -> FloatTensor<Self> {
        param
    }
}

#[cfg(feature = "cube")]
impl GradHookOps for burn::backend::Cube {
    fn grad_ready_hook(
        param: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: Hook,
    ) -> FloatTensor<Self> {
        param
    }
}

#[derive(Debug)]
struct HookBackward;

impl<B: GradHookOps> Backward<B, 2> for HookBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Hook;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [param, _anchor] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        // Handed over as a tensor where backward left it: a read here would wait for every
        // kernel queued so far, once per parameter and micro-batch.
        let kept = ops.state.deliver(|| {
            let n = grad.shape().num_elements();
            let flat = B::float_reshape(grad.clone(), Shape::new([n]));
            Tensor::from_dispatch(<DispatchTensor as DispatchKindConversion<B>>::from_backend(
                BackendTensor::Float(flat),
            ))
        });
        // A gradient the sink kept lives in its main gradient only.
        if let Some(param) = param.filter(|_| !kept) {
            grads.register::<B>(param.id, grad);
        }
    }
}

impl<B: GradHookOps, C: CheckpointStrategy> GradHookOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn grad_ready_hook(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        hook: Hook,
    ) -> FloatTensor<Self> {
        let (param, param_node) = param.into_parts();
        let (_, anchor_node) = anchor.into_parts();
        match HookBackward
            .prepare::<C>([param_node, anchor_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(hook, param),
            OpsKind::UnTracked(prep) => prep.finish(param),
        }
    }
}
