//! The cross-entropy CubeCL kernels: one cube per row for the reductions (each unit
//! strides over the row, then a shared-memory tree; no plane ops, which lavapipe lacks),
//! and one unit per element for the backward. Per-row inputs are read as f32.

use crate::launch::cube_row;
use cubecl::prelude::*;

/// `exp(m − to)·s`, the sum `s` of exps shifted by `m` re-shifted by `to ≥ m`: `s` itself
/// where `m = to` (so that `m = to = −∞` gives `s`, not NaN).
#[cube]
fn rescale(s: f32, m: f32, to: f32) -> f32 {
    select(m == to, s, s * f32::exp(m - to))
}

/// One pass over the row: each unit keeps a running max and the sum of exps shifted by it
/// (the sum rescaled when the max grows), and the sum of logits; the tree then merges the
/// `(max, sum of exps)` pairs by the same rescaling. Unit 0 reads the target.
#[cube(launch)]
pub(super) fn cross_entropy_row_stats_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    target: &Tensor<I>,
    in_range: &Tensor<f32>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let row = cube_row();
    if row >= in_range.len() {
        terminate!();
    }
    let cols = logits.shape(1);
    let start = row * cols;
    let unit = UNIT_POS_X as usize;
    // The running max starts at an element of the row (WGSL has no −∞ literal): the unit's
    // first, or any for a unit past the row's end, whose sum of exps stays 0.
    let mut m = f32::cast_from(logits[start + select(unit < cols, unit, 0)]);
    let mut s = 0.0f32;
    let mut sum = 0.0f32;
    let lowest = f32::new(f32::MIN);
    let mut c = unit;
    while c < cols {
        let x = f32::cast_from(logits[start + c]);
        sum += x;
        if x > m {
            s = rescale(s, m, x) + 1.0;
            m = x;
        } else {
            // −∞ adds exp(−∞) = 0, also where m = −∞ (not NaN).
            s += select(x < lowest, 0.0, f32::exp(x - m));
        }
        c += block;
    }
    let mut shared_m = Shared::<[f32]>::new_slice(block);
    let mut shared_s = Shared::<[f32]>::new_slice(block);
    let mut shared_sum = Shared::<[f32]>::new_slice(block);
    shared_m[unit] = m;
    shared_s[unit] = s;
    shared_sum[unit] = sum;
    sync_cube();
    let mut active = CUBE_DIM_X as usize / 2;
    while active > 0 {
        if unit < active {
            let m1 = shared_m[unit];
            let m2 = shared_m[unit + active];
            let s1 = shared_s[unit];
            let s2 = shared_s[unit + active];
            let other = shared_sum[unit + active];
            let to = f32::max(m1, m2);
            shared_s[unit] = rescale(s1, m1, to) + rescale(s2, m2, to);
            shared_m[unit] = to;
            shared_sum[unit] += other;
        }
        sync_cube();
        active /= 2;
    }
    if unit == 0 {
        let weight = in_range[row];
        // A negative target wraps to a huge column: out of the slice like any other.
        let t = u32::cast_from(target[row]) as usize;
        let mut predicted = 0.0f32;
        if weight != 0.0 && t < cols {
            predicted = f32::cast_from(logits[start + t]) * weight;
        }
        let m = shared_m[0];
        let s = shared_s[0];
        let sum = shared_sum[0];
        out[4 * row] = m;
        out[4 * row + 1] = s;
        out[4 * row + 2] = predicted;
        out[4 * row + 3] = sum;
    }
}

/// The per-row inputs (max, sum_exp, in_range, grad) are f32 `[N]`.
#[cube(launch)]
pub(super) fn cross_entropy_backward_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    max: &Tensor<f32>,
    sum_exp: &Tensor<f32>,
    target: &Tensor<I>,
    in_range: &Tensor<f32>,
    grad: &Tensor<f32>,
    out: &mut Tensor<F>,
    hot_scale: f32,
    uniform: f32,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let cols = logits.shape(1);
    let row = pos / cols;
    let col = pos % cols;
    // The reference's order: softmax, then the one-hot, then the smoothing, then × grad.
    let mut g = f32::exp(f32::cast_from(logits[pos]) - max[row]) / sum_exp[row];
    if col == u32::cast_from(target[row]) as usize {
        g += -(in_range[row] * hot_scale);
    }
    g -= uniform;
    out[pos] = F::cast_from(g * grad[row]);
}
