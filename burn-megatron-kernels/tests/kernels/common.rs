//! Shared by the kernel tests: deterministic data, differences, and the Cube device.
#![allow(dead_code)] // each test file uses its own subset

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};

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

/// The Cube device the kernels are tested on, with autodiff: `KERNEL_TEST_DEVICE` picks it,
/// `wgpu` (the CPU adapter, lavapipe: the default with the `wgpu` feature), `wgpu-gpu` (a
/// GPU adapter) or `cuda` (device 0: the default with `cuda` alone). These tests exist only
/// with a Cube feature, and a missing device fails them: nothing is skipped behind the
/// runner's back.
#[cfg(feature = "cube")]
pub fn cube_device(test: &str) -> Device {
    use burn_megatron_kernels::device::{cuda_device, wgpu_cpu_device, wgpu_gpu_device};
    let default = if cfg!(feature = "wgpu") {
        "wgpu"
    } else {
        "cuda"
    };
    let which = std::env::var("KERNEL_TEST_DEVICE").unwrap_or_else(|_| default.to_string());
    let device = match which.as_str() {
        "wgpu" => wgpu_cpu_device(),
        "wgpu-gpu" => wgpu_gpu_device(),
        "cuda" => cuda_device(0),
        other => Err(format!(
            "KERNEL_TEST_DEVICE={other}: expected wgpu, wgpu-gpu or cuda"
        )),
    };
    match device {
        Ok(device) => device.autodiff(),
        Err(e) => panic!("{test}: no {which} device ({e})"),
    }
}

/// Whether the Cube device of [`cube_device`] is CUDA.
pub fn on_cuda() -> bool {
    match std::env::var("KERNEL_TEST_DEVICE") {
        Ok(which) => which == "cuda",
        Err(_) => cfg!(feature = "cuda") && !cfg!(feature = "wgpu"),
    }
}

/// `got` is `want` bit for bit, or, where `cuda` (the products are cuBLASLt's there and Burn's
/// matmul is cubek's), within a few roundings of `dt` of each other: each engine sums in f32
/// in its own order, and cubek's f32 rounds its inputs below f32 (about 1e-5 relative).
pub fn assert_same_products(got: &[f32], want: &[f32], dt: DType, cuda: bool, what: &str) {
    if !cuda {
        assert_eq!(got, want, "{what}");
        return;
    }
    let scale = 1.0 + want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let tol = match dt {
        DType::F32 => 1e-4,
        _ => 4e-3,
    } * scale;
    let diff = max_abs_diff(got, want);
    assert!(diff <= tol, "{what}: max |Δ| {diff:e} above {tol:e}");
}

/// The Flex device with autodiff (the reference path).
pub fn flex() -> Device {
    Device::flex().autodiff()
}

/// A tensor of `dims` holding `v` in dtype `dt` on `dev`, and its values as stored.
pub fn tensor<const D: usize>(
    dev: &Device,
    v: Vec<f32>,
    dims: [usize; D],
    dt: DType,
) -> (Tensor<D>, Vec<f32>) {
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    let t = Tensor::<D>::from_data(TensorData::new(v, dims), options);
    let stored = to_vec(t.clone());
    (t, stored)
}

/// max |a − b| over max |b| (over 1 when `b` is all zeros or empty).
pub fn relative(a: &[f32], b: &[f32]) -> f32 {
    let magnitude = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    max_abs_diff(a, b) / if magnitude > 0.0 { magnitude } else { 1.0 }
}

/// The worst relative errors of one op's cases, each held to its tolerance as it is
/// recorded; `report` prints them.
pub struct Worst<const N: usize> {
    what: String,
    names: &'static str,
    tol: [f32; N],
    worst: [f32; N],
}

impl<const N: usize> Worst<N> {
    /// `what` names the op, device and dtype; `names` the errors, e.g. `"[y, dx]"`.
    pub fn new(what: String, names: &'static str, tol: [f32; N]) -> Self {
        Self {
            what,
            names,
            tol,
            worst: [0.0; N],
        }
    }

    /// Asserts `errors` of `case` are within the tolerances.
    pub fn record(&mut self, case: &str, errors: [f32; N]) {
        for (w, e) in self.worst.iter_mut().zip(errors) {
            *w = w.max(e);
        }
        assert!(
            errors.iter().zip(&self.tol).all(|(e, t)| e <= t),
            "{} {case}: relative errors {} {errors:?} > {:?}",
            self.what,
            self.names,
            self.tol
        );
    }

    /// Prints the worst errors seen.
    pub fn report(&self) {
        eprintln!(
            "{}: worst relative {} {:?}",
            self.what, self.names, self.worst
        );
    }
}

/// On CUDA: cuBLASLt is the GEMM engine, ran GEMMs since `before` and failed none over to
/// cubek, and no waiting kernel gave up on its stream.
#[cfg(feature = "cuda")]
pub fn assert_cublaslt_ran(before: &burn_megatron_kernels::cuda::GemmStats, what: &str) {
    use burn_megatron_kernels::cuda::{GemmEngine, gemm_engine, gemm_stats, order::check_waits};
    let after = gemm_stats();
    assert_eq!(
        gemm_engine(),
        GemmEngine::CublasLt,
        "cuBLASLt is not in use on CUDA"
    );
    assert!(
        after.cublaslt > before.cublaslt && after.fallbacks == before.fallbacks,
        "cuBLASLt ran {} {what} and failed {} (first: {:?})",
        after.cublaslt - before.cublaslt,
        after.fallbacks - before.fallbacks,
        after.first_failure
    );
    check_waits().unwrap();
}
