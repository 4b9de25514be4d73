//! LayerNorm over the last dimension, `y = (x − μ)/√(σ² + ε) · γ + β`, with its handwritten
//! backward: Megatron's fused LayerNorm (Apex / Transformer Engine). Statistics and the
//! normalised value are computed in f32 whatever the dtype, and `y` is rounded once to
//! `x`'s dtype. The forward also returns the per-row mean and `1/σ` (f32), which the
//! autodiff saves with `x`, so that a layer keeps its input and two numbers per row instead
//! of the several `[.., n]` intermediates of Burn's composed `layer_norm`.
//!
//! With `x̂ = (x − μ)·r`, `r = 1/√(σ² + ε)`, `g = dy·γ` and `n` the normalised size, the
//! backward is `dx = r·(g − mean(g) − x̂·mean(g·x̂))`, `dγ = Σ_rows dy·x̂` and
//! `dβ = Σ_rows dy` (accumulated in f32).
//!
//! One op for the whole derivative also means `x` receives its gradient from the norm as
//! one tensor. Burn's autodiff of the composition adds several contributions into `x`'s
//! gradient, in an order that a recomputed region (whose replay sums them before handing
//! them on) cannot reproduce; with one contribution, recomputing a LayerNorm gives the same
//! bits as keeping it.
//!
//! Implementations: Flex's native loops (one pass per row forward; backward in two passes
//! per row, `dγ`/`dβ` from per-block partial sums added in block order, so deterministic); a
//! CubeCL kernel on Cube (one cube per row, and a column pass for `dγ` and `dβ`); the
//! reference from Burn ops everywhere else.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;
mod reference;

pub use reference::{reference_layer_norm_backward, reference_layer_norm_forward};

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// LayerNorm as backend ops. `x` is `[.., n]` (any rank ≥ 1, `rows` the product of the
/// leading dimensions), `gamma` and `beta` `[n]`, `mean` and `rstd` f32 `[rows]`. The
/// methods do not validate; [`layer_norm`] does.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait LayerNormOps: Backend {
    /// `(y, mean, rstd)`: `y = (x − mean)·rstd·gamma + beta`, computed in f32 and rounded
    /// to `x`'s dtype, with the row means and `rstd = 1/√(var + ε)` (biased variance) in f32.
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// `(dx, dgamma, dbeta)` for the output gradient `grad` (shaped like `x`), in the dtypes
    /// of `x`, `gamma` and `gamma`, computed in f32 from the forward's `mean` and `rstd`.
    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl LayerNormOps for Flex {
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        flex::forward(x, gamma, beta, epsilon)
    }

    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        flex::backward(x, gamma, mean, rstd, grad)
    }
}

/// LayerNorm of `x` over its last dimension: `(x − μ)/√(σ² + ε) · gamma + beta` (biased
/// variance, as Burn's and PyTorch's), statistics in f32 whatever the dtype, differentiable
/// with respect to `x`, `gamma` and `beta` through a handwritten backward (one fused pass on
/// Flex, kernels on Cube). Errors when `gamma` or `beta` does not have the size of `x`'s
/// last dimension, that size is 0, or `epsilon` is negative or not finite.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::layer_norm;
/// let device = Device::flex();
/// let x = Tensor::<2>::from_floats([[3.0, 4.0, 8.0], [1.0, -1.0, 0.5]], &device);
/// let gamma = Tensor::<1>::from_floats([1.0, 2.0, 0.5], &device);
/// let beta = Tensor::<1>::from_floats([0.1, 0.0, -0.3], &device);
/// let y = layer_norm(x.clone(), gamma.clone(), Some(beta.clone()), 1e-5).unwrap();
/// let mut burn_norm = burn::nn::LayerNormConfig::new(3).with_epsilon(1e-5).init(&device);
/// burn_norm.gamma = burn::module::Param::from_tensor(gamma);
/// burn_norm.beta = Some(burn::module::Param::from_tensor(beta));
/// y.into_data()
///     .assert_approx_eq::<f32>(&burn_norm.forward(x).into_data(), Default::default());
/// ```
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Result<Tensor<D>, KernelError> {
    let dims = x.dims();
    let Some(&n) = dims.last() else {
        return Err(KernelError::Shape(
            "layer_norm needs a tensor of rank ≥ 1".into(),
        ));
    };
    let [size] = gamma.dims();
    let beta_size = beta.as_ref().map(|b| b.dims()[0]).unwrap_or(n);
    if n == 0 || size != n || beta_size != n {
        return Err(KernelError::Shape(format!(
            "layer_norm over the last dimension of {dims:?} needs it non-empty and gamma and \
             beta of its size, gamma is [{size}], beta [{beta_size}]"
        )));
    }
    if !(epsilon.is_finite() && epsilon >= 0.0) {
        return Err(KernelError::Argument(format!(
            "epsilon must be finite and ≥ 0, got {epsilon}"
        )));
    }
    // Without a shift, an untracked zero one: `v + 0 = v` for every non-zero `v`, and no
    // gradient is kept for it.
    let beta = beta.unwrap_or_else(|| Tensor::zeros_like(&gamma).detach());
    let (y, _mean, _rstd) = Dispatch::layer_norm_forward(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    );
    Ok(Tensor::from_dispatch(y))
}
