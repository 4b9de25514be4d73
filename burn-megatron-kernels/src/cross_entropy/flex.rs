//! Flex's cross-entropy passes: one loop over the rows of f32 logits each (the reference
//! walks and allocates the `[N, V]` tensor several times per pass), with the same formulas.
//! Other dtypes go through the reference.

use super::LabelSmoothing;
use super::reference::{
    reference_cross_entropy_backward, reference_cross_entropy_predicted_and_sum,
    reference_cross_entropy_row_max, reference_cross_entropy_sum_exp,
};
use crate::cpu::{RowOp, exp, f32_tensor, f32_values, for_rows, index_values, lane_fold, lane_sum};
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;

fn dims(logits: &FlexTensor) -> (usize, usize) {
    let s = logits.shape();
    (s[0], s[1])
}

/// `target` as a column of a `v`-wide row, if it is one.
fn column(target: i64, v: usize) -> Option<usize> {
    usize::try_from(target).ok().filter(|&c| c < v)
}

pub(super) fn row_max(logits: FlexTensor) -> FlexTensor {
    let Some(x) = f32_values(&logits) else {
        return reference_cross_entropy_row_max::<Flex>(logits);
    };
    let (n, v) = dims(&logits);
    let max = for_rows(&x, v, &RowMax);
    f32_tensor(max, &[n])
}

pub(super) fn predicted_and_sum(
    logits: FlexTensor,
    max: FlexTensor,
    target: FlexTensor,
    in_range: FlexTensor,
) -> FlexTensor {
    let (Some(x), Some(m), Some(t), Some(r)) = (
        f32_values(&logits),
        f32_values(&max),
        index_values(&target),
        f32_values(&in_range),
    ) else {
        return reference_cross_entropy_predicted_and_sum::<Flex>(logits, max, target, in_range);
    };
    let (n, v) = dims(&logits);
    let sums = for_rows(&x, v, &SumShifted(&m));
    let mut packed = Vec::with_capacity(2 * n);
    for i in 0..n {
        // A target outside the slice is the caller's bug: NaN shows it in the loss.
        let z = column(t[i], v).map_or(f32::NAN, |c| x[i * v + c]);
        packed.push((z - m[i]) * r[i]);
        packed.push(sums[i]);
    }
    f32_tensor(packed, &[n, 2])
}

pub(super) fn sum_exp(logits: FlexTensor, max: FlexTensor) -> FlexTensor {
    let (Some(x), Some(m)) = (f32_values(&logits), f32_values(&max)) else {
        return reference_cross_entropy_sum_exp::<Flex>(logits, max);
    };
    let (n, v) = dims(&logits);
    let sums = for_rows(&x, v, &SumExp(&m));
    f32_tensor(sums, &[n])
}

pub(super) fn backward(
    logits: FlexTensor,
    max: FlexTensor,
    sum_exp: FlexTensor,
    target: FlexTensor,
    in_range: FlexTensor,
    grad: FlexTensor,
    smoothing: LabelSmoothing,
) -> FlexTensor {
    let values = (
        f32_values(&logits),
        f32_values(&max),
        f32_values(&sum_exp),
        index_values(&target),
        f32_values(&in_range),
        f32_values(&grad),
    );
    let (Some(x), Some(m), Some(s), Some(t), Some(r), Some(g)) = values else {
        return reference_cross_entropy_backward::<Flex>(
            logits, max, sum_exp, target, in_range, grad, smoothing,
        );
    };
    let (n, v) = dims(&logits);
    let eps = smoothing.epsilon;
    // ε / V_global: exactly 0 without smoothing.
    let spread = eps / smoothing.global_vocab as f32;
    let op = Backward {
        m: &m,
        s: &s,
        t: &t,
        r: &r,
        g: &g,
        hot: 1.0 - eps,
        spread,
        v,
    };
    let out = for_rows(&x, v, &op);
    f32_tensor(out, &[n, v])
}

struct RowMax;

impl RowOp for RowMax {
    const OUT: usize = 1;

    #[inline(always)]
    fn row(&self, _: usize, row: &[f32], out: &mut [f32]) {
        out[0] = lane_fold(row, f32::NEG_INFINITY, f32::max, f32::max);
    }
}

/// `Σ (x − max)`.
struct SumShifted<'a>(&'a [f32]);

impl RowOp for SumShifted<'_> {
    const OUT: usize = 1;

    #[inline(always)]
    fn row(&self, i: usize, row: &[f32], out: &mut [f32]) {
        let m = self.0[i];
        out[0] = lane_sum(row, |z| z - m);
    }
}

/// `Σ exp(x − max)`.
struct SumExp<'a>(&'a [f32]);

impl RowOp for SumExp<'_> {
    const OUT: usize = 1;

    #[inline(always)]
    fn row(&self, i: usize, row: &[f32], out: &mut [f32]) {
        let m = self.0[i];
        out[0] = lane_sum(row, |z| exp(z - m));
    }
}

struct Backward<'a> {
    m: &'a [f32],
    s: &'a [f32],
    t: &'a [i64],
    r: &'a [f32],
    g: &'a [f32],
    /// `1 − ε`.
    hot: f32,
    /// `ε / V_global`.
    spread: f32,
    v: usize,
}

impl RowOp for Backward<'_> {
    const OUT: usize = 0;

    #[inline(always)]
    fn row(&self, i: usize, row: &[f32], out: &mut [f32]) {
        let (m, inv, g) = (self.m[i], 1.0 / self.s[i], self.g[i]);
        for (o, &z) in out.iter_mut().zip(row) {
            *o = (exp(z - m) * inv - self.spread) * g;
        }
        // The target's column, where the one-hot term lands.
        match column(self.t[i], self.v) {
            Some(c) => out[c] = ((exp(row[c] - m) * inv - self.r[i] * self.hot) - self.spread) * g,
            None => out.fill(f32::NAN),
        }
    }
}
