//! The cross-entropy CubeCL kernels: one cube per row for the three reductions (each unit
//! strides over the row, then a shared-memory tree; no plane ops, which lavapipe lacks),
//! and one unit per element for the backward. Per-row inputs are read as f32.

use cubecl::prelude::*;

/// The row this cube reduces; the grid is 2-D when there are more rows than one grid
/// dimension holds (65535 on wgpu).
#[cube]
fn cube_row() -> usize {
    CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize
}

/// Reduces `shared[0..CUBE_DIM_X]` (a power of two) to `shared[0]`, by max or by sum; every
/// unit must call it (it holds barriers).
#[cube]
fn tree_reduce(shared: &mut Shared<[f32]>, #[comptime] by_max: bool) -> f32 {
    sync_cube();
    let unit = UNIT_POS_X as usize;
    let mut active = CUBE_DIM_X as usize / 2;
    while active > 0 {
        if unit < active {
            let other = shared[unit + active];
            if by_max {
                shared[unit] = f32::max(shared[unit], other);
            } else {
                shared[unit] += other;
            }
        }
        sync_cube();
        active /= 2;
    }
    shared[0]
}

#[cube(launch)]
pub(super) fn row_max_kernel<F: Float>(
    logits: &Tensor<F>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = cube_row();
    if row >= out.len() {
        terminate!();
    }
    let cols = logits.shape(1);
    let start = row * cols;
    let unit = UNIT_POS_X as usize;
    // Start from an element of the row (not a sentinel), so a row of -inf stays -inf.
    let mut m = f32::cast_from(logits[start + select(unit < cols, unit, 0)]);
    let mut c = unit + block;
    while c < cols {
        m = f32::max(m, f32::cast_from(logits[start + c]));
        c += block;
    }
    let mut shared = Shared::<[f32]>::new_slice(block);
    shared[unit] = m;
    let m = tree_reduce(&mut shared, true);
    if unit == 0 {
        out[row] = m;
    }
}

#[cube(launch)]
pub(super) fn predicted_and_sum_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    max: &Tensor<f32>,
    target: &Tensor<I>,
    in_range: &Tensor<f32>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let row = cube_row();
    if row >= max.len() {
        terminate!();
    }
    let cols = logits.shape(1);
    let start = row * cols;
    let m = max[row];
    let unit = UNIT_POS_X as usize;
    let mut sum = 0.0f32;
    let mut c = unit;
    while c < cols {
        sum += f32::cast_from(logits[start + c]) - m;
        c += block;
    }
    let mut shared = Shared::<[f32]>::new_slice(block);
    shared[unit] = sum;
    let sum = tree_reduce(&mut shared, false);
    if unit == 0 {
        let weight = in_range[row];
        // A negative target wraps to a huge column: out of the slice like any other.
        let t = u32::cast_from(target[row]) as usize;
        let mut predicted = 0.0f32;
        if weight != 0.0 && t < cols {
            predicted = (f32::cast_from(logits[start + t]) - m) * weight;
        }
        out[2 * row] = predicted;
        out[2 * row + 1] = sum;
    }
}

#[cube(launch)]
pub(super) fn sum_exp_kernel<F: Float>(
    logits: &Tensor<F>,
    max: &Tensor<f32>,
    out: &mut Tensor<f32>,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = cube_row();
    if row >= out.len() {
        terminate!();
    }
    let cols = logits.shape(1);
    let start = row * cols;
    let m = max[row];
    let unit = UNIT_POS_X as usize;
    let mut sum = 0.0f32;
    let mut c = unit;
    while c < cols {
        sum += f32::exp(f32::cast_from(logits[start + c]) - m);
        c += block;
    }
    let mut shared = Shared::<[f32]>::new_slice(block);
    shared[unit] = sum;
    let sum = tree_reduce(&mut shared, false);
    if unit == 0 {
        out[row] = sum;
    }
}

/// The per-row inputs (max, sum_exp, in_range, grad) are f32 `[N]`.
#[cube(launch)]
pub(super) fn backward_kernel<F: Float, I: Numeric>(
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
