//! The normalisations of the transformer core: LayerNorm and RMSNorm, both one fused op each
//! way (`burn_megatron_kernels`), as Megatron uses Apex's or Transformer Engine's.

use crate::tensor_parallel::{LayoutOwner, ParallelAttrs};
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, RmsNorm, RmsNormConfig};
use burn::tensor::{Device, Tensor};
use burn_megatron_kernels::{layer_norm, rms_norm};

/// LayerNorm over the last dimension, `(x − μ)/√(σ² + ε)·γ + β`, as Megatron's
/// `FusedLayerNorm`: one op forward and one backward (statistics in f32), which keeps only
/// its input and two numbers per row for the backward, where Burn's `nn::LayerNorm` keeps
/// the intermediates of its composition. Its parameters are named as Burn's (`gamma`,
/// `beta`), so records and checkpoints are interchangeable with `nn::LayerNorm`'s.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::models::FusedLayerNorm;
/// let device = Device::flex();
/// let norm = FusedLayerNorm::new(4, 1e-5, &device);
/// let y = norm.forward(Tensor::<2>::from_floats([[1.0, 2.0, 3.0, 4.0]], &device));
/// let mean = y.clone().mean().into_scalar::<f32>();
/// assert!(mean.abs() < 1e-6);
/// ```
#[derive(Module, Debug)]
pub struct FusedLayerNorm {
    /// The scale, `[size]` (ones at init).
    pub gamma: Param<Tensor<1>>,
    /// The shift, `[size]` (zeros at init).
    pub beta: Option<Param<Tensor<1>>>,
    /// Added to the variance.
    pub epsilon: f64,
}

impl FusedLayerNorm {
    /// A LayerNorm over `size` features with a shift, `gamma` ones and `beta` zeros (as
    /// Burn's `LayerNormConfig::init`).
    pub fn new(size: usize, epsilon: f64, device: &Device) -> Self {
        Self {
            gamma: Initializer::Ones.init([size], device),
            beta: Some(Initializer::Zeros.init([size], device)),
            epsilon,
        }
    }

    /// Normalises the last dimension.
    ///
    /// # Panics
    /// When `x`'s last dimension is not the norm's size (a shape error, as Burn's
    /// `LayerNorm` asserts it), or `epsilon` is negative or not finite.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let beta = self.beta.as_ref().map(|b| b.val());
        layer_norm(x, self.gamma.val(), beta, self.epsilon)
            .unwrap_or_else(|e| panic!("FusedLayerNorm: {e}"))
    }
}

/// Which normalisation a layer uses.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// LayerNorm (BERT, GPT).
    LayerNorm,
    /// RMSNorm (no mean subtraction, no bias).
    RmsNorm,
}

/// A LayerNorm or an RMSNorm.
#[derive(Module, Debug)]
pub enum Norm {
    /// LayerNorm.
    LayerNorm(FusedLayerNorm),
    /// RMSNorm.
    RmsNorm(RmsNorm),
}

impl Norm {
    pub(crate) fn new(kind: NormKind, size: usize, epsilon: f64, device: &Device) -> Self {
        match kind {
            NormKind::LayerNorm => Norm::LayerNorm(FusedLayerNorm::new(size, epsilon, device)),
            NormKind::RmsNorm => {
                Norm::RmsNorm(RmsNormConfig::new(size).with_epsilon(epsilon).init(device))
            }
        }
    }

    /// Under sequence parallelism each rank normalises only its part of the sequence, so
    /// the gradients of the scale and the shift are partial.
    pub(crate) fn state_attrs(&self, owner: &LayoutOwner, sequence_parallel: bool) {
        let attrs = if sequence_parallel {
            ParallelAttrs::sequence_parallel()
        } else {
            ParallelAttrs::default()
        };
        owner.state(self.gamma().id, attrs);
        if let Norm::LayerNorm(FusedLayerNorm {
            beta: Some(beta), ..
        }) = self
        {
            owner.state(beta.id, attrs);
        }
    }

    /// Normalises the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Norm::LayerNorm(n) => n.forward(x),
            // Burn's `RmsNorm::forward`, fused (one pass each way on Flex, kernels on GPUs).
            Norm::RmsNorm(n) => rms_norm(x, n.gamma.val(), n.epsilon).expect(
                "gamma has the normalised size by construction and RmsNormConfig::init checks \
                 that epsilon is positive",
            ),
        }
    }

    /// The scale parameter.
    pub fn gamma(&self) -> &Param<Tensor<1>> {
        match self {
            Norm::LayerNorm(n) => &n.gamma,
            Norm::RmsNorm(n) => &n.gamma,
        }
    }
}
