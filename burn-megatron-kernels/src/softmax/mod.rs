//! Scaled masked softmax over attention scores `[batch, heads, sq, sk]`:
//! `softmax(mask_fill(scores · scale, masked, −10000), dim 3)`, with a key-padding mask and an
//! optional causal mask, and its backward from the saved output.
//!
//! # Masks
//!
//! Key `j` of query row `i` is masked when `key_padding[b, j]` is true, or (causal) when
//! `j > i + (sk − sq)`: the queries are the *last* `sq` positions of the `sk` keys, as when
//! new queries attend to a cache of earlier keys (for `sq == sk` this is plain `j > i`; for
//! `sq > sk` the first `sq − sk` rows are fully masked).
//!
//! Masked scores become −10000 (Megatron's convention, as our attention layer does), not −∞:
//! a row whose keys are all masked is uniform, `1/sk`, instead of NaN.
//!
//! # Backward
//!
//! With `y` the output and `dy` its gradient, `dx = scale · y ⊙ (dy − Σₖ dyₖ yₖ)` at unmasked
//! positions and exactly 0 at masked ones: `mask_fill` cuts the gradient there, which matters
//! when `y` is not negligible at a masked position (all-masked rows, or unmasked scores near
//! −10000). The sum runs over the whole row, masked positions included.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;

use crate::KernelError;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Bool, Shape, Tensor, TensorData};

/// The score given to masked positions before the softmax.
pub const MASKED_SCORE: f32 = -10000.0;

/// Scaled masked softmax as backend ops: one row-per-cube kernel on Cube backends, native
/// row loops on Flex (one pass per direction, masks from the row index), Burn's own ops
/// elsewhere. Callers validate shapes (see [`scaled_masked_softmax`]).
///
/// The padding is a tensor plus a flag rather than an `Option`: `#[backend_extension]` in Burn
/// 0.22.1 routes only plain tensor arguments. Without padding, pass any bool tensor of the
/// device: it is not read.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait ScaledMaskedSoftmaxOps: Backend {
    /// `softmax(mask_fill(scores · scale, masked, −10000), dim 3)` for `scores`
    /// `[b, heads, sq, sk]` and `key_padding` `[b, sk]` (true = padded key; read only when
    /// `padded`).
    fn scaled_masked_softmax(
        scores: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self>;
    /// The gradient with respect to `scores`, from the forward's `output` and its gradient
    /// `grad` (see the module docs).
    fn scaled_masked_softmax_backward(
        output: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self>;
}

/// The full `[b, heads, sq, sk]` mask (true = masked) from Burn ops, or `None` when nothing is
/// masked. The causal part is built on the host: it depends on shapes only.
fn reference_mask<B: Backend>(
    like: &FloatTensor<B>,
    key_padding: BoolTensor<B>,
    padded: bool,
    causal: bool,
) -> Option<BoolTensor<B>> {
    let shape = like.shape();
    let [b, _, sq, sk] = shape.dims::<4>();
    let padding = padded.then_some(key_padding).map(|pad| {
        B::bool_expand(
            B::bool_reshape(pad, Shape::from([b, 1, 1, sk])),
            shape.clone(),
        )
    });
    let causal = causal.then(|| {
        let mask: Vec<bool> = (0..sq * sk).map(|k| k % sk + sq > k / sk + sk).collect();
        let mask = B::bool_from_data(TensorData::new(mask, [1, 1, sq, sk]), &like.device());
        B::bool_expand(mask, shape.clone())
    });
    match (padding, causal) {
        (Some(p), Some(c)) => Some(B::bool_or(p, c)),
        (p, c) => p.or(c),
    }
}

/// The reference forward from Burn ops: `mul_scalar`, `mask_fill(−10000)`, `softmax`.
pub fn reference_scaled_masked_softmax<B: Backend>(
    scores: FloatTensor<B>,
    key_padding: BoolTensor<B>,
    padded: bool,
    scale: f32,
    causal: bool,
) -> FloatTensor<B> {
    if scores.shape().num_elements() == 0 {
        return scores;
    }
    let mask = reference_mask::<B>(&scores, key_padding, padded, causal);
    let scaled = B::float_mul_scalar(scores, scale.into());
    let filled = match mask {
        Some(mask) => B::float_mask_fill(scaled, mask, MASKED_SCORE.into()),
        None => scaled,
    };
    B::softmax(filled, 3)
}

/// The reference backward from Burn ops:
/// `mask_fill(scale · y ⊙ (dy − sum_dim(dy ⊙ y, 3)), masked, 0)`.
pub fn reference_scaled_masked_softmax_backward<B: Backend>(
    output: FloatTensor<B>,
    grad: FloatTensor<B>,
    key_padding: BoolTensor<B>,
    padded: bool,
    scale: f32,
    causal: bool,
) -> FloatTensor<B> {
    if output.shape().num_elements() == 0 {
        return grad;
    }
    let mask = reference_mask::<B>(&output, key_padding, padded, causal);
    let dot = B::float_sum_dim(B::float_mul(grad.clone(), output.clone()), 3);
    let dx = B::float_mul(output, B::float_sub(grad, dot));
    let dx = B::float_mul_scalar(dx, scale.into());
    match mask {
        Some(mask) => B::float_mask_fill(dx, mask, 0.0f32.into()),
        None => dx,
    }
}

impl ScaledMaskedSoftmaxOps for Flex {
    fn scaled_masked_softmax(
        scores: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self> {
        flex::forward(scores, key_padding, padded, scale, causal)
    }

    fn scaled_masked_softmax_backward(
        output: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self> {
        flex::backward(output, grad, key_padding, padded, scale, causal)
    }
}

/// `softmax(mask_fill(scores · scale, masked, −10000), dim 3)` over attention scores
/// `[batch, heads, sq, sk]`: one fused kernel per direction on Cube backends, differentiable
/// (the backward uses the saved output, not the scores).
///
/// `key_padding` (`[batch, sk]`, true = padded key) and `causal` (key `j` masked for query
/// `i` when `j > i + sk − sq`) select the masked positions; see the module docs. A row with
/// every key masked comes out uniform, `1/sk`.
///
/// # Errors
///
/// [`KernelError::Shape`] when `key_padding` is not `[batch, sk]`;
/// [`KernelError::Argument`] when `scale` is not finite.
///
/// ```
/// use burn::tensor::activation::softmax;
/// use burn::tensor::{Bool, Device, Tensor};
/// use burn_megatron_kernels::scaled_masked_softmax;
/// let device = Device::flex();
/// let scores = Tensor::<4>::from_floats([[[[1.0, 2.0, 3.0], [0.5, 0.0, -1.0]]]], &device);
/// let pad = Tensor::<2, Bool>::from_bool([[false, false, true]], &device);
/// let y = scaled_masked_softmax(scores.clone(), Some(pad.clone()), 0.5, false).unwrap();
/// // What the attention layer composes from Burn ops:
/// let mask = pad.unsqueeze_dim::<3>(1).unsqueeze_dim::<4>(1);
/// let filled = scores.mul_scalar(0.5).mask_fill(mask, -10000.0);
/// y.into_data().assert_approx_eq::<f32>(&softmax(filled, 3).into_data(), Default::default());
/// ```
pub fn scaled_masked_softmax(
    scores: Tensor<4>,
    key_padding: Option<Tensor<2, Bool>>,
    scale: f32,
    causal: bool,
) -> Result<Tensor<4>, KernelError> {
    if !scale.is_finite() {
        return Err(KernelError::Argument(format!(
            "softmax scale must be finite, got {scale}"
        )));
    }
    let [b, _, _, sk] = scores.dims();
    if let Some(pad) = &key_padding
        && pad.dims() != [b, sk]
    {
        return Err(KernelError::Shape(format!(
            "key padding {:?} must be [batch, sk] = {:?} for scores {:?}",
            pad.dims(),
            [b, sk],
            scores.dims()
        )));
    }
    let padded = key_padding.is_some();
    // The unread stand-in when there is no padding: one element, never a zero-size buffer.
    let key_padding =
        key_padding.unwrap_or_else(|| Tensor::<2, Bool>::empty([1, 1], &scores.device()));
    Ok(Tensor::from_dispatch(Dispatch::scaled_masked_softmax(
        scores.into_dispatch(),
        key_padding.into_dispatch(),
        padded,
        scale,
        causal,
    )))
}
