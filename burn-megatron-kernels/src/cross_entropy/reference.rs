//! The local cross-entropy passes composed of Burn ops: the ground truth of the kernels, and
//! what Flex (and any backend without a kernel) runs. The same formulas, in the same order,
//! as burn-megatron's `tensor_parallel::cross_entropy` computes today.

use super::LabelSmoothing;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Scalar, TensorMetadata};
use burn::tensor::ops::IndexingUpdateOp;
use burn::tensor::{FloatDType, Shape};

/// `[N, 4]` f32: `(m, Σ_v exp(logits[n, v] − m), logits[n, target]·in_range, Σ_v
/// logits[n, v])`, `m` the row max; the exps shifted by `max(m, f32::MIN)`, which is `m`
/// but on a row of −∞ (whose sum of exps is then 0, not NaN).
pub fn reference_cross_entropy_row_stats<B: Backend>(
    logits: FloatTensor<B>,
    target: IntTensor<B>,
    in_range: FloatTensor<B>,
) -> FloatTensor<B> {
    let n = logits.shape()[0];
    let x = B::float_cast(logits, FloatDType::F32);
    let max = B::float_max_dim(x.clone(), 1);
    let shift = B::float_clamp_min(max.clone(), Scalar::from(f32::MIN));
    let sum_exp = B::float_sum_dim(B::float_exp(B::float_sub(x.clone(), shift)), 1);
    let target = B::int_reshape(target, Shape::from([n, 1]));
    let predicted = B::float_mul(
        B::float_gather(1, x.clone(), target),
        column::<B>(in_range, n),
    );
    let sum = B::float_sum_dim(x, 1);
    B::float_cat(vec![max, sum_exp, predicted, sum], 1)
}

/// `t` as f32 `[n, 1]`: a per-row value broadcast over the vocabulary.
fn column<B: Backend>(t: FloatTensor<B>, n: usize) -> FloatTensor<B> {
    B::float_reshape(B::float_cast(t, FloatDType::F32), Shape::from([n, 1]))
}

/// `logits` (`[N, V]`) as f32 minus the row max.
fn shifted<B: Backend>(logits: FloatTensor<B>, max: FloatTensor<B>) -> FloatTensor<B> {
    let n = logits.shape()[0];
    B::float_sub(B::float_cast(logits, FloatDType::F32), column::<B>(max, n))
}

/// `(softmax − (1 − ε)·one_hot·in_range − ε / V_global) · grad` in the logits' dtype, the
/// softmax recomputed as `exp(logits − max) / sum_exp`.
pub fn reference_cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    max: FloatTensor<B>,
    sum_exp: FloatTensor<B>,
    target: IntTensor<B>,
    in_range: FloatTensor<B>,
    grad: FloatTensor<B>,
    smoothing: LabelSmoothing,
) -> FloatTensor<B> {
    let n = logits.shape()[0];
    let dtype = logits.dtype();
    let softmax = B::float_div(
        B::float_exp(shifted::<B>(logits, max)),
        column::<B>(sum_exp, n),
    );
    let eps = f64::from(smoothing.epsilon);
    let hot = B::float_mul_scalar(column::<B>(in_range, n), Scalar::from(1.0 - eps));
    let mut g = B::float_scatter(
        1,
        softmax,
        B::int_reshape(target, Shape::from([n, 1])),
        B::float_neg(hot),
        IndexingUpdateOp::Add,
    );
    if eps > 0.0 {
        g = B::float_sub_scalar(g, Scalar::from(eps / smoothing.global_vocab as f64));
    }
    B::float_cast(
        B::float_mul(g, column::<B>(grad, n)),
        FloatDType::from(dtype),
    )
}
