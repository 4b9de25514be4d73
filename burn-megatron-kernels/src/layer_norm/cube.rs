//! The LayerNorm CubeCL kernels, for Burn's Cube backend: one cube per row for the forward
//! and for `dx` (units stride over the row, then shared-memory trees), and `dγ` and `dβ` in
//! two passes over fixed blocks of rows ([`column_sum`](crate::column_sum): deterministic, no
//! float atomics, which WGSL lacks). Statistics and gradients accumulate in f32.

use super::LayerNormOps;
use super::reference::{reference_layer_norm_backward, reference_layer_norm_forward};
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
fn layer_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    y: &mut Tensor<F>,
    mean: &mut Tensor<f32>,
    rstd: &mut Tensor<f32>,
    epsilon: f32,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = cube_row();
    if row >= mean.len() {
        terminate!();
    }
    let n = gamma.len();
    let start = row * n;
    let unit = UNIT_POS_X as usize;
    let mut sum = 0.0f32;
    let mut c = unit;
    while c < n {
        sum += f32::cast_from(x[start + c]);
        c += block;
    }
    let mut shared = Shared::<[f32]>::new_slice(block);
    shared[unit] = sum;
    let mu = tree_sum(&mut shared) / f32::cast_from(n);
    // The centred squares in a second pass: a large mean must not cancel the variance.
    let mut squares = 0.0f32;
    c = unit;
    while c < n {
        let d = f32::cast_from(x[start + c]) - mu;
        squares += d * d;
        c += block;
    }
    let mut shared_squares = Shared::<[f32]>::new_slice(block);
    shared_squares[unit] = squares;
    let var = tree_sum(&mut shared_squares) / f32::cast_from(n);
    let r = 1.0 / f32::sqrt(var + epsilon);
    if unit == 0 {
        mean[row] = mu;
        rstd[row] = r;
    }
    c = unit;
    while c < n {
        let v = (f32::cast_from(x[start + c]) - mu) * r * f32::cast_from(gamma[c]);
        y[start + c] = F::cast_from(v + f32::cast_from(beta[c]));
        c += block;
    }
}

#[cube(launch)]
fn layer_norm_backward_dx_kernel<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = cube_row();
    if row >= mean.len() {
        terminate!();
    }
    let n = gamma.len();
    let start = row * n;
    let unit = UNIT_POS_X as usize;
    let (mu, r) = (mean[row], rstd[row]);
    let mut sum_g = 0.0f32;
    let mut sum_gx = 0.0f32;
    let mut c = unit;
    while c < n {
        let i = start + c;
        let g = f32::cast_from(dy[i]) * f32::cast_from(gamma[c]);
        sum_g += g;
        sum_gx += g * ((f32::cast_from(x[i]) - mu) * r);
        c += block;
    }
    let mut shared_g = Shared::<[f32]>::new_slice(block);
    let mut shared_gx = Shared::<[f32]>::new_slice(block);
    shared_g[unit] = sum_g;
    shared_gx[unit] = sum_gx;
    let mean_g = tree_sum(&mut shared_g) / f32::cast_from(n);
    let mean_gx = tree_sum(&mut shared_gx) / f32::cast_from(n);
    c = unit;
    while c < n {
        let i = start + c;
        let x_hat = (f32::cast_from(x[i]) - mu) * r;
        let g = f32::cast_from(dy[i]) * f32::cast_from(gamma[c]);
        dx[i] = F::cast_from((g - mean_g - x_hat * mean_gx) * r);
        c += block;
    }
}

/// Unit `k·n + c`: the partial `dγ` (`Σ dy·x̂`) and `dβ` (`Σ dy`) of column `c` over block
/// `k` of rows, rows in order (see [`column_sum`](crate::column_sum)).
#[cube(launch)]
fn dgamma_dbeta_partials_kernel<F: Float>(
    x: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    dy: &Tensor<F>,
    dgamma: &mut Tensor<f32>,
    dbeta: &mut Tensor<f32>,
    rows_per_block: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= dgamma.len() {
        terminate!();
    }
    let rows = mean.len();
    let n = x.len() / rows;
    let per = rows_per_block as usize;
    let mut row = (pos / n) * per;
    let end = select(row + per < rows, row + per, rows);
    let c = pos % n;
    let mut sum_gamma = 0.0f32;
    let mut sum_beta = 0.0f32;
    while row < end {
        let i = row * n + c;
        let d = f32::cast_from(dy[i]);
        sum_gamma += d * ((f32::cast_from(x[i]) - mean[row]) * rstd[row]);
        sum_beta += d;
        row += 1;
    }
    dgamma[pos] = sum_gamma;
    dbeta[pos] = sum_beta;
}

impl LayerNormOps for CubeBackend {
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, n) = rows_and_width(&x.shape());
        if rows == 0 {
            // No launch (Burn's own unary kernels panic on empty Cube tensors in 0.22.1).
            let stats = || empty_like(&x, Shape::from([0]), DType::F32);
            return (x.clone(), stats(), stats());
        }
        if x.dtype != gamma.dtype || x.dtype != beta.dtype || n == 0 {
            return reference_layer_norm_forward::<Self>(x, gamma, beta, epsilon);
        }
        let (x, gamma, beta) = (
            into_contiguous(x),
            into_contiguous(gamma),
            into_contiguous(beta),
        );
        let y = empty_like(&x, x.shape(), x.dtype);
        let mean = empty_like(&x, Shape::from([rows]), DType::F32);
        let rstd = empty_like(&x, Shape::from([rows]), DType::F32);
        let block = row_block_size(&x, n);
        layer_norm_forward_kernel::launch(
            &x.client.clone(),
            row_cube_count(&x, rows),
            CubeDim::new_1d(block as u32),
            x.clone().into_tensor_arg(),
            gamma.into_tensor_arg(),
            beta.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            epsilon as f32,
            block,
            dtype_to_storage_type(x.dtype),
        );
        (y, mean, rstd)
    }

    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (rows, n) = rows_and_width(&x.shape());
        if rows == 0 {
            return (
                x,
                zeros_like::<Self>(gamma.clone()),
                zeros_like::<Self>(gamma),
            );
        }
        let same = x.dtype == gamma.dtype && x.dtype == grad.dtype;
        if !same || n == 0 {
            return reference_layer_norm_backward::<Self>(x, gamma, mean, rstd, grad);
        }
        let (x, gamma, dy) = (
            into_contiguous(x),
            into_contiguous(gamma),
            into_contiguous(grad),
        );
        let f32_column = |t| into_contiguous(cast::<Self>(t, FloatDType::F32));
        let (mean, rstd) = (f32_column(mean), f32_column(rstd));
        let dtype = dtype_to_storage_type(x.dtype);
        let client = x.client.clone();
        let dx = empty_like(&x, x.shape(), x.dtype);
        let block = row_block_size(&x, n);
        layer_norm_backward_dx_kernel::launch(
            &client,
            row_cube_count(&x, rows),
            CubeDim::new_1d(block as u32),
            x.clone().into_tensor_arg(),
            gamma.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            block,
            dtype,
        );
        let (per, blocks) = row_blocks(rows);
        let (dgamma, dbeta) = (partials(&x, blocks, n), partials(&x, blocks, n));
        if let Some((cube_dim, count)) = elementwise_geometry(&x, blocks * n) {
            dgamma_dbeta_partials_kernel::launch(
                &client,
                count,
                cube_dim,
                x.into_tensor_arg(),
                mean.into_tensor_arg(),
                rstd.into_tensor_arg(),
                dy.into_tensor_arg(),
                dgamma.clone().into_tensor_arg(),
                dbeta.clone().into_tensor_arg(),
                per as u32,
                dtype,
            );
        }
        let (dgamma, dbeta) = (column_sums(dgamma, n), column_sums(dbeta, n));
        let to_gamma = |t| cast::<Self>(t, FloatDType::from(gamma.dtype));
        (dx, to_gamma(dgamma), to_gamma(dbeta))
    }
}
