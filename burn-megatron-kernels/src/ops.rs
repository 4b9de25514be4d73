//! Small compositions of Burn primitive ops, and shape arithmetic, shared by the kernels
//! and their references.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, FloatDType, Shape};

/// `(rows, n)` of `x` (`[.., n]`).
pub(crate) fn rows_and_width(shape: &Shape) -> (usize, usize) {
    let n = shape[shape.num_dims() - 1];
    (shape.num_elements().checked_div(n).unwrap_or(0), n)
}

/// `x + bias` with `bias` (`[n]`) broadcast over the last dimension of `x` (`[.., n]`).
pub(crate) fn add_last_dim<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    let mut dims = vec![1; rank];
    dims[rank - 1] = bias.shape().num_elements();
    B::float_add(x, B::float_reshape(bias, Shape::from(dims)))
}

/// Sums `t` (`[.., n]`) over every dimension but the last: the gradient of a bias that was
/// broadcast over the leading dimensions. Returns `[n]`.
pub(crate) fn sum_to_last_dim<B: Backend>(t: FloatTensor<B>, n: usize) -> FloatTensor<B> {
    let rows = t.shape().num_elements() / n.max(1);
    let flat = B::float_reshape(t, Shape::from([rows, n]));
    B::float_reshape(B::float_sum_dim(flat, 0), Shape::from([n]))
}

/// `t` in `dtype` (a no-op when it is already).
pub(crate) fn cast<B: Backend>(t: FloatTensor<B>, dtype: FloatDType) -> FloatTensor<B> {
    if t.dtype() == DType::from(dtype) {
        t
    } else {
        B::float_cast(t, dtype)
    }
}
