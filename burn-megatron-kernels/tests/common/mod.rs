//! Shared by the kernel tests: deterministic data, differences, and the wgpu device (the
//! wgpu tests exist only with the `wgpu` feature and fail without an adapter).
#![allow(dead_code)] // each test file uses its own subset

use burn::tensor::{Device, Tensor};

/// Deterministic values in [-scale, scale].
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The tensor's values as f32.
pub fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// max |a − b| over equal-length slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The wgpu (lavapipe) device with autodiff. These tests are compiled only with the `wgpu`
/// feature, and then a missing adapter fails them: nothing is skipped behind the runner's
/// back.
#[cfg(feature = "wgpu")]
pub fn wgpu_device(test: &str) -> Device {
    match burn_megatron_kernels::device::wgpu_cpu_device() {
        Ok(device) => device.autodiff(),
        Err(e) => panic!(
            "{test}: built with the wgpu feature but no wgpu adapter ({e}): install \
             mesa-vulkan-drivers, or build without the feature"
        ),
    }
}

/// The Flex device with autodiff (the reference path).
pub fn flex() -> Device {
    Device::flex().autodiff()
}
