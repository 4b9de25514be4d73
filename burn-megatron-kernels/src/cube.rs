//! The CubeCL kernels, for Burn's Cube backend (wgpu here; the same source serves CUDA).

use crate::bias_gelu::FusedOps;
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

/// 1/√2 and 1/√(2π).
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

#[cube(launch)]
fn bias_gelu_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let v = x[pos] + bias[pos % bias.len()];
    out[pos] = F::new(0.5) * v * (F::new(1.0) + F::erf(v * F::new(FRAC_1_SQRT_2)));
}

#[cube(launch)]
fn bias_gelu_backward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let v = x[pos] + bias[pos % bias.len()];
    let cdf = F::new(0.5) * (F::new(1.0) + F::erf(v * F::new(FRAC_1_SQRT_2)));
    let pdf = F::exp(F::new(-0.5) * v * v) * F::new(FRAC_1_SQRT_2PI);
    out[pos] = grad[pos] * (cdf + v * pdf);
}

/// A contiguous output shaped like `like`, and one unit per element: (output, cube
/// dim, cube count), or `None` for an empty tensor (nothing to launch).
fn elementwise_launch(like: &CubeTensor) -> (CubeTensor, Option<(CubeDim, CubeCount)>) {
    let out = empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        like.shape(),
        like.dtype,
    );
    let n = out.shape().num_elements();
    let geometry = (n > 0).then(|| {
        let cube_dim = CubeDim::new(&like.client, n);
        (
            cube_dim,
            calculate_cube_count_elemwise(&like.client, n, cube_dim),
        )
    });
    (out, geometry)
}

impl FusedOps for CubeBackend {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
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
            dtype,
        );
        out
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
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
            dtype,
        );
        out
    }
}
