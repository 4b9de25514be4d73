//! Bias + GeLU: `gelu(x + bias)`, the bias broadcast over the last dimension, in the erf form
//! or Megatron's tanh approximation, with its backward `grad · gelu'(x + bias)`.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// Which GeLU: `x·Φ(x)` exactly, or the tanh approximation
/// `½x(1 + tanh(√(2/π)(x + 0.044715x³)))` (Megatron's `bias_gelu_impl`, GPT-2, BERT-TF).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Gelu {
    /// `x·Φ(x)` with the error function (Burn's `gelu`, PyTorch's default).
    #[default]
    Erf,
    /// The tanh approximation (Burn's `gelu_approximate`, PyTorch's `approximate="tanh"`).
    Tanh,
}

/// √(2/π) and the cubic coefficient of the tanh approximation.
pub(crate) const SQRT_2_OVER_PI: f32 = 0.797_884_6;
pub(crate) const TANH_CUBIC: f32 = 0.044_715;

/// Bias + GeLU as backend ops: one kernel on Cube backends, Burn's own ops elsewhere.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait BiasGeluOps: Backend {
    /// `gelu(x + bias)`; `bias` has the size of `x`'s last dimension.
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self>;
    /// `grad · gelu'(x + bias)`: the gradient with respect to `x` (and, summed over the
    /// leading dimensions, to `bias`).
    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        form: Gelu,
    ) -> FloatTensor<Self>;
}

/// The reference: Burn's `add` and `gelu` (or the tanh approximation) on backend `B`.
pub fn reference_bias_gelu<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    form: Gelu,
) -> FloatTensor<B> {
    let v = crate::ops::add_last_dim::<B>(x, bias);
    match form {
        Gelu::Erf => B::gelu(v),
        Gelu::Tanh => {
            let t = tanh_inner::<B>(v.clone());
            let one_plus = B::float_add_scalar(t, 1.0f32.into());
            B::float_mul_scalar(B::float_mul(v, one_plus), 0.5f32.into())
        }
    }
}

/// `tanh(√(2/π)(v + 0.044715v³))`.
fn tanh_inner<B: Backend>(v: FloatTensor<B>) -> FloatTensor<B> {
    let v2 = B::float_mul(v.clone(), v.clone());
    let cubic = B::float_add_scalar(B::float_mul_scalar(v2, TANH_CUBIC.into()), 1.0f32.into());
    B::float_tanh(B::float_mul_scalar(
        B::float_mul(v, cubic),
        SQRT_2_OVER_PI.into(),
    ))
}

/// The reference backward from Burn ops, `v = x + bias`:
/// erf form `grad · (Φ(v) + v·φ(v))`; tanh form
/// `grad · (½(1 + t) + ½v(1 − t²)·√(2/π)(1 + 3·0.044715v²))`.
///
/// Not Burn's `gelu_backward`: in 0.22.1 its default is the derivative of the *tanh*
/// approximation while `gelu` is the erf form, a mismatch of up to ~1e-4 per element.
pub fn reference_bias_gelu_backward<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    grad: FloatTensor<B>,
    form: Gelu,
) -> FloatTensor<B> {
    let v = crate::ops::add_last_dim::<B>(x, bias);
    let half = |t: FloatTensor<B>| B::float_mul_scalar(t, 0.5f32.into());
    let derivative = match form {
        Gelu::Erf => {
            let scaled = B::float_mul_scalar(v.clone(), std::f32::consts::FRAC_1_SQRT_2.into());
            let cdf = half(B::float_add_scalar(B::float_erf(scaled), 1.0f32.into()));
            let sq = B::float_mul(v.clone(), v.clone());
            let pdf = B::float_mul_scalar(
                B::float_exp(B::float_mul_scalar(sq, (-0.5f32).into())),
                0.398_942_3f32.into(),
            );
            B::float_add(cdf, B::float_mul(v, pdf))
        }
        Gelu::Tanh => {
            let t = tanh_inner::<B>(v.clone());
            let sech2 = B::float_add_scalar(
                B::float_neg(B::float_mul(t.clone(), t.clone())),
                1.0f32.into(),
            );
            let v2 = B::float_mul(v.clone(), v.clone());
            let inner_d = B::float_mul_scalar(
                B::float_add_scalar(
                    B::float_mul_scalar(v2, (3.0 * TANH_CUBIC).into()),
                    1.0f32.into(),
                ),
                SQRT_2_OVER_PI.into(),
            );
            let left = half(B::float_add_scalar(t, 1.0f32.into()));
            let right = half(B::float_mul(B::float_mul(v, sech2), inner_d));
            B::float_add(left, right)
        }
    };
    B::float_mul(grad, derivative)
}

impl BiasGeluOps for Flex {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        reference_bias_gelu::<Self>(x, bias, form)
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        form: Gelu,
    ) -> FloatTensor<Self> {
        reference_bias_gelu_backward::<Self>(x, bias, grad, form)
    }
}

/// `gelu(x + bias)` with `bias` broadcast over the last dimension of `x`: one fused kernel
/// on Cube backends, differentiable (the bias gradient is summed over the leading dims).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::{Gelu, bias_gelu};
/// let device = Device::flex();
/// let x = Tensor::<2>::from_floats([[0.0, 1.0], [-1.0, 2.0]], &device);
/// let b = Tensor::<1>::from_floats([0.5, -0.5], &device);
/// let y = bias_gelu(x.clone(), b.clone(), Gelu::Erf);
/// let expected = burn::tensor::activation::gelu(x + b.unsqueeze());
/// y.into_data().assert_approx_eq::<f32>(&expected.into_data(), Default::default());
/// ```
pub fn bias_gelu<const D: usize>(x: Tensor<D>, bias: Tensor<1>, form: Gelu) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::bias_gelu(
        x.into_dispatch(),
        bias.into_dispatch(),
        form,
    ))
}
