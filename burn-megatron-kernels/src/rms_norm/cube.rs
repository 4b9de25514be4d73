//! The RMSNorm CubeCL kernels, for Burn's Cube backend: one cube per row for the forward and
//! for `dx` (units stride over the row, then a shared-memory tree; lavapipe has no plane
//! ops), and `dγ` in two passes over fixed blocks of rows ([`column_sum`](crate::column_sum):
//! deterministic, no float atomics, which WGSL lacks). Statistics and gradients accumulate in
//! f32.

use super::RmsNormOps;
use super::reference::{reference_rms_norm_backward, reference_rms_norm_forward};
use crate::column_sum::{column_sums, partials, row_blocks};
use crate::launch::{
    cube_row, elementwise_geometry, empty_like, row_block_size, row_cube_count, tree_sum,
    zeros_like,
};
use crate::ops::cast;
use crate::ops::rows_and_width;
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

#[cube(launch)]
fn rms_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    y: &mut Tensor<F>,
    inv_rms: &mut Tensor<f32>,
    epsilon: f32,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = cube_row();
    if row >= inv_rms.len() {
        terminate!();
    }
    let n = gamma.len();
    let start = row * n;
    let unit = UNIT_POS_X as usize;
    let mut sum = 0.0f32;
    let mut c = unit;
    while c < n {
        let v = f32::cast_from(x[start + c]);
        sum += v * v;
        c += block;
    }
    let mut shared = Shared::<[f32]>::new_slice(block);
    shared[unit] = sum;
    let sum = tree_sum(&mut shared);
    let rms = f32::sqrt(sum / f32::cast_from(n) + epsilon);
    if unit == 0 {
        inv_rms[row] = 1.0 / rms;
    }
    // As Burn's RmsNorm: the rms cast to the dtype, then `x / rms * γ` in the dtype.
    let rms = F::cast_from(rms);
    c = unit;
    while c < n {
        y[start + c] = x[start + c] / rms * gamma[c];
        c += block;
    }
}

#[cube(launch)]
fn rms_norm_backward_dx_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    inv_rms: &Tensor<f32>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = cube_row();
    if row >= inv_rms.len() {
        terminate!();
    }
    let n = gamma.len();
    let start = row * n;
    let unit = UNIT_POS_X as usize;
    let r = inv_rms[row];
    let mut sum = 0.0f32;
    let mut c = unit;
    while c < n {
        let i = start + c;
        let x_hat = f32::cast_from(x[i]) * r;
        sum += f32::cast_from(dy[i]) * f32::cast_from(gamma[c]) * x_hat;
        c += block;
    }
    let mut shared = Shared::<[f32]>::new_slice(block);
    shared[unit] = sum;
    let mean = tree_sum(&mut shared) / f32::cast_from(n);
    c = unit;
    while c < n {
        let i = start + c;
        let x_hat = f32::cast_from(x[i]) * r;
        let d = f32::cast_from(dy[i]) * f32::cast_from(gamma[c]) - x_hat * mean;
        dx[i] = F::cast_from(d * r);
        c += block;
    }
}

/// Unit `k·n + c`: the partial `dγ` of column `c` over block `k` of rows (`Σ dy·x̂`, rows
/// in order; see [`column_sum`](crate::column_sum)).
#[cube(launch)]
fn dgamma_partials_kernel<F: Float>(
    x: &Tensor<F>,
    inv_rms: &Tensor<f32>,
    dy: &Tensor<F>,
    partials: &mut Tensor<f32>,
    rows_per_block: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= partials.len() {
        terminate!();
    }
    let rows = inv_rms.len();
    let n = x.len() / rows;
    let per = rows_per_block as usize;
    let mut row = (pos / n) * per;
    let end = select(row + per < rows, row + per, rows);
    let c = pos % n;
    let mut sum = 0.0f32;
    while row < end {
        let i = row * n + c;
        sum += f32::cast_from(dy[i]) * (f32::cast_from(x[i]) * inv_rms[row]);
        row += 1;
    }
    partials[pos] = sum;
}

impl RmsNormOps for CubeBackend {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, n) = rows_and_width(&x.shape());
        if rows == 0 {
            // No launch (Burn's own unary kernels panic on empty Cube tensors in 0.22.1).
            let inv_rms = empty_like(&x, Shape::from([0]), DType::F32);
            return (x, inv_rms);
        }
        if x.dtype != gamma.dtype || n == 0 {
            // Mixed dtypes as Burn mixes them.
            return reference_rms_norm_forward::<Self>(x, gamma, epsilon);
        }
        let (x, gamma) = (into_contiguous(x), into_contiguous(gamma));
        let y = empty_like(&x, x.shape(), x.dtype);
        let inv_rms = empty_like(&x, Shape::from([rows]), DType::F32);
        let block = row_block_size(&x, n);
        rms_norm_forward_kernel::launch(
            &x.client.clone(),
            row_cube_count(&x, rows),
            CubeDim::new_1d(block as u32),
            x.clone().into_tensor_arg(),
            gamma.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            epsilon as f32,
            block,
            dtype_to_storage_type(x.dtype),
        );
        (y, inv_rms)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        inv_rms: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, n) = rows_and_width(&x.shape());
        if rows == 0 {
            return (x, zeros_like::<Self>(gamma));
        }
        let same = x.dtype == gamma.dtype && x.dtype == grad.dtype;
        if !same || n == 0 {
            return reference_rms_norm_backward::<Self>(x, gamma, inv_rms, grad);
        }
        let (x, gamma, dy) = (
            into_contiguous(x),
            into_contiguous(gamma),
            into_contiguous(grad),
        );
        let inv_rms = into_contiguous(cast::<Self>(inv_rms, FloatDType::F32));
        let dtype = dtype_to_storage_type(x.dtype);
        let client = x.client.clone();
        let dx = empty_like(&x, x.shape(), x.dtype);
        let block = row_block_size(&x, n);
        rms_norm_backward_dx_kernel::launch(
            &client,
            row_cube_count(&x, rows),
            CubeDim::new_1d(block as u32),
            x.clone().into_tensor_arg(),
            gamma.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            block,
            dtype,
        );
        let (per, blocks) = row_blocks(rows);
        let partials = partials(&x, blocks, n);
        if let Some((cube_dim, count)) = elementwise_geometry(&x, blocks * n) {
            dgamma_partials_kernel::launch(
                &client,
                count,
                cube_dim,
                x.into_tensor_arg(),
                inv_rms.into_tensor_arg(),
                dy.into_tensor_arg(),
                partials.clone().into_tensor_arg(),
                per as u32,
                dtype,
            );
        }
        let dgamma = column_sums(partials, n);
        (dx, cast::<Self>(dgamma, FloatDType::from(gamma.dtype)))
    }
}
