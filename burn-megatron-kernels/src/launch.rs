//! Launch geometry shared by the CubeCL kernels.

use burn::backend::TensorMetadata;
use burn_cubecl::ops::numeric::empty_device_dtype;
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
    let out = empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        like.shape(),
        like.dtype,
    );
    let geometry = elementwise_geometry(like, out.shape().num_elements());
    (out, geometry)
}
