//! Flex's segment sums of squares: the reference's arithmetic (each square `x·x`, summed by
//! Flex's own f32 sum, so the same bits: the distributed optimizer's norm stays equal to the
//! unsharded one's) without its per-segment tensors: the squares go through one scratch
//! buffer kept by the thread, whose pages are not faulted in afresh at every step.

use super::reference_segment_sum_of_squares;
use crate::cpu::{f32_tensor, f32_values};
use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::backend::flex::simd::kernels::sum_f32;
use rayon::prelude::*;
use std::cell::RefCell;

/// From this length on, Flex sums in parallel chunks of `PARALLEL_CHUNK` (as its `sum`).
const PARALLEL_FROM: usize = 4 * 1024 * 1024;
const PARALLEL_CHUNK: usize = 64 * 1024;

thread_local! {
    static SQUARES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn segment_sum_of_squares(flat: FlexTensor, lengths: Vec<usize>) -> FlexTensor {
    let total: usize = lengths.iter().sum();
    let Some(x) = f32_values(&flat).filter(|x| x.len() == total) else {
        return reference_segment_sum_of_squares::<Flex>(flat, &lengths);
    };
    let mut start = 0;
    let sums: Vec<f32> = SQUARES.with(|squares| {
        let mut squares = squares.borrow_mut();
        lengths
            .iter()
            .map(|&len| {
                squares.clear();
                squares.extend(x[start..start + len].iter().map(|v| v * v));
                start += len;
                if len >= PARALLEL_FROM {
                    squares.par_chunks(PARALLEL_CHUNK).map(sum_f32).sum()
                } else {
                    sum_f32(&squares)
                }
            })
            .collect()
    });
    f32_tensor(sums, &[lengths.len()])
}
