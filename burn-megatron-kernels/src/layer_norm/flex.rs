//! Flex's LayerNorm: native loops over the rows of f32, f16 or bf16 tensors (values widened
//! to f32), rows split over rayon's threads, each task compiled for the CPU's SIMD level.
//!
//! - Forward, one task per run of rows: per row the mean, then the centred sum of squares
//!   (two passes, so that a large mean does not cancel the variance away), then `y`.
//! - Backward, two passes per row: `Σ g` and `Σ g·x̂` together, then `dx` and the row's
//!   `dy·x̂` and `dy` added into its block's partial `dγ` and `dβ`. Blocks are fixed runs of
//!   rows (their size depends only on the shape), and their partials are added in block
//!   order: the result does not depend on how rayon schedules them.
//!
//! Mixed dtypes and other dtypes go through the reference.

use super::reference::{reference_layer_norm_backward, reference_layer_norm_forward};
use crate::cpu::{f32_tensor, f32_values, lane_sum};
use crate::cpu_elem::Elem;
use crate::cpu_rows::{rows_per_block, rows_per_task, sum_in_block_order, vector_f32};
use crate::ops::rows_and_width;
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, bf16, f16};
use rayon::prelude::*;

type Forward = (FlexTensor, FlexTensor, FlexTensor);

pub(super) fn forward(x: FlexTensor, gamma: FlexTensor, beta: FlexTensor, epsilon: f64) -> Forward {
    let same = beta.dtype() == x.dtype() && gamma.dtype() == x.dtype();
    let native = match x.dtype() {
        _ if !same => None,
        DType::F32 => forward_as::<f32>(&x, &gamma, &beta, epsilon),
        DType::BF16 => forward_as::<bf16>(&x, &gamma, &beta, epsilon),
        DType::F16 => forward_as::<f16>(&x, &gamma, &beta, epsilon),
        _ => None,
    };
    native.unwrap_or_else(|| reference_layer_norm_forward::<Flex>(x, gamma, beta, epsilon))
}

pub(super) fn backward(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    rstd: FlexTensor,
    grad: FlexTensor,
) -> Forward {
    let same = gamma.dtype() == x.dtype() && grad.dtype() == x.dtype();
    let native = match x.dtype() {
        _ if !same => None,
        DType::F32 => backward_as::<f32>(&x, &gamma, &mean, &rstd, &grad),
        DType::BF16 => backward_as::<bf16>(&x, &gamma, &mean, &rstd, &grad),
        DType::F16 => backward_as::<f16>(&x, &gamma, &mean, &rstd, &grad),
        _ => None,
    };
    native.unwrap_or_else(|| reference_layer_norm_backward::<Flex>(x, gamma, mean, rstd, grad))
}

fn forward_as<E: Elem>(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    epsilon: f64,
) -> Option<Forward> {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let xs = E::values(x)?;
    let gamma = vector_f32::<E>(gamma, n).filter(|_| n > 0)?;
    let beta = vector_f32::<E>(beta, n)?;
    let mut y = vec![E::from_f32(0.0); rows * n];
    let (mut mean, mut rstd) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let op = Params {
        gamma: &gamma,
        beta: &beta,
        epsilon: epsilon as f32,
    };
    let per_task = rows_per_task(n);
    y.par_chunks_mut(per_task * n)
        .zip(mean.par_chunks_mut(per_task))
        .zip(rstd.par_chunks_mut(per_task))
        .zip(xs.par_chunks(per_task * n))
        .for_each(|(((y, mean), rstd), x)| {
            pulp::Arch::new().dispatch(ForwardTask {
                op: &op,
                x,
                y,
                mean,
                rstd,
            })
        });
    let column = |v| f32_tensor(v, &[rows]);
    Some((E::tensor(y, &shape), column(mean), column(rstd)))
}

fn backward_as<E: Elem>(
    x: &FlexTensor,
    gamma: &FlexTensor,
    mean: &FlexTensor,
    rstd: &FlexTensor,
    grad: &FlexTensor,
) -> Option<Forward> {
    let shape = x.shape();
    let (rows, n) = rows_and_width(&shape);
    let (xs, dy) = (E::values(x)?, E::values(grad)?);
    let (mean, rstd) = (f32_values(mean)?, f32_values(rstd)?);
    let gamma = vector_f32::<E>(gamma, n).filter(|_| n > 0)?;
    if dy.len() != xs.len() || mean.len() != rows || rstd.len() != rows {
        return None;
    }
    let mut dx = vec![E::from_f32(0.0); rows * n];
    let block = rows_per_block(rows, n);
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(block * n)
        .zip(xs.par_chunks(block * n))
        .zip(dy.par_chunks(block * n))
        .zip(mean.par_chunks(block))
        .zip(rstd.par_chunks(block))
        .map(|((((dx, x), dy), mean), rstd)| {
            pulp::Arch::new().dispatch(BackwardTask {
                gamma: &gamma,
                x,
                dy,
                mean,
                rstd,
                dx,
            })
        })
        .collect();
    // Each partial is `dγ` then `dβ`.
    let sums = sum_in_block_order(&partials, 2 * n);
    let vector = |v: &[f32]| E::tensor(v.iter().map(|&v| E::from_f32(v)).collect(), &[n]);
    Some((
        E::tensor(dx, &shape),
        vector(&sums[..n]),
        vector(&sums[n..]),
    ))
}

struct Params<'a> {
    gamma: &'a [f32],
    beta: &'a [f32],
    epsilon: f32,
}

struct ForwardTask<'a, E> {
    op: &'a Params<'a>,
    x: &'a [E],
    y: &'a mut [E],
    mean: &'a mut [f32],
    rstd: &'a mut [f32],
}

impl<E: Elem> pulp::WithSimd for ForwardTask<'_, E> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Params {
            gamma,
            beta,
            epsilon,
        } = *self.op;
        let n = gamma.len();
        let rows = self.x.chunks(n).zip(self.y.chunks_mut(n));
        let stats = self.mean.iter_mut().zip(self.rstd.iter_mut());
        for ((x, y), (mean, rstd)) in rows.zip(stats) {
            let mu = lane_sum(x, |v| v) / n as f32;
            let var = lane_sum(x, |v| (v - mu) * (v - mu)) / n as f32;
            let r = 1.0 / (var + epsilon).sqrt();
            (*mean, *rstd) = (mu, r);
            for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                *y = E::from_f32((x.to_f32() - mu) * r * g + b);
            }
        }
    }
}

/// A block of rows of the backward; returns the block's partial `dγ` and `dβ`, one after
/// the other.
struct BackwardTask<'a, E> {
    gamma: &'a [f32],
    x: &'a [E],
    dy: &'a [E],
    mean: &'a [f32],
    rstd: &'a [f32],
    dx: &'a mut [E],
}

impl<E: Elem> pulp::WithSimd for BackwardTask<'_, E> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Vec<f32> {
        let gamma = self.gamma;
        let n = gamma.len();
        let mut partial = vec![0.0f32; 2 * n];
        let (dgamma, dbeta) = partial.split_at_mut(n);
        let rows = self
            .x
            .chunks(n)
            .zip(self.dy.chunks(n))
            .zip(self.dx.chunks_mut(n));
        for (((x, dy), dx), (&mu, &r)) in rows.zip(self.mean.iter().zip(self.rstd)) {
            let (mean_g, mean_gx) = row_means(x, dy, gamma, mu, r);
            let items = dx.iter_mut().zip(x).zip(dy).zip(gamma);
            for ((((dx, &x), &dy), &g), (dg, db)) in items.zip(dgamma.iter_mut().zip(&mut *dbeta)) {
                let (x_hat, dy) = ((x.to_f32() - mu) * r, dy.to_f32());
                *dx = E::from_f32((dy * g - mean_g - x_hat * mean_gx) * r);
                *dg += dy * x_hat;
                *db += dy;
            }
        }
        partial
    }
}

/// `(mean(g), mean(g·x̂))` of a row, `g = dy·γ`, `x̂ = (x − μ)·r`, in 16 f32 lanes each.
#[inline(always)]
fn row_means<E: Elem>(x: &[E], dy: &[E], gamma: &[f32], mu: f32, r: f32) -> (f32, f32) {
    let terms = |x: E, dy: E, g: f32| {
        let g = dy.to_f32() * g;
        (g, g * ((x.to_f32() - mu) * r))
    };
    let (mut sg, mut sgx) = ([0.0f32; 16], [0.0f32; 16]);
    let (xc, dc, gc) = (
        x.chunks_exact(16),
        dy.chunks_exact(16),
        gamma.chunks_exact(16),
    );
    let tail = (xc.remainder(), dc.remainder(), gc.remainder());
    for ((x, dy), g) in xc.zip(dc).zip(gc) {
        for i in 0..16 {
            let (a, b) = terms(x[i], dy[i], g[i]);
            sg[i] += a;
            sgx[i] += b;
        }
    }
    let join = |acc: [f32; 16]| acc.iter().fold(0.0, |a, &b| a + b);
    let (mut sum_g, mut sum_gx) = (join(sg), join(sgx));
    for ((&x, &dy), &g) in tail.0.iter().zip(tail.1).zip(tail.2) {
        let (a, b) = terms(x, dy, g);
        sum_g += a;
        sum_gx += b;
    }
    let n = gamma.len() as f32;
    (sum_g / n, sum_gx / n)
}
