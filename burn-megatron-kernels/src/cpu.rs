//! Native loops for Flex (Burn's CPU backend), where an op's reference is a chain of Burn
//! ops that each allocate and walk a whole tensor: one pass per op, rows split over rayon's
//! threads, each pass compiled for the best SIMD level the CPU offers (pulp's runtime
//! dispatch), with an `exp` that vectorises (Flex's calls libm once per element).

use crate::cpu_elem::Elem;
use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

/// Rows per rayon task: below this, splitting costs more than it saves.
const MIN_ELEMENTS_PER_TASK: usize = 1 << 14;

/// `e^x` within ~2 ulp (Cephes' `expf` polynomial after a reduction by `ln 2`), without
/// branches or calls so that loops of it vectorise: `n = round(x·log2 e)` by the 1.5·2²³
/// trick, `2ⁿ` built in the exponent bits. Saturates to `e^-87.34 ≈ 1.2e-38` below and
/// `e^88.38` above; NaN stays NaN (a NaN logit must reach the loss, where overflow checks
/// look).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2²³: adding it rounds to an integer
    let c = x.clamp(-87.336_55, 88.376_26);
    let t = c * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    // t's low mantissa bits hold n (|n| ≤ 127 < 2²²).
    let k = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(k.wrapping_add(127) << 23);
    let y = (p * r * r + r + 1.0) * scale;
    if x.is_nan() { x } else { y }
}

/// `step(acc, x)` over `xs` (widened to f32) in 16 independent lanes from `init` (so that
/// it vectorises), the lanes then joined in order by `join`, then the tail stepped in.
#[inline(always)]
pub(crate) fn lane_fold<E: Elem>(
    xs: &[E],
    init: f32,
    step: impl Fn(f32, f32) -> f32,
    join: impl Fn(f32, f32) -> f32,
) -> f32 {
    let mut acc = [init; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = step(*a, x.to_f32());
        }
    }
    let joined = acc.iter().fold(init, |a, &b| join(a, b));
    tail.iter().fold(joined, |a, &x| step(a, x.to_f32()))
}

/// Sum of `f(x)` over `xs` (widened to f32), in 16 lanes ([`lane_fold`]).
#[inline(always)]
pub(crate) fn lane_sum<E: Elem>(xs: &[E], f: impl Fn(f32) -> f32) -> f32 {
    lane_fold(xs, 0.0, |a, x| a + f(x), |a, b| a + b)
}

/// `t`'s values when it is an f32 tensor, made contiguous if it is not.
pub(crate) fn f32_values(t: &FlexTensor) -> Option<std::borrow::Cow<'_, [f32]>> {
    if t.dtype() != DType::F32 {
        return None;
    }
    Some(match t.as_slice::<f32>() {
        Some(s) => s.into(),
        None => t.to_contiguous().as_slice::<f32>()?.to_vec().into(),
    })
}

/// `t`'s values as i64 when it is an i64 or i32 tensor.
pub(crate) fn index_values(t: &FlexTensor) -> Option<Vec<i64>> {
    let t = t.to_contiguous();
    match t.dtype() {
        DType::I64 => t.as_slice::<i64>().map(<[i64]>::to_vec),
        DType::I32 => t
            .as_slice::<i32>()
            .map(|s| s.iter().map(|&v| i64::from(v)).collect()),
        _ => None,
    }
}

/// An f32 tensor of `shape` holding `values`.
pub(crate) fn f32_tensor(values: Vec<f32>, shape: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
}

/// A pass over the rows of an `[N, len]` buffer of `E` (f32, bf16 or f16) writing `OUT`
/// f32 values per row (or `len` when `OUT` is 0). Implementations mark `row`
/// `#[inline(always)]`, so that it is compiled inside [`for_rows`]' SIMD dispatch.
pub(crate) trait RowOp<E: Elem = f32>: Sync {
    /// Output values per row; 0 for as many as the input row has.
    const OUT: usize;
    /// Row `i` of the input into its output values.
    fn row(&self, i: usize, row: &[E], out: &mut [f32]);
}

/// `op` over every `len`-element row of `xs`, rows split over rayon's threads, each task
/// compiled for the best SIMD level the CPU has. Returns the outputs, row after row.
pub(crate) fn for_rows<E: Elem, K: RowOp<E>>(xs: &[E], len: usize, op: &K) -> Vec<f32> {
    let rows = xs.len().checked_div(len).unwrap_or(0);
    let out_len = if K::OUT == 0 { len } else { K::OUT };
    let total = rows * out_len;
    if total == 0 {
        return vec![0.0; total];
    }
    // Zeroed by each task just before its rows are written, rather than all at once on one
    // thread (for a `[1024, 32000]` gradient, a 131 MB memset as long as the pass itself).
    let mut out = Vec::<f32>::with_capacity(total);
    let per_task = MIN_ELEMENTS_PER_TASK.div_ceil(len).max(1);
    out.spare_capacity_mut()[..total]
        .par_chunks_mut(per_task * out_len)
        .zip(xs.par_chunks(per_task * len))
        .enumerate()
        .for_each(|(t, (out, xs))| {
            out.fill(std::mem::MaybeUninit::new(0.0));
            // SAFETY: every element of `out` was initialised on the line above.
            let out = unsafe { &mut *(out as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
            pulp::Arch::new().dispatch(Task {
                op,
                first: t * per_task,
                xs,
                out,
                len,
                out_len,
            })
        });
    // SAFETY: the tasks' chunks cover all `total` elements, and each task initialised its
    // own (a panicking task propagates out of `for_each` before this line).
    unsafe { out.set_len(total) };
    out
}

struct Task<'a, K, E> {
    op: &'a K,
    first: usize,
    xs: &'a [E],
    out: &'a mut [f32],
    len: usize,
    out_len: usize,
}

impl<E: Elem, K: RowOp<E>> pulp::WithSimd for Task<'_, K, E> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let rows = self
            .xs
            .chunks(self.len)
            .zip(self.out.chunks_mut(self.out_len));
        for (r, (x, o)) in rows.enumerate() {
            self.op.row(self.first + r, x, o);
        }
    }
}

#[cfg(test)]
mod tests;
