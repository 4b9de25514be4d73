//! Per-cube sums for kernels that reduce while they stream (the found-inf count of the Adam
//! step, the sums of squares): WGSL has no float atomics and lavapipe no plane ops, so every
//! cube folds its units' values in shared memory and writes one partial; a second, small
//! pass combines the partials.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube of the reducing kernels; a power of two for the tree in [`cube_sum`].
pub(crate) const BLOCK: usize = 256;

/// The sum over the cube of every unit's `value`, valid in every unit. Every unit of the cube
/// must call it (it holds barriers), so kernels skip work, not the call.
#[cube]
pub(crate) fn cube_sum(value: f32, #[comptime] block: usize) -> f32 {
    let mut shared = Shared::new_slice(block);
    shared[UNIT_POS as usize] = value;
    sync_cube();
    // Pairs (2·jump·u, 2·jump·u + jump) are disjoint at every level; the barrier sits
    // outside the branch so that every unit reaches it.
    let mut active = CUBE_DIM;
    let mut jump = 1;
    while active > 1 {
        active /= 2;
        if UNIT_POS < active {
            let other = shared[(jump * (2 * UNIT_POS + 1)) as usize];
            shared[(jump * 2 * UNIT_POS) as usize] += other;
        }
        jump *= 2;
        sync_cube();
    }
    shared[0]
}

/// A cube count of at least `cubes` cubes, spread over y when x would pass the 65 535 cubes
/// per dimension that WebGPU allows; kernels read their index from `CUBE_POS` and the extra
/// cubes of the last row return at once.
pub(crate) fn cube_grid(cubes: usize) -> CubeCount {
    const MAX_X: usize = 65_535;
    let x = cubes.clamp(1, MAX_X);
    CubeCount::Static(x as u32, cubes.div_ceil(x).max(1) as u32, 1)
}

/// Uploads host `u32`s as a contiguous `[len]` U32 tensor on `like`'s device.
pub(crate) fn upload_u32(like: &CubeTensor, values: &[u32]) -> CubeTensor {
    let handle = like.client.create_from_slice(u32::as_bytes(values));
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        [values.len()].into(),
        handle,
        DType::U32,
    )
}
