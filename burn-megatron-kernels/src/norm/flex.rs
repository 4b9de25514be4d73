//! Flex's segment sums of squares. A short segment is summed as the reference does (each
//! square `x·x`, then Flex's own f32 sum: the same bits, so a parameter cut into pieces by
//! the distributed optimizer gives the unsharded norm exactly on small models); a long one
//! in one pass, each square added into 16 f32 lanes where the value lies (no buffer of
//! squares), the longest in fixed chunks over rayon's threads whose partial sums are added
//! in chunk order, so the result does not depend on how the threads split the work.

use super::reference_segment_sum_of_squares;
use crate::cpu::{f32_tensor, f32_values, lane_sum};
use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::backend::flex::simd::kernels::sum_f32;
use rayon::prelude::*;

/// Below this length a segment's squares fit a stack buffer and are summed by Flex.
const SHORT: usize = 4096;
/// From this length on, a segment is summed in parallel chunks of `CHUNK`.
const PARALLEL_FROM: usize = 1 << 18;
const CHUNK: usize = 1 << 16;

pub(super) fn segment_sum_of_squares(flat: FlexTensor, lengths: Vec<usize>) -> FlexTensor {
    let total: usize = lengths.iter().sum();
    let Some(x) = f32_values(&flat).filter(|x| x.len() == total) else {
        return reference_segment_sum_of_squares::<Flex>(flat, &lengths);
    };
    let square_sum = |xs: &[f32]| pulp::Arch::new().dispatch(SquareSum(xs));
    let mut squares = [0.0f32; SHORT];
    let mut start = 0;
    let sums: Vec<f32> = lengths
        .iter()
        .map(|&len| {
            let xs = &x[start..start + len];
            start += len;
            if len < SHORT {
                let squares = &mut squares[..len];
                for (s, v) in squares.iter_mut().zip(xs) {
                    *s = v * v;
                }
                sum_f32(squares)
            } else if len < PARALLEL_FROM {
                square_sum(xs)
            } else {
                let parts: Vec<f32> = xs.par_chunks(CHUNK).map(square_sum).collect();
                parts.iter().sum()
            }
        })
        .collect();
    f32_tensor(sums, &[lengths.len()])
}

/// `Σ x²` of a slice, compiled for the CPU's SIMD level.
struct SquareSum<'a>(&'a [f32]);

impl pulp::WithSimd for SquareSum<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> f32 {
        lane_sum(self.0, |v| v * v)
    }
}
