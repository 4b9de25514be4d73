//! Flex's RMSNorm: native loops over the rows of f32, f16 or bf16 tensors (values widened to
//! f32), rows split over rayon's threads, each task compiled for the CPU's SIMD level. The
//! reference walks and allocates the tensor about six times per direction.
//!
//! - Forward, one pass per row: the sum of squares in 16 f32 lanes, then `y` rounded exactly
//!   as Burn's op chain rounds it (`rms` to the dtype, the quotient, the product).
//! - Backward, two passes per row: `Σ dy·γ·x̂`, then `dx` and the row's `dy·x̂` added into its
//!   block's partial `dγ`. Blocks are fixed runs of rows (their size depends only on the
//!   shape), and their partials are added in block order: the result does not depend on how
//!   rayon schedules them.
//!
//! Mixed dtypes (`x` and `gamma` differ) and other dtypes go through the reference.

use super::reference::{reference_rms_norm_backward, reference_rms_norm_forward};
use crate::cpu::lane_sum;
use crate::cpu::{f32_tensor, f32_values};
use crate::cpu_elem::Elem;
use crate::cpu_rows::{rows_per_block, rows_per_task, sum_in_block_order, vector_f32};
use crate::ops::rows_and_width;
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, bf16, f16};
use rayon::prelude::*;

pub(super) fn forward(x: FlexTensor, gamma: FlexTensor, epsilon: f64) -> (FlexTensor, FlexTensor) {
    let native = match (x.dtype(), gamma.dtype()) {
        (DType::F32, DType::F32) => forward_as::<f32>(&x, &gamma, epsilon),
        (DType::BF16, DType::BF16) => forward_as::<bf16>(&x, &gamma, epsilon),
        (DType::F16, DType::F16) => forward_as::<f16>(&x, &gamma, epsilon),
        _ => None,
    };
    native.unwrap_or_else(|| reference_rms_norm_forward::<Flex>(x, gamma, epsilon))
}

pub(super) fn backward(
    x: FlexTensor,
    gamma: FlexTensor,
    inv_rms: FlexTensor,
    grad: FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let native = match (x.dtype(), gamma.dtype(), grad.dtype()) {
        (DType::F32, DType::F32, DType::F32) => backward_as::<f32>(&x, &gamma, &inv_rms, &grad),
        (DType::BF16, DType::BF16, DType::BF16) => backward_as::<bf16>(&x, &gamma, &inv_rms, &grad),
        (DType::F16, DType::F16, DType::F16) => backward_as::<f16>(&x, &gamma, &inv_rms, &grad),
        _ => None,
    };
    native.unwrap_or_else(|| reference_rms_norm_backward::<Flex>(x, gamma, inv_rms, grad))
}

fn forward_as<E: Elem>(
    x: &FlexTensor,
    gamma: &FlexTensor,
    epsilon: f64,
) -> Option<(FlexTensor, FlexTensor)> {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let xs = E::values(x)?;
    let gamma = vector_f32::<E>(gamma, n).filter(|_| n > 0)?;
    let mut y = vec![E::from_f32(0.0); rows * n];
    let mut inv_rms = vec![0.0f32; rows];
    let op = Forward {
        gamma: &gamma,
        // As Flex adds an f64 scalar to an f32 tensor.
        epsilon: epsilon as f32,
    };
    let per_task = rows_per_task(n);
    y.par_chunks_mut(per_task * n)
        .zip(inv_rms.par_chunks_mut(per_task))
        .zip(xs.par_chunks(per_task * n))
        .for_each(|((y, inv_rms), x)| {
            pulp::Arch::new().dispatch(ForwardTask {
                op: &op,
                x,
                y,
                inv_rms,
            })
        });
    Some((E::tensor(y, &shape), f32_tensor(inv_rms, &[rows])))
}

fn backward_as<E: Elem>(
    x: &FlexTensor,
    gamma: &FlexTensor,
    inv_rms: &FlexTensor,
    grad: &FlexTensor,
) -> Option<(FlexTensor, FlexTensor)> {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let (xs, dy, r) = (E::values(x)?, E::values(grad)?, f32_values(inv_rms)?);
    let gamma = vector_f32::<E>(gamma, n).filter(|_| n > 0)?;
    if dy.len() != xs.len() || r.len() != rows {
        return None;
    }
    let mut dx = vec![E::from_f32(0.0); rows * n];
    let block = rows_per_block(rows, n);
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(block * n)
        .zip(xs.par_chunks(block * n))
        .zip(dy.par_chunks(block * n))
        .zip(r.par_chunks(block))
        .map(|(((dx, x), dy), r)| {
            pulp::Arch::new().dispatch(BackwardTask {
                gamma: &gamma,
                x,
                dy,
                r,
                dx,
            })
        })
        .collect();
    let dgamma = sum_in_block_order(&partials, n)
        .into_iter()
        .map(E::from_f32)
        .collect();
    Some((E::tensor(dx, &shape), E::tensor(dgamma, &[n])))
}

struct Forward<'a> {
    gamma: &'a [f32],
    epsilon: f32,
}

struct ForwardTask<'a, E> {
    op: &'a Forward<'a>,
    x: &'a [E],
    y: &'a mut [E],
    inv_rms: &'a mut [f32],
}

impl<E: Elem> pulp::WithSimd for ForwardTask<'_, E> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let n = self.op.gamma.len();
        let rows = self.x.chunks(n).zip(self.y.chunks_mut(n));
        for ((x, y), inv) in rows.zip(self.inv_rms.iter_mut()) {
            // Burn: `(x.cast(F32).square().mean_dim(-1) + ε).sqrt()`, then `x / rms.cast(dtype)
            // * γ`, each op rounding to the dtype.
            let mean = lane_sum(x, |v| v * v) / n as f32;
            let rms = (mean + self.op.epsilon).sqrt();
            *inv = 1.0 / rms;
            let rms = E::round(rms);
            for ((y, &x), &g) in y.iter_mut().zip(x).zip(self.op.gamma) {
                *y = E::from_f32(E::round(x.to_f32() / rms) * g);
            }
        }
    }
}

/// A block of rows of the backward; returns the block's partial `dγ`.
struct BackwardTask<'a, E> {
    gamma: &'a [f32],
    x: &'a [E],
    dy: &'a [E],
    r: &'a [f32],
    dx: &'a mut [E],
}

impl<E: Elem> pulp::WithSimd for BackwardTask<'_, E> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Vec<f32> {
        let gamma = self.gamma;
        let n = gamma.len();
        let mut dgamma = vec![0.0f32; n];
        let rows = self
            .x
            .chunks(n)
            .zip(self.dy.chunks(n))
            .zip(self.dx.chunks_mut(n));
        for (((x, dy), dx), &r) in rows.zip(self.r) {
            let mean = dot_mean(x, dy, gamma, r);
            let items = dx.iter_mut().zip(x).zip(dy).zip(gamma).zip(&mut dgamma);
            for ((((dx, &x), &dy), &g), dg) in items {
                let (x_hat, dy) = (x.to_f32() * r, dy.to_f32());
                *dx = E::from_f32((dy * g - x_hat * mean) * r);
                *dg += dy * x_hat;
            }
        }
        dgamma
    }
}

/// `mean(dy·γ·x̂)` of a row, `x̂ = x·r`, in 16 f32 lanes.
#[inline(always)]
fn dot_mean<E: Elem>(x: &[E], dy: &[E], gamma: &[f32], r: f32) -> f32 {
    let term = |x: E, dy: E, g: f32| dy.to_f32() * g * (x.to_f32() * r);
    let mut acc = [0.0f32; 16];
    let (xc, dc, gc) = (
        x.chunks_exact(16),
        dy.chunks_exact(16),
        gamma.chunks_exact(16),
    );
    let tail = (xc.remainder(), dc.remainder(), gc.remainder());
    for ((x, dy), g) in xc.zip(dc).zip(gc) {
        for (i, a) in acc.iter_mut().enumerate() {
            *a += term(x[i], dy[i], g[i]);
        }
    }
    let mut sum = acc.iter().fold(0.0, |a, &b| a + b);
    for ((&x, &dy), &g) in tail.0.iter().zip(tail.1).zip(tail.2) {
        sum += term(x, dy, g);
    }
    sum / gamma.len() as f32
}
