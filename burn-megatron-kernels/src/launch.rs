//! Launch geometry shared by the CubeCL kernels, and the row-per-cube pieces of the row
//! reductions (norms, cross-entropy).

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

/// One unit per element of an `n`-element output: (cube dim, cube count), or `None` when
/// `n == 0` (nothing to launch; a zero-sized launch is an error on some runtimes).
pub(crate) fn elementwise_geometry(like: &CubeTensor, n: usize) -> Option<(CubeDim, CubeCount)> {
    (n > 0).then(|| {
        let cube_dim = CubeDim::new(&like.client, n);
        (
            cube_dim,
            calculate_cube_count_elemwise(&like.client, n, cube_dim),
        )
    })
}

/// A contiguous, uninitialised output shaped and typed like `like`, and the element-wise
/// geometry for it (see [`elementwise_geometry`]).
pub(crate) fn elementwise_launch(like: &CubeTensor) -> (CubeTensor, Option<(CubeDim, CubeCount)>) {
    let out = empty_like(like, like.shape(), like.dtype);
    let geometry = elementwise_geometry(like, out.shape().num_elements());
    (out, geometry)
}

/// Units per row cube: a power of two (the tree needs it), no more than the row needs
/// (short rows are common in the tests, long ones in training) nor the hardware allows.
pub(crate) fn row_block_size(tensor: &CubeTensor, cols: usize) -> usize {
    let hw = tensor.client.properties().hardware.max_cube_dim.0 as usize;
    let hw = 1 << hw.max(1).ilog2();
    cols.next_power_of_two().clamp(32, 256).min(hw)
}

/// One cube per row, the rows folded into a 2-D grid past the hardware's x limit.
pub(crate) fn row_cube_count(tensor: &CubeTensor, rows: usize) -> CubeCount {
    let max_x = tensor.client.properties().hardware.max_cube_count.0 as usize;
    let x = rows.clamp(1, max_x.max(1));
    CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1)
}

/// The row of this cube under [`row_cube_count`]'s grid.
#[cube]
pub(crate) fn cube_row() -> usize {
    CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize
}

/// Sums `shared[0..CUBE_DIM_X]` (a power of two) in a tree (no plane ops, which lavapipe
/// lacks); every unit must call it (barriers).
#[cube]
pub(crate) fn tree_sum(shared: &mut Shared<[f32]>) -> f32 {
    sync_cube();
    let unit = UNIT_POS_X as usize;
    let mut active = CUBE_DIM_X as usize / 2;
    while active > 0 {
        if unit < active {
            let other = shared[unit + active];
            shared[unit] += other;
        }
        sync_cube();
        active /= 2;
    }
    shared[0]
}

/// An uninitialised, contiguous tensor of `shape` and `dtype` on `like`'s device.
///
/// Contiguous, not Burn's default layout: on CUDA that pads each row to an aligned pitch
/// (a `[3, 5]` f32 tensor gets rows 128 floats apart), and every kernel here indexes its
/// outputs as packed rows. The first GPU run found it: 16 of the 27 Cube kernel tests wrote
/// into the padding. Every kernel output in this crate is allocated here.
pub(crate) fn empty_like(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// Zeros shaped and typed like `t`.
pub(crate) fn zeros_like<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros(t.shape(), &t.device(), FloatDType::from(t.dtype()))
}
