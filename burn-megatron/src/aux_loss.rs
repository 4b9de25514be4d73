//! Losses computed inside the model whose gradient enters backward directly (Megatron's
//! `MoEAuxLossAutoScaler`): a mixture-of-experts layer attaches its load-balancing loss to
//! its output with [`attach_aux_loss`], and backward gives that loss the gradient it would
//! have had if it had been added to the training loss, on whichever pipeline stage the
//! layer runs (the training loss exists only on the last).
//!
//! The gradient is the step's loss scale: 1 by default, and what the pipeline executor
//! sets for its schedule ([`scale_aux_losses`]): `grad_scale / M`, as it scales the main
//! loss of each of its `M` micro-batches.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{FloatDType, Tensor};
use std::cell::Cell;

thread_local! {
    static SCALE: Cell<f32> = const { Cell::new(1.0) };
}

/// The gradient an auxiliary loss attached on this thread now receives.
pub fn aux_loss_scale() -> f32 {
    SCALE.with(Cell::get)
}

/// Restores the previous scale when dropped.
#[derive(Debug)]
pub struct AuxLossScaleGuard(f32);

impl Drop for AuxLossScaleGuard {
    fn drop(&mut self) {
        SCALE.with(|s| s.set(self.0));
    }
}

/// Auxiliary losses attached on this thread until the guard drops get the gradient
/// `scale` (Megatron's `MoEAuxLossAutoScaler.set_loss_scale`).
pub fn scale_aux_losses(scale: f32) -> AuxLossScaleGuard {
    AuxLossScaleGuard(SCALE.with(|s| s.replace(scale)))
}

/// Returns `x` unchanged; in backward, `aux` (a loss) receives the gradient
/// [`aux_loss_scale`] had when this was called, as if it were part of the training loss.
///
/// ```
/// use burn::backend::Autodiff;
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::aux_loss::attach_aux_loss;
/// let device = Device::flex().autodiff();
/// let w = Tensor::<1>::from_floats([2.0], &device).require_grad();
/// let x = Tensor::<1>::from_floats([1.0], &device).require_grad();
/// let aux = w.clone() * w.clone(); // d aux / d w = 2w = 4
/// let y = attach_aux_loss(x.clone() * 3.0, aux);
/// let grads = y.sum().backward();
/// assert_eq!(w.grad(&grads).unwrap().into_scalar::<f32>(), 4.0);
/// assert_eq!(x.grad(&grads).unwrap().into_scalar::<f32>(), 3.0);
/// ```
pub fn attach_aux_loss<const D: usize>(x: Tensor<D>, aux: Tensor<1>) -> Tensor<D> {
    if !aux.is_autodiff() {
        return x;
    }
    Tensor::from_dispatch(Dispatch::attach_aux_loss(
        x.into_dispatch(),
        aux.into_dispatch(),
        aux_loss_scale(),
    ))
}

/// The attach op as a Burn backend extension.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait AuxLossOps: Backend {
    /// Returns `x`; on `Autodiff`, backward gives `aux` the gradient `scale`.
    fn attach_aux_loss(
        x: FloatTensor<Self>,
        aux: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self>;
}

impl AuxLossOps for Flex {
    fn attach_aux_loss(x: FloatTensor<Self>, _: FloatTensor<Self>, _: f32) -> FloatTensor<Self> {
        x
    }
}

#[cfg(feature = "cube")]
impl AuxLossOps for burn::backend::Cube {
    fn attach_aux_loss(x: FloatTensor<Self>, _: FloatTensor<Self>, _: f32) -> FloatTensor<Self> {
        x
    }
}

#[derive(Debug)]
struct AttachBackward;

impl<B: AuxLossOps> Backward<B, 2> for AttachBackward {
    /// The aux loss's shape, device and dtype, and the scale.
    type State = (burn::tensor::Shape, B::Device, FloatDType, f32);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x, aux] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (shape, device, dtype, scale) = ops.state;
        if let Some(aux) = aux {
            let ones = B::float_ones(shape, &device, dtype);
            grads.register::<B>(aux.id, B::float_mul_scalar(ones, scale.into()));
        }
        if let Some(x) = x {
            grads.register::<B>(x.id, grad);
        }
    }
}

impl<B: AuxLossOps, C: CheckpointStrategy> AuxLossOps for Autodiff<B, C> {
    fn attach_aux_loss(
        x: FloatTensor<Self>,
        aux: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (aux, aux_node) = aux.into_parts();
        let state = (aux.shape(), aux.device(), aux.dtype().into(), scale);
        match AttachBackward
            .prepare::<C>([x_node, aux_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, x),
            OpsKind::UnTracked(prep) => prep.finish(x),
        }
    }
}
