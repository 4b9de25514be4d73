//! RMSNorm composed of Burn ops: the ground truth of the native loops and the kernels, and
//! what backends without either run. The forward is Burn's `nn::RmsNorm::forward`, op for op.

use crate::ops::rows_and_width;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Scalar, TensorMetadata};
use burn::tensor::{FloatDType, Shape};

fn widen<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

/// `(y, inv_rms)`: `y = x / rms · gamma` as Burn's `RmsNorm` computes it (`rms` from the f32
/// mean of squares, cast to `x`'s dtype before the division), `inv_rms = 1/rms` f32 `[rows]`.
pub fn reference_rms_norm_forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    epsilon: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let rank = shape.num_dims();
    let (rows, n) = rows_and_width(&shape);
    let dtype = x.dtype();
    let squares = B::float_powi_scalar(widen::<B>(x.clone()), 2.into());
    let mean = B::float_mean_dim(squares, rank - 1);
    let rms = B::float_sqrt(B::float_add_scalar(mean, Scalar::from(epsilon)));
    let normed = B::float_div(x, B::float_cast(rms.clone(), FloatDType::from(dtype)));
    let mut gamma_dims = vec![1; rank];
    gamma_dims[rank - 1] = n;
    let y = B::float_mul(normed, B::float_reshape(gamma, Shape::from(gamma_dims)));
    let inv_rms = B::float_reshape(B::float_recip(rms), Shape::from([rows]));
    (y, inv_rms)
}

/// `(dx, dgamma)` in f32, cast to the dtypes of `x` and `gamma`: with `x̂ = x·inv_rms`,
/// `dx = inv_rms·(grad·γ − x̂·mean(grad·γ·x̂))`, `dgamma = Σ_rows grad·x̂`.
pub fn reference_rms_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    inv_rms: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let (x_dtype, gamma_dtype) = (x.dtype(), gamma.dtype());
    let matrix = |t: FloatTensor<B>| B::float_reshape(widen::<B>(t), Shape::from([rows, n]));
    let (x, dy) = (matrix(x), matrix(grad));
    let gamma = B::float_reshape(widen::<B>(gamma), Shape::from([1, n]));
    let r = B::float_reshape(widen::<B>(inv_rms), Shape::from([rows, 1]));
    let x_hat = B::float_mul(x, r.clone());
    let dy_gamma = B::float_mul(dy.clone(), gamma);
    let mean = B::float_mean_dim(B::float_mul(dy_gamma.clone(), x_hat.clone()), 1);
    let dx = B::float_mul(B::float_sub(dy_gamma, B::float_mul(x_hat.clone(), mean)), r);
    let dgamma = B::float_sum_dim(B::float_mul(dy, x_hat), 0);
    (
        B::float_cast(B::float_reshape(dx, shape), FloatDType::from(x_dtype)),
        B::float_cast(
            B::float_reshape(dgamma, Shape::from([n])),
            FloatDType::from(gamma_dtype),
        ),
    )
}
