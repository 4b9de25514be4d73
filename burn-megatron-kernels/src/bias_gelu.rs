//! Bias + GeLU (erf form): `gelu(x + bias)`, the bias broadcast over the last dimension,
//! with its backward `grad · gelu'(x + bias)`.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Shape, Tensor};

/// Fused element-wise ops: one kernel on Cube backends, Burn's own ops elsewhere.
#[backend_extension(Flex, Cube: cfg(feature = "wgpu"), Autodiff)]
pub trait FusedOps: Backend {
    /// `gelu(x + bias)`; `bias` has the size of `x`'s last dimension.
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `grad · gelu'(x + bias)`: the gradient with respect to `x` (and, summed over the
    /// leading dimensions, to `bias`).
    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

fn add_bias<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    let mut dims = vec![1; rank];
    dims[rank - 1] = bias.shape().num_elements();
    B::float_add(x, B::float_reshape(bias, Shape::from(dims)))
}

/// The reference: Burn's `add` and `gelu` on backend `B`.
pub fn reference_bias_gelu<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    B::gelu(add_bias::<B>(x, bias))
}

/// The reference backward, `grad · (Φ(v) + v·φ(v))` with `v = x + bias`, from Burn ops.
///
/// Not Burn's `gelu_backward`: in 0.22.1 its default is the derivative of the *tanh*
/// approximation while `gelu` is the erf form, a mismatch of up to ~1e-4 per element.
pub fn reference_bias_gelu_backward<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let v = add_bias::<B>(x, bias);
    let scaled = B::float_mul_scalar(v.clone(), std::f32::consts::FRAC_1_SQRT_2.into());
    let cdf = B::float_mul_scalar(
        B::float_add_scalar(B::float_erf(scaled), 1.0f32.into()),
        0.5f32.into(),
    );
    let sq = B::float_mul(v.clone(), v.clone());
    let pdf = B::float_mul_scalar(
        B::float_exp(B::float_mul_scalar(sq, (-0.5f32).into())),
        0.398_942_3f32.into(),
    );
    B::float_mul(grad, B::float_add(cdf, B::float_mul(v, pdf)))
}

impl FusedOps for Flex {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        reference_bias_gelu::<Self>(x, bias)
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference_bias_gelu_backward::<Self>(x, bias, grad)
    }
}

/// `gelu(x + bias)` with `bias` broadcast over the last dimension of `x`: one fused kernel
/// on Cube backends, differentiable.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// let device = Device::flex();
/// let x = Tensor::<2>::from_floats([[0.0, 1.0], [-1.0, 2.0]], &device);
/// let b = Tensor::<1>::from_floats([0.5, -0.5], &device);
/// let y = burn_megatron_kernels::bias_gelu(x.clone(), b.clone());
/// let expected = burn::tensor::activation::gelu(x + b.unsqueeze());
/// y.into_data().assert_approx_eq::<f32>(&expected.into_data(), Default::default());
/// ```
pub fn bias_gelu<const D: usize>(x: Tensor<D>, bias: Tensor<1>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::bias_gelu(x.into_dispatch(), bias.into_dispatch()))
}
