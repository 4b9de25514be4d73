//! LayerNorm composed of Burn ops, in f32: the ground truth of the native loops and the
//! kernels, and what backends without either run.

use crate::ops::rows_and_width;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Scalar, TensorMetadata};
use burn::tensor::{FloatDType, Shape};

fn widen<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

/// `t` (f32, `[rows·n]` values) as `[rows, n]`.
fn matrix<B: Backend>(t: FloatTensor<B>, rows: usize, n: usize) -> FloatTensor<B> {
    B::float_reshape(widen::<B>(t), Shape::from([rows, n]))
}

/// `(y, mean, rstd)`: `y = (x − mean)·rstd·gamma + beta` in f32, cast to `x`'s dtype;
/// `mean` and `rstd = 1/√(var + ε)` f32 `[rows]`.
pub fn reference_layer_norm_forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let dtype = x.dtype();
    let x = matrix::<B>(x, rows, n);
    let mean = B::float_mean_dim(x.clone(), 1);
    let centered = B::float_sub(x, mean.clone());
    let var = B::float_mean_dim(B::float_mul(centered.clone(), centered.clone()), 1);
    let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(
        var,
        Scalar::from(epsilon),
    )));
    let row = |t: FloatTensor<B>| matrix::<B>(t, 1, n);
    let y = B::float_mul(B::float_mul(centered, rstd.clone()), row(gamma));
    let y = B::float_add(y, row(beta));
    let y = B::float_cast(B::float_reshape(y, shape), FloatDType::from(dtype));
    let column = |t: FloatTensor<B>| B::float_reshape(t, Shape::from([rows]));
    (y, column(mean), column(rstd))
}

/// `(dx, dgamma, dbeta)` in f32, cast to the dtypes of `x`, `gamma` and `gamma`: with
/// `x̂ = (x − mean)·rstd` and `g = grad·γ`, `dx = rstd·(g − mean(g) − x̂·mean(g·x̂))`,
/// `dgamma = Σ_rows grad·x̂`, `dbeta = Σ_rows grad`.
pub fn reference_layer_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    mean: FloatTensor<B>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let (x_dtype, gamma_dtype) = (x.dtype(), FloatDType::from(gamma.dtype()));
    let (x, dy) = (matrix::<B>(x, rows, n), matrix::<B>(grad, rows, n));
    let gamma = matrix::<B>(gamma, 1, n);
    let (mean, r) = (matrix::<B>(mean, rows, 1), matrix::<B>(rstd, rows, 1));
    let x_hat = B::float_mul(B::float_sub(x, mean), r.clone());
    let g = B::float_mul(dy.clone(), gamma);
    let mean_g = B::float_mean_dim(g.clone(), 1);
    let mean_gx = B::float_mean_dim(B::float_mul(g.clone(), x_hat.clone()), 1);
    let dx = B::float_sub(
        B::float_sub(g, mean_g),
        B::float_mul(x_hat.clone(), mean_gx),
    );
    let dx = B::float_mul(dx, r);
    let dgamma = B::float_sum_dim(B::float_mul(dy.clone(), x_hat), 0);
    let dbeta = B::float_sum_dim(dy, 0);
    let vector =
        |t: FloatTensor<B>| B::float_cast(B::float_reshape(t, Shape::from([n])), gamma_dtype);
    (
        B::float_cast(B::float_reshape(dx, shape), FloatDType::from(x_dtype)),
        vector(dgamma),
        vector(dbeta),
    )
}
