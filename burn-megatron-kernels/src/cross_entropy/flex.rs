//! Flex's cross-entropy ops: one loop over the rows of the logits each (the reference walks
//! and allocates the `[N, V]` tensor several times), with the same formulas. The row
//! statistics read f32, bf16 and f16 logits natively; the backward f32 only, other dtypes
//! going through the reference.
//!
//! The row statistics walk each row twice, the max and then the sums of exps and of logits,
//! the second walk reading the row from cache (a 32k-vocabulary f32 row is 128 KiB; one
//! read from memory). Measured on `[1024, 32000]` f32 (2 cores, AVX-512): 11.5–13.9 ms, the
//! old three passes 21.8–26.5 ms, a single walk in 2048-element chunks (chunk max, then
//! rescale the running sum) within noise of it (11.5–13.1 ms), a single walk keeping a
//! running max per lane (two `exp`s per element) 38–40 ms. The two walks keep the sum of
//! exps bit-identical to the three-pass forward's where the local max is the global one
//! (TP 1), so runs that compare with each other saw the same numbers across the change. The `exp` is
//! `crate::cpu::exp` (2 ulp), as in the other passes and the backward.

use super::LabelSmoothing;
use super::reference::{reference_cross_entropy_backward, reference_cross_entropy_row_stats};
use crate::cpu::{RowOp, exp, f32_tensor, f32_values, for_rows, index_values, lane_fold};
use crate::cpu_elem::Elem;
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, bf16, f16};

fn dims(logits: &FlexTensor) -> (usize, usize) {
    let s = logits.shape();
    (s[0], s[1])
}

/// `target` as a column of a `v`-wide row, if it is one.
fn column(target: i64, v: usize) -> Option<usize> {
    usize::try_from(target).ok().filter(|&c| c < v)
}

pub(super) fn row_stats(
    logits: FlexTensor,
    target: FlexTensor,
    in_range: FlexTensor,
) -> FlexTensor {
    let stats = match logits.dtype() {
        DType::F32 => stats_of::<f32>(&logits, &target, &in_range),
        DType::BF16 => stats_of::<bf16>(&logits, &target, &in_range),
        DType::F16 => stats_of::<f16>(&logits, &target, &in_range),
        _ => None,
    };
    stats.unwrap_or_else(|| reference_cross_entropy_row_stats::<Flex>(logits, target, in_range))
}

/// The row statistics of logits stored as `E`; `None` where an input is not of the types
/// the loop reads.
fn stats_of<E: Elem>(
    logits: &FlexTensor,
    target: &FlexTensor,
    in_range: &FlexTensor,
) -> Option<FlexTensor> {
    let (x, t, r) = (
        E::values(logits)?,
        index_values(target)?,
        f32_values(in_range)?,
    );
    let (n, v) = dims(logits);
    let stats = for_rows(&x, v, &RowStats { t: &t, r: &r, v });
    Some(f32_tensor(stats, &[n, 4]))
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

/// `(m, Σ exp(x − m), x[target]·in_range, Σ x)`.
struct RowStats<'a> {
    t: &'a [i64],
    r: &'a [f32],
    v: usize,
}

impl<E: Elem> RowOp<E> for RowStats<'_> {
    const OUT: usize = 4;

    #[inline(always)]
    fn row(&self, i: usize, row: &[E], out: &mut [f32]) {
        let m = lane_fold(row, f32::NEG_INFINITY, f32::max, f32::max);
        // `m` but on a row of −∞, whose sum of exps is 0 (not NaN; `exp` saturates above 0).
        let (sum_exp, sum) = exp_and_plain_sums(row, m.max(f32::MIN));
        let sum_exp = if m == f32::NEG_INFINITY { 0.0 } else { sum_exp };
        // A target outside the slice is the caller's bug: NaN shows it in the loss.
        let z = column(self.t[i], self.v).map_or(f32::NAN, |c| row[c].to_f32());
        out.copy_from_slice(&[m, sum_exp, z * self.r[i], sum]);
    }
}

/// `(Σ exp(x − shift), Σ x)` in one walk, each in 16 lanes joined in order then the tail:
/// the sum of exps in exactly [`crate::cpu::lane_sum`]'s order.
#[inline(always)]
fn exp_and_plain_sums<E: Elem>(xs: &[E], shift: f32) -> (f32, f32) {
    let (mut e, mut s) = ([0.0f32; 16], [0.0f32; 16]);
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for ((e, s), &x) in e.iter_mut().zip(&mut s).zip(c) {
            let x = x.to_f32();
            *e += exp(x - shift);
            *s += x;
        }
    }
    let join = |acc: [f32; 16]| acc.iter().fold(0.0, |a, &b| a + b);
    tail.iter().fold((join(e), join(s)), |(e, s), &x| {
        let x = x.to_f32();
        (e + exp(x - shift), s + x)
    })
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
