//! Megatron's `deallocate_output_tensor` for Burn: a stage's output, once sent, is needed in
//! backward only as a place in the graph to put the received gradient, not for its values.
//! Burn cannot free a tensor's values and keep its node, so the output is replaced by a
//! one-element stand-in whose backward gives the output the gradient put in its slot. The
//! output's own values (one hidden-sized tensor per token of every microbatch in flight) go
//! as soon as it is sent.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Shape, Tensor};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use std::sync::{Arc, Mutex};

/// Where the gradient received for a sent output waits for its backward.
#[derive(Clone, Default)]
pub struct GradSlot(Arc<Mutex<Option<DispatchTensor>>>);

impl std::fmt::Debug for GradSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradSlot")
    }
}

impl GradSlot {
    /// Puts the output's gradient (untracked: an autodiff tensor's `inner()`).
    pub(crate) fn put<const D: usize>(&self, grad: Tensor<D>) {
        *crate::comm::lock(&self.0) = Some(grad.into_dispatch());
    }

    fn take(&self) -> Option<DispatchTensor> {
        crate::comm::lock(&self.0).take()
    }
}

/// A one-element stand-in for `output`: after `slot.put(g)`, a backward from the stand-in
/// gives `output` the gradient `g`, while `output`'s values may already be gone.
pub(crate) fn stand_in<const D: usize>(output: Tensor<D>) -> (Tensor<1>, GradSlot) {
    let slot = GradSlot::default();
    let stub = Dispatch::grad_sink(output.into_dispatch(), slot.clone());
    (Tensor::from_dispatch(stub), slot)
}

/// The stand-in as a Burn backend extension.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait GradSinkOps: Backend {
    /// A one-element zero tensor; on `Autodiff`, its backward gives `x` the gradient in
    /// `slot`.
    fn grad_sink(x: FloatTensor<Self>, slot: GradSlot) -> FloatTensor<Self>;
}

impl GradSinkOps for Flex {
    fn grad_sink(x: FloatTensor<Self>, _: GradSlot) -> FloatTensor<Self> {
        Self::float_zeros(Shape::new([1]), &x.device(), x.dtype().into())
    }
}

#[cfg(feature = "cube")]
impl GradSinkOps for burn::backend::Cube {
    fn grad_sink(x: FloatTensor<Self>, _: GradSlot) -> FloatTensor<Self> {
        Self::float_zeros(Shape::new([1]), &x.device(), x.dtype().into())
    }
}

#[derive(Debug)]
struct SinkBackward;

impl<B: GradSinkOps> Backward<B, 1> for SinkBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    /// The slot, and the output's shape.
    type State = (GradSlot, Shape);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x] = ops.parents;
        // The stand-in's own gradient (of a sum) carries nothing.
        let _ = grads.consume::<B>(&ops.node);
        let (slot, shape) = ops.state;
        let (Some(x), Some(grad)) = (x, slot.take()) else {
            return;
        };
        let Ok(BackendTensor::Float(grad)) =
            <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(grad)
        else {
            unreachable!("the executor puts an untracked float gradient on the output's device")
        };
        grads.register::<B>(x.id, B::float_reshape(grad, shape));
    }
}

impl<B: GradSinkOps, C: CheckpointStrategy> GradSinkOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn grad_sink(x: FloatTensor<Self>, slot: GradSlot) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        let (shape, device, dtype) = (x.shape(), x.device(), x.dtype());
        // The point: the output's values are not kept.
        drop(x);
        let stub = B::float_zeros(Shape::new([1]), &device, dtype.into());
        match SinkBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((slot, shape), stub),
            OpsKind::UnTracked(prep) => prep.finish(stub),
        }
    }
}
