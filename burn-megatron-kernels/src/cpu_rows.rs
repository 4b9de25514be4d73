//! A row loop for Flex's native ops whose output is in the inputs' float type ([`Elem`]:
//! f32, bf16 or f16) and whose inputs are several tensors read by row index: the output's
//! rows split over rayon's threads, each task compiled for the best SIMD level the CPU has
//! (pulp's runtime dispatch), as [`crate::cpu::for_rows`] does for one f32 input.

use crate::cpu_elem::Elem;
use rayon::prelude::*;

/// Output elements per rayon task: below this, splitting costs more than it saves.
const MIN_ELEMENTS_PER_TASK: usize = 1 << 14;

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
    let per_task = MIN_ELEMENTS_PER_TASK.div_ceil(len).max(1);
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
mod tests {
    use super::*;

    struct Index;

    impl RowFill<f32> for Index {
        #[inline(always)]
        fn row(&self, i: usize, out: &mut [f32], scratch: &mut Vec<f32>) {
            scratch.push(0.0);
            for (j, o) in out.iter_mut().enumerate() {
                *o = (i * 1000 + j) as f32;
            }
        }
    }

    #[test]
    fn every_row_is_written_once_in_order() {
        for (rows, len) in [(0, 3), (3, 0), (1, 1), (5000, 7), (3, 40_000)] {
            let out = fill_rows(rows, len, &Index);
            assert_eq!(out.len(), rows * len);
            for (k, &v) in out.iter().enumerate() {
                assert_eq!(v, ((k / len) * 1000 + k % len) as f32);
            }
        }
    }
}
