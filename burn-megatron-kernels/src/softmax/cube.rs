//! The scaled masked softmax CubeCL kernels: one cube per row of `sk` scores, units striding
//! over the row, and shared-memory tree reductions (lavapipe has no plane ops).

use super::{MASKED_SCORE, ScaledMaskedSoftmaxOps};
use crate::launch::empty_like;
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Most units per row: a warp's worth, as Megatron's own fused softmax gives each row a warp.
/// Longer rows loop; shorter ones get the next power of two. On lavapipe, 256-unit cubes made
/// the forward 2× slower than Burn's composition (every barrier switches between 32 SIMD
/// groups), 32-unit cubes made it faster (kernel_bench, [1|2, 4|16, 512, 512]).
const MAX_BLOCK: u32 = 32;

/// Where row `CUBE_POS` lives and which of its keys are masked.
#[derive(CubeType, Clone)]
struct Row {
    /// Offset of the row in the scores / output.
    base: usize,
    /// Offset of the row's batch in the `[b, sk]` padding mask.
    pad_base: usize,
    /// Keys `c` with `c + sq > limit` are causally masked (`limit = q + sk`).
    limit: usize,
    sq: usize,
    /// Columns this cube handles: `sk`, or 0 for the spare cubes of the last grid row (they
    /// still reach every barrier).
    len: usize,
}

/// The row of this cube in a `[b, heads, sq, sk]` tensor of `len` elements.
#[cube]
fn row_of(heads: usize, sq: usize, sk: usize, len: usize) -> Row {
    let row = CUBE_POS;
    let rows = len / sk;
    Row {
        base: row * sk,
        pad_base: (row / (heads * sq)) * sk,
        limit: row % sq + sk,
        sq,
        len: select(row < rows, sk, 0),
    }
}

#[cube]
fn is_masked<M: Numeric>(
    pad: &Tensor<M>,
    row: &Row,
    c: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
) -> bool {
    let mut masked = false;
    if causal {
        masked = c + row.sq > row.limit;
    }
    if has_pad {
        masked = masked || pad[row.pad_base + c] != M::from_int(0);
    }
    masked
}

/// Reduces `shared[0..CUBE_DIM]` (a power of two) by max or sum; every unit must call it.
#[cube]
fn reduce_block<F: Float>(shared: &mut Shared<[F]>, #[comptime] max: bool) -> F {
    sync_cube();
    let unit = UNIT_POS as usize;
    let mut active = CUBE_DIM as usize;
    while active > 1 {
        active /= 2;
        if unit < active {
            let other = shared[unit + active];
            if max {
                shared[unit] = F::max(shared[unit], other);
            } else {
                shared[unit] += other;
            }
        }
        sync_cube();
    }
    let result = shared[0];
    // Everyone has read the result before the memory is reused.
    sync_cube();
    result
}

#[cube(launch)]
fn softmax_forward_kernel<F: Float, M: Numeric>(
    scores: &Tensor<F>,
    pad: &Tensor<M>,
    out: &mut Tensor<F>,
    scale: f32,
    #[comptime] block: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let row = row_of(out.shape(1), out.shape(2), out.shape(3), out.len());
    let unit = UNIT_POS as usize;
    let scale = F::cast_from(scale);
    let mut shared = Shared::<[F]>::new_slice(block);

    // The masked score is finite, so the max is a real score and exp(v − max) ≤ 1.
    let mut m = F::min_value();
    let mut c = unit;
    while c < row.len {
        let masked = is_masked::<M>(pad, &row, c, has_pad, causal);
        m = F::max(
            m,
            select(masked, F::new(MASKED_SCORE), scores[row.base + c] * scale),
        );
        c += block;
    }
    shared[unit] = m;
    let max = reduce_block::<F>(&mut shared, true);

    let mut s = F::new(0.0);
    c = unit;
    while c < row.len {
        let masked = is_masked::<M>(pad, &row, c, has_pad, causal);
        s += F::exp(select(masked, F::new(MASKED_SCORE), scores[row.base + c] * scale) - max);
        c += block;
    }
    shared[unit] = s;
    let sum = reduce_block::<F>(&mut shared, false);

    c = unit;
    while c < row.len {
        let masked = is_masked::<M>(pad, &row, c, has_pad, causal);
        let v = select(masked, F::new(MASKED_SCORE), scores[row.base + c] * scale);
        out[row.base + c] = F::exp(v - max) / sum;
        c += block;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn softmax_backward_kernel<F: Float, M: Numeric>(
    output: &Tensor<F>,
    grad: &Tensor<F>,
    pad: &Tensor<M>,
    dx: &mut Tensor<F>,
    scale: f32,
    #[comptime] block: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let row = row_of(dx.shape(1), dx.shape(2), dx.shape(3), dx.len());
    let unit = UNIT_POS as usize;
    let mut shared = Shared::<[F]>::new_slice(block);

    let mut dot = F::new(0.0);
    let mut c = unit;
    while c < row.len {
        dot += grad[row.base + c] * output[row.base + c];
        c += block;
    }
    shared[unit] = dot;
    let dot = reduce_block::<F>(&mut shared, false);

    c = unit;
    while c < row.len {
        let i = row.base + c;
        let masked = is_masked::<M>(pad, &row, c, has_pad, causal);
        let d = output[i] * (grad[i] - dot) * F::cast_from(scale);
        dx[i] = select(masked, F::new(0.0), d);
        c += block;
    }
}

/// Row-per-cube geometry for `rows` rows of `cols` (> 0): units per cube (a power of two),
/// and a grid that stays under the per-axis cube count limit (spare cubes idle).
fn row_geometry(like: &CubeTensor, rows: usize, cols: usize) -> (u32, CubeCount) {
    let hw = &like.client.properties().hardware;
    let max_block = MAX_BLOCK.min(hw.max_cube_dim.0).max(1);
    let block = (cols as u32).next_power_of_two().min(max_block);
    let max_x = hw.max_cube_count.0.clamp(1, 65_535) as usize;
    let x = rows.min(max_x);
    (
        block,
        CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1),
    )
}

impl ScaledMaskedSoftmaxOps for CubeBackend {
    fn scaled_masked_softmax(
        scores: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self> {
        let scores = into_contiguous(scores);
        let shape = scores.shape();
        let n = shape.num_elements();
        if n == 0 {
            return scores; // empty rows or no rows: no launch
        }
        let cols = shape.dims::<4>()[3];
        let out = empty_like(&scores, shape, scores.dtype);
        let (block, count) = row_geometry(&scores, n / cols, cols);
        let pad = into_contiguous(key_padding);
        let dtypes = [
            dtype_to_storage_type(scores.dtype),
            dtype_to_storage_type(pad.dtype),
        ];
        let client = scores.client.clone();
        softmax_forward_kernel::launch(
            &client,
            count,
            CubeDim::new_1d(block),
            scores.into_tensor_arg(),
            pad.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            block as usize,
            padded,
            causal,
            dtypes,
        );
        out
    }

    fn scaled_masked_softmax_backward(
        output: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        scale: f32,
        causal: bool,
    ) -> FloatTensor<Self> {
        let (output, grad) = (into_contiguous(output), into_contiguous(grad));
        let shape = output.shape();
        let n = shape.num_elements();
        if n == 0 {
            return grad;
        }
        let cols = shape.dims::<4>()[3];
        let dx = empty_like(&output, shape, output.dtype);
        let (block, count) = row_geometry(&output, n / cols, cols);
        let pad = into_contiguous(key_padding);
        let dtypes = [
            dtype_to_storage_type(output.dtype),
            dtype_to_storage_type(pad.dtype),
        ];
        let client = output.client.clone();
        softmax_backward_kernel::launch(
            &client,
            count,
            CubeDim::new_1d(block),
            output.into_tensor_arg(),
            grad.into_tensor_arg(),
            pad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            scale,
            block as usize,
            padded,
            causal,
            dtypes,
        );
        dx
    }
}
