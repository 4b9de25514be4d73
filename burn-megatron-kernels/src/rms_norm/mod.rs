//! RMSNorm over the last dimension, `y = x / √(mean(x²) + ε) · γ`, with its handwritten
//! backward. The forward is the function of Burn's `nn::RmsNorm::forward` (the statistics in
//! f32 whatever the dtype, the division and the scale in `x`'s dtype), so a model that swaps
//! one for the other keeps its numbers; it also returns the per-row `1/rms` (f32), which the
//! autodiff saves so that the backward need not recompute the statistics.
//!
//! With `x̂ = x·r`, `r = 1/rms` and `n` the normalised size, the backward is
//! `dx = r·(dy·γ − x̂·mean(dy·γ·x̂))` and `dγ = Σ_rows dy·x̂` (accumulated in f32).
//!
//! Implementations: Flex's native loops (one pass per row forward; backward in two passes
//! per row, `dγ` from per-block partial sums added in block order, so deterministic); a
//! CubeCL kernel on Cube (one cube per row, and a column pass for `dγ`); the reference from
//! Burn ops everywhere else.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;
mod reference;

pub use reference::{reference_rms_norm_backward, reference_rms_norm_forward};

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// RMSNorm as backend ops. `x` is `[.., n]` (any rank ≥ 1, `rows` the product of the
/// leading dimensions), `gamma` `[n]`, `inv_rms` f32 `[rows]`. The methods do not validate;
/// [`rms_norm`] does.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait RmsNormOps: Backend {
    /// `(y, inv_rms)`: `y = x / rms · gamma` in `x`'s dtype, as Burn's `RmsNorm` computes it
    /// (`rms = √(mean(x²) + ε)` in f32, then cast to `x`'s dtype), and `1/rms` in f32.
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `(dx, dgamma)` for the output gradient `grad` (shaped like `x`), in the dtypes of `x`
    /// and `gamma`, computed in f32 from the forward's `inv_rms`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        inv_rms: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

impl RmsNormOps for Flex {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::forward(x, gamma, epsilon)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        inv_rms: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::backward(x, gamma, inv_rms, grad)
    }
}

/// RMSNorm of `x` over its last dimension: `x / √(mean(x²) + ε) · gamma`, the function of
/// Burn's `nn::RmsNorm::forward` (statistics in f32 whatever the dtype; f16/bf16 in, the same
/// dtype out), differentiable with respect to `x` and `gamma` through a handwritten backward
/// (one fused pass on Flex, kernels on Cube). Errors when `gamma` does not have the size of
/// `x`'s last dimension, that size is 0, or `epsilon` is negative or not finite.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::rms_norm;
/// let device = Device::flex();
/// let x = Tensor::<2>::from_floats([[3.0, 4.0], [1.0, -1.0]], &device);
/// let gamma = Tensor::<1>::from_floats([1.0, 2.0], &device);
/// let y = rms_norm(x.clone(), gamma.clone(), 1e-6).unwrap();
/// let mut burn_norm = burn::nn::RmsNormConfig::new(2).with_epsilon(1e-6).init(&device);
/// burn_norm.gamma = burn::module::Param::from_tensor(gamma);
/// y.into_data()
///     .assert_approx_eq::<f32>(&burn_norm.forward(x).into_data(), Default::default());
/// ```
pub fn rms_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    epsilon: f64,
) -> Result<Tensor<D>, KernelError> {
    let dims = x.dims();
    let Some(&n) = dims.last() else {
        return Err(KernelError::Shape(
            "rms_norm needs a tensor of rank ≥ 1".into(),
        ));
    };
    let [size] = gamma.dims();
    if n == 0 || size != n {
        return Err(KernelError::Shape(format!(
            "rms_norm over the last dimension of {dims:?} needs it non-empty and gamma of its \
             size, gamma is [{size}]"
        )));
    }
    if !(epsilon.is_finite() && epsilon >= 0.0) {
        return Err(KernelError::Argument(format!(
            "epsilon must be finite and ≥ 0, got {epsilon}"
        )));
    }
    let (y, _inv_rms) =
        Dispatch::rms_norm_forward(x.into_dispatch(), gamma.into_dispatch(), epsilon);
    Ok(Tensor::from_dispatch(y))
}
