//! Column sums of a `[rows, n]` product in two passes, for the norms' `dγ` and `dβ`: one unit
//! per (block of rows, column) writes a partial, then one unit per column adds the partials
//! in block order. One unit per column walking every row left most of a GPU idle (2048 units
//! for a hidden size of 2048: 1.7 ms per launch on an H200 for 8192 rows). Blocks are fixed
//! runs of rows that depend only on the shape, so the sums are deterministic, as Flex's are.

use crate::launch::{elementwise_geometry, empty_like};
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Blocks of rows per column at most: the partials stay within 256 · n f32s.
const MAX_BLOCKS: usize = 256;
/// Rows per block at least: short blocks would make the second pass the long one.
const MIN_ROWS: usize = 64;

/// Rows per block and blocks, for `rows` rows.
pub(crate) fn row_blocks(rows: usize) -> (usize, usize) {
    let per = rows.div_ceil(MAX_BLOCKS).max(MIN_ROWS);
    (per, rows.div_ceil(per).max(1))
}

/// `out[c] = Σ_k partials[k·n + c]`, `k` in order.
#[cube(launch)]
fn column_sums_kernel(partials: &Tensor<f32>, out: &mut Tensor<f32>) {
    let c = ABSOLUTE_POS;
    let n = out.len();
    if c >= n {
        terminate!();
    }
    let blocks = partials.len() / n;
    let mut acc = 0.0f32;
    for k in 0..blocks {
        acc += partials[k * n + c];
    }
    out[c] = acc;
}

/// A `[blocks · n]` f32 buffer for the partials, on `like`'s device.
pub(crate) fn partials(like: &CubeTensor, blocks: usize, n: usize) -> CubeTensor {
    empty_like(like, Shape::from([blocks * n]), DType::F32)
}

/// The `[n]` column sums of `partials` (`[blocks · n]`, f32).
pub(crate) fn column_sums(partials: CubeTensor, n: usize) -> CubeTensor {
    let out = empty_like(&partials, Shape::from([n]), DType::F32);
    if let Some((cube_dim, count)) = elementwise_geometry(&partials, n) {
        column_sums_kernel::launch(
            &partials.client.clone(),
            count,
            cube_dim,
            partials.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::row_blocks;

    /// Every row in exactly one block, at most 256 blocks, at least 64 rows a block.
    #[test]
    fn the_blocks_cover_the_rows() {
        for rows in [1, 63, 64, 65, 5000, 8192, 16_384, 1 << 20, (1 << 20) + 7] {
            let (per, blocks) = row_blocks(rows);
            assert!(per * blocks >= rows && per * (blocks - 1) < rows, "{rows}");
            assert!(blocks <= 256 && per >= 64, "{rows}: {per} × {blocks}");
        }
        assert_eq!(row_blocks(8192), (64, 128));
    }
}
