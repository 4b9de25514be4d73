//! The rotary embedding composed of Burn ops: what `RotaryTables::apply` computed before the
//! fused op (the tables cast to the activations' dtype, the rotated channels narrowed off,
//! `x·cos + rotate_half(x)·sin`, the rest concatenated back), and its handwritten transpose.
//! The ground truth of the native loops and the kernel.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{FloatDType, Slice};

/// Channels `range` of the last dimension of a rank-4 tensor.
fn channels<B: Backend>(t: FloatTensor<B>, start: usize, len: usize) -> FloatTensor<B> {
    let all = || Slice::from(..);
    B::float_slice(t, &[all(), all(), all(), Slice::from(start..start + len)])
}

/// `(rotated, rest)`: the first `rot` channels of `x`, and the others when there are any.
fn split<B: Backend>(x: FloatTensor<B>, rot: usize) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let hn = x.shape()[3];
    if rot < hn {
        (
            channels::<B>(x.clone(), 0, rot),
            Some(channels::<B>(x, rot, hn - rot)),
        )
    } else {
        (x, None)
    }
}

/// `rotated` with the pass-through channels `rest` appended.
fn join<B: Backend>(rotated: FloatTensor<B>, rest: Option<FloatTensor<B>>) -> FloatTensor<B> {
    match rest {
        Some(rest) => B::float_cat(vec![rotated, rest], 3),
        None => rotated,
    }
}

/// `cos` and `sin` in `x`'s float dtype.
fn tables<B: Backend>(
    like: &FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(like.dtype());
    (B::float_cast(cos, dtype), B::float_cast(sin, dtype))
}

/// The reference forward from Burn ops: for `x` `[s, b, heads, hn]` and tables
/// `[s, b or 1, 1, rot]`, `x[.., :rot]·cos + rotate_half(x[.., :rot])·sin` with
/// `rotate_half([x₁, x₂]) = [−x₂, x₁]`, the channels from `rot` on unchanged. Arithmetic in
/// `x`'s dtype (the tables are cast to it).
pub fn reference_apply_rotary<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    if x.shape().num_elements() == 0 {
        return x;
    }
    let rot = cos.shape()[3];
    let half = rot / 2;
    let (cos, sin) = tables::<B>(&x, cos, sin);
    let (rotated, rest) = split::<B>(x, rot);
    let x1 = channels::<B>(rotated.clone(), 0, half);
    let x2 = channels::<B>(rotated.clone(), half, half);
    let turned = B::float_cat(vec![B::float_neg(x2), x1], 3);
    let out = B::float_add(B::float_mul(rotated, cos), B::float_mul(turned, sin));
    join::<B>(out, rest)
}

/// The reference backward from Burn ops, the transpose of the forward's linear map:
/// `dx₁ = d₁·cos₁ + d₂·sin₂`, `dx₂ = d₂·cos₂ − d₁·sin₁` over the halves of the rotated
/// channels (the rotation by `−sin` when the tables' halves are equal, as rotary tables'
/// are), the pass-through channels' gradient copied.
pub fn reference_apply_rotary_backward<B: Backend>(
    grad: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    if grad.shape().num_elements() == 0 {
        return grad;
    }
    let rot = cos.shape()[3];
    let half = rot / 2;
    let (cos, sin) = tables::<B>(&grad, cos, sin);
    let (rotated, rest) = split::<B>(grad, rot);
    let d1 = channels::<B>(rotated.clone(), 0, half);
    let d2 = channels::<B>(rotated.clone(), half, half);
    let (s1, s2) = (
        channels::<B>(sin.clone(), 0, half),
        channels::<B>(sin, half, half),
    );
    // [d₂·sin₂, −d₁·sin₁]: what the sin term sends back to each half.
    let turned = B::float_cat(
        vec![B::float_mul(d2, s2), B::float_neg(B::float_mul(d1, s1))],
        3,
    );
    let dx = B::float_add(B::float_mul(rotated, cos), turned);
    join::<B>(dx, rest)
}
