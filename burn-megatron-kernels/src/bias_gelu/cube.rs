//! The bias + GeLU CubeCL kernels, for Burn's Cube backend (wgpu here; the same source
//! serves CUDA).

use super::{BiasGeluOps, Gelu, SQRT_2_OVER_PI, TANH_CUBIC};
use crate::launch::elementwise_launch;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// `(gelu(v), gelu'(v))`; `tanh` picks the approximation at kernel compile time.
#[cube]
fn gelu_and_derivative<F: Float>(v: F, #[comptime] tanh: bool) -> (F, F) {
    if tanh {
        let inner = F::new(SQRT_2_OVER_PI) * (v + F::new(TANH_CUBIC) * v * v * v);
        let t = F::tanh(inner);
        let d_inner = F::new(SQRT_2_OVER_PI) * (F::new(1.0) + F::new(3.0 * TANH_CUBIC) * v * v);
        let value = F::new(0.5) * v * (F::new(1.0) + t);
        let slope =
            F::new(0.5) * (F::new(1.0) + t) + F::new(0.5) * v * (F::new(1.0) - t * t) * d_inner;
        (value, slope)
    } else {
        let cdf = F::new(0.5) * (F::new(1.0) + F::erf(v * F::new(FRAC_1_SQRT_2)));
        let pdf = F::exp(F::new(-0.5) * v * v) * F::new(FRAC_1_SQRT_2PI);
        (v * cdf, cdf + v * pdf)
    }
}

#[cube(launch)]
fn bias_gelu_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let (value, _) = gelu_and_derivative::<F>(x[pos] + bias[pos % bias.len()], tanh);
    out[pos] = value;
}

#[cube(launch)]
fn bias_gelu_backward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let (_, slope) = gelu_and_derivative::<F>(x[pos] + bias[pos % bias.len()], tanh);
    out[pos] = grad[pos] * slope;
}

impl BiasGeluOps for CubeBackend {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        let (x, bias) = (into_contiguous(x), into_contiguous(bias));
        let (out, Some((cube_dim, count))) = elementwise_launch(&x) else {
            return x; // empty: nothing to compute, the input has the output's shape
        };
        let client = x.client.clone();
        let dtype = dtype_to_storage_type(x.dtype);
        bias_gelu_kernel::launch(
            &client,
            count,
            cube_dim,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            form == Gelu::Tanh,
            dtype,
        );
        out
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        form: Gelu,
    ) -> FloatTensor<Self> {
        let (x, bias, grad) = (
            into_contiguous(x),
            into_contiguous(bias),
            into_contiguous(grad),
        );
        let (out, Some((cube_dim, count))) = elementwise_launch(&x) else {
            return x; // empty: nothing to compute, the input has the output's shape
        };
        let client = x.client.clone();
        let dtype = dtype_to_storage_type(x.dtype);
        bias_gelu_backward_kernel::launch(
            &client,
            count,
            cube_dim,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            grad.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            form == Gelu::Tanh,
            dtype,
        );
        out
    }
}
