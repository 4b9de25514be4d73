//! The segmented sum-of-squares kernels: per-chunk partials, then per-segment totals.

use super::SumOfSquaresOps;
use crate::cube_sum::{BLOCK, cube_grid, cube_sum, upload_u32};
use crate::launch::{elementwise_geometry, empty_like};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

/// Elements per chunk (one cube): 16 per unit keeps the partials ~n/4096 while every unit
/// still has few serial additions.
const CHUNK: usize = BLOCK * 16;

/// Cube `c` sums the squares of `flat[bounds[2c] .. bounds[2c + 1]]` into `partials[c]`.
#[cube(launch)]
fn chunk_sums_kernel<F: Float>(
    flat: &Tensor<F>,
    bounds: &Tensor<u32>,
    partials: &mut Tensor<f32>,
    #[define(F)] _dtype: ElemType,
) {
    let cube = CUBE_POS;
    // Cubes past the end (the last row of a 2-D grid) skip the work but still reach the
    // barriers of `cube_sum`: a return before them would make the barriers non-uniform.
    let live = cube * 2 < bounds.len();
    let pair = select(live, cube * 2, 0);
    let end = select(live, bounds[pair + 1] as usize, 0);
    let mut i = bounds[pair] as usize + UNIT_POS as usize;
    let mut acc = 0.0f32;
    while i < end {
        let x = f32::cast_from(flat[i]);
        acc += x * x;
        i += BLOCK;
    }
    let total = cube_sum(acc, BLOCK);
    if UNIT_POS == 0 && live {
        partials[cube] = total;
    }
}

/// Unit `t` adds `partials[first[t] .. first[t + 1]]`, in order, into `out[t]`.
#[cube(launch)]
fn segment_totals_kernel(partials: &Tensor<f32>, first: &Tensor<u32>, out: &mut Tensor<f32>) {
    let t = ABSOLUTE_POS;
    if t >= out.len() {
        terminate!();
    }
    let mut acc = 0.0f32;
    for c in first[t]..first[t + 1] {
        acc += partials[c as usize];
    }
    out[t] = acc;
}

/// The chunk bounds (`[start, end]` pairs) and each segment's first chunk (plus the end).
fn chunk_tables(lengths: &[usize]) -> (Vec<u32>, Vec<u32>) {
    let (mut bounds, mut first, mut start) = (vec![], vec![0u32], 0usize);
    for &len in lengths {
        let end = start + len;
        let mut s = start;
        while s < end {
            let e = (s + CHUNK).min(end);
            bounds.extend([s as u32, e as u32]);
            s = e;
        }
        first.push((bounds.len() / 2) as u32);
        start = end;
    }
    (bounds, first)
}

impl SumOfSquaresOps for CubeBackend {
    fn segment_sum_of_squares(flat: FloatTensor<Self>, lengths: Vec<usize>) -> FloatTensor<Self> {
        let flat = into_contiguous(flat);
        let empty = |len: usize| empty_like(&flat, Shape::from([len]), DType::F32);
        let out = empty(lengths.len());
        let Some((unit_dim, unit_count)) = elementwise_geometry(&flat, lengths.len()) else {
            return out;
        };
        let (bounds, first) = chunk_tables(&lengths);
        let chunks = bounds.len() / 2;
        // At least one element so that the second kernel binds a real buffer.
        let partials = empty(chunks.max(1));
        let client = flat.client.clone();
        let first = upload_u32(&flat, &first);
        if chunks > 0 {
            let bounds = upload_u32(&flat, &bounds);
            let dtype = dtype_to_storage_type(flat.dtype);
            chunk_sums_kernel::launch(
                &client,
                cube_grid(chunks),
                CubeDim::new_1d(BLOCK as u32),
                flat.into_tensor_arg(),
                bounds.into_tensor_arg(),
                partials.clone().into_tensor_arg(),
                dtype,
            );
        }
        segment_totals_kernel::launch(
            &client,
            unit_count,
            unit_dim,
            partials.into_tensor_arg(),
            first.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
        out
    }
}
