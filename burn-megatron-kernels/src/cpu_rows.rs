//! A row loop for Flex's native ops whose output is in the inputs' float type ([`Elem`]:
//! f32, bf16 or f16) and whose inputs are several tensors read by row index: the output's
//! rows split over rayon's threads, each task compiled for the best SIMD level the CPU has
//! (pulp's runtime dispatch), as [`crate::cpu::for_rows`] does for one f32 input.

use crate::cpu_elem::Elem;
use burn::backend::flex::FlexTensor;
use rayon::prelude::*;

/// Output elements per rayon task: below this, splitting costs more than it saves.
const MIN_ELEMENTS_PER_TASK: usize = 1 << 14;
/// Most blocks of a norm's backward, so that their partial parameter gradients stay small.
const MAX_BLOCKS: usize = 64;

/// Rows of width `n` per rayon task.
pub(crate) fn rows_per_task(n: usize) -> usize {
    MIN_ELEMENTS_PER_TASK.div_ceil(n).max(1)
}

/// Rows per block of a norm's backward: a function of the shape only, never of the thread
/// count, so that partial sums added in block order give the same bits on any pool.
pub(crate) fn rows_per_block(rows: usize, n: usize) -> usize {
    rows_per_task(n).max(rows.div_ceil(MAX_BLOCKS))
}

/// The blocks' partial sums (each of `len` values) added in block order, whatever order
/// the blocks ran in.
pub(crate) fn sum_in_block_order(partials: &[Vec<f32>], len: usize) -> Vec<f32> {
    let mut sum = vec![0.0f32; len];
    for partial in partials {
        for (s, p) in sum.iter_mut().zip(partial) {
            *s += p;
        }
    }
    sum
}

/// A `[n]` parameter's values widened to f32, if it holds `n` values of type `E`.
pub(crate) fn vector_f32<E: Elem>(t: &FlexTensor, n: usize) -> Option<Vec<f32>> {
    let v = E::values(t)?;
    (v.len() == n).then(|| v.iter().map(|v| v.to_f32()).collect())
}

/// Writes the rows of an `[N, len]` output. Implementations mark `row` `#[inline(always)]`,
/// so that it is compiled inside [`fill_rows`]' SIMD dispatch.
pub(crate) trait RowFill<E>: Sync {
    /// Writes output row `i` (`len` values). `scratch` belongs to the task: it keeps its
    /// allocation from one row to the next (empty at the task's first row).
    fn row(&self, i: usize, out: &mut [E], scratch: &mut Vec<f32>);
}

/// The `rows × len` output of `op`, rows split over rayon's threads.
pub(crate) fn fill_rows<E: Elem, K: RowFill<E>>(rows: usize, len: usize, op: &K) -> Vec<E> {
    let mut out = vec![E::from_f32(0.0); rows * len];
    if out.is_empty() {
        return out;
    }
    let per_task = rows_per_task(len);
    out.par_chunks_mut(per_task * len)
        .enumerate()
        .for_each(|(t, out)| {
            pulp::Arch::new().dispatch(Task {
                op,
                first: t * per_task,
                out,
                len,
            })
        });
    out
}

struct Task<'a, K, E> {
    op: &'a K,
    first: usize,
    out: &'a mut [E],
    len: usize,
}

impl<E: Elem, K: RowFill<E>> pulp::WithSimd for Task<'_, K, E> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let mut scratch = Vec::new();
        for (r, out) in self.out.chunks_mut(self.len).enumerate() {
            self.op.row(self.first + r, out, &mut scratch);
        }
    }
}

#[cfg(test)]
mod tests;
