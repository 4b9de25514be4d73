//! The cross-entropy ops on Burn's Cube backend: launches of the kernels in `kernels.rs`,
//! one cube per row for the reductions (the row statistics in one pass) and one unit per
//! element for the backward.

use super::kernels::{cross_entropy_backward_kernel, cross_entropy_row_stats_kernel};
use super::{CrossEntropyOps, LabelSmoothing};
use crate::launch::{elementwise_geometry, empty_like, row_block_size, row_cube_count};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// `t` as a contiguous f32 tensor (the per-row inputs may come in any float dtype).
fn f32_contiguous(t: CubeTensor) -> CubeTensor {
    into_contiguous(cast_f32::<CubeBackend>(t))
}

fn cast_f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    if t.dtype() == DType::F32 {
        t
    } else {
        B::float_cast(t, FloatDType::F32)
    }
}

fn empty_f32(like: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_like(like, shape, DType::F32)
}

impl CrossEntropyOps for CubeBackend {
    fn cross_entropy_row_stats(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let [rows, cols] = logits.shape().dims::<2>();
        let out = empty_f32(&logits, Shape::from([rows, 4]));
        if rows == 0 || cols == 0 {
            return out;
        }
        let logits = into_contiguous(logits);
        let target = into_contiguous(target);
        let block = row_block_size(&logits, cols);
        let dtypes = [
            dtype_to_storage_type(logits.dtype),
            dtype_to_storage_type(target.dtype),
        ];
        cross_entropy_row_stats_kernel::launch(
            &logits.client.clone(),
            row_cube_count(&logits, rows),
            CubeDim::new_1d(block as u32),
            logits.into_tensor_arg(),
            target.into_tensor_arg(),
            f32_contiguous(in_range).into_tensor_arg(),
            out.clone().into_tensor_arg(),
            block,
            dtypes,
        );
        out
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum_exp: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        smoothing: LabelSmoothing,
    ) -> FloatTensor<Self> {
        let logits = into_contiguous(logits);
        let out = empty_like(&logits, logits.shape(), logits.dtype);
        let Some((cube_dim, count)) = elementwise_geometry(&logits, out.shape().num_elements())
        else {
            return out;
        };
        let target = into_contiguous(target);
        let eps = f64::from(smoothing.epsilon);
        let uniform = if eps > 0.0 {
            eps / smoothing.global_vocab as f64
        } else {
            0.0
        };
        let dtypes = [
            dtype_to_storage_type(logits.dtype),
            dtype_to_storage_type(target.dtype),
        ];
        cross_entropy_backward_kernel::launch(
            &logits.client.clone(),
            count,
            cube_dim,
            logits.into_tensor_arg(),
            f32_contiguous(max).into_tensor_arg(),
            f32_contiguous(sum_exp).into_tensor_arg(),
            target.into_tensor_arg(),
            f32_contiguous(in_range).into_tensor_arg(),
            f32_contiguous(grad).into_tensor_arg(),
            out.clone().into_tensor_arg(),
            (1.0 - eps) as f32,
            uniform as f32,
            dtypes,
        );
        out
    }
}
