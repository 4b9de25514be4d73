//! Weight-gradient accumulation on Cube backends: cubek's matmul of `xᵀ` and `dy` straight
//! into an f32 output (half inputs are read as they are and the products summed in f32, as
//! cuBLAS's `wgrad_gemm_accum_fp32` does for Megatron), then one element-wise add into
//! `main_grad`, in place when nothing else holds it.
//!
//! On CUDA cuBLASLt does both in one call where it loads (see `crate::cuda::gemm_engine`),
//! writing into `main_grad` itself when nothing else holds it.
//!
//! This replaced a hand-tiled shared-memory kernel (64 × 64 tiles, 4 × 4 accumulators per
//! unit) that was 3.1× slower than the tuned GEMM on lavapipe; the GEMM is the part worth
//! tuning, and cubek tunes it per device.

use super::{GradAccumOps, reference_accumulate_weight_grad};
use burn::backend::TensorMetadata;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};

impl GradAccumOps for CubeBackend {
    fn accumulate_weight_grad(
        main_grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let [fan_in, fan_out] = main_grad.shape().dims::<2>();
        if fan_in * fan_out == 0 || x.shape()[0] == 0 {
            return main_grad; // nothing to add (and Burn's copy kernels refuse empty tensors)
        }
        let xt = Self::float_transpose(x.clone());
        // cuBLASLt adds the product to main_grad in its epilogue (beta = 1, f32 output).
        #[cfg(feature = "cuda")]
        if let Some(out) = crate::cuda::blas::try_matmul(&xt, &dy, Some(&main_grad)) {
            return out;
        }
        match matmul(xt, dy.clone(), None, MatmulStrategy::default(), DType::F32) {
            Ok(product) => Self::float_add(main_grad, product),
            // A device whose matmul cannot mix these dtypes: cast first.
            Err(_) => reference_accumulate_weight_grad::<Self>(main_grad, x, dy),
        }
    }

    fn weight_grad_f32(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let xt = Self::float_transpose(x.clone());
        #[cfg(feature = "cuda")]
        if let Some(out) = crate::cuda::blas::try_matmul_f32(&xt, &dy) {
            return out;
        }
        match matmul(xt, dy.clone(), None, MatmulStrategy::default(), DType::F32) {
            Ok(product) => product,
            Err(_) => super::reference_weight_grad_f32::<Self>(x, dy),
        }
    }

    fn linear_fp32_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as crate::LinearOps>::matmul_2d(x, weight)
    }
}
