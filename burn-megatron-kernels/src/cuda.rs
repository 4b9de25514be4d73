//! CUDA at run time: which of its libraries this machine has, and a CUDA device that is an
//! error rather than a panic when it has none.
//!
//! The `cuda` feature links none of CUDA: the driver (`libcuda`), NVRTC (`libnvrtc`, which
//! compiles the CubeCL kernels from CUDA C++) and NCCL (`libnccl`) are loaded when first
//! used, and a library that is missing then panics inside the bindings. [`cuda_device`]
//! checks first.
//!
//! ```no_run
//! let libraries = burn_megatron_kernels::cuda::cuda_libraries();
//! println!("{libraries}");
//! match burn_megatron_kernels::cuda::cuda_device(0) {
//!     Ok(device) => println!("training on {device:?}"),
//!     Err(why) => println!("no CUDA: {why}"),
//! }
//! ```

use burn::tensor::Device;

pub(crate) mod blas;
pub mod order;

pub use blas::{GEMM_VAR, GemmEngine, GemmStats, TF32_VAR, gemm_engine, gemm_stats, set_cublaslt};

/// Which CUDA libraries can be loaded here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLibraries {
    /// The driver, `libcuda` (comes with the NVIDIA driver).
    pub driver: bool,
    /// NVRTC, `libnvrtc` (the CUDA toolkit, or the `nvidia-cuda-nvrtc` wheel).
    pub nvrtc: bool,
    /// NCCL, `libnccl.so.2` (for the `nccl` launch backend; see [`nccl_library_candidates`]).
    pub nccl: bool,
    /// cuBLASLt, `libcublasLt` (the linear layers' GEMMs; see [`gemm_engine`]).
    pub cublaslt: bool,
}

impl std::fmt::Display for CudaLibraries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let found = |b: bool| if b { "found" } else { "not found" };
        write!(
            f,
            "libcuda {}, libnvrtc {}, libnccl {}, libcublasLt {}",
            found(self.driver),
            found(self.nvrtc),
            found(self.nccl),
            found(self.cublaslt)
        )
    }
}

/// Looks for the CUDA libraries on the loader's path (as the bindings will load them).
pub fn cuda_libraries() -> CudaLibraries {
    // SAFETY: each probe loads the library and unloads it; the CUDA libraries' load-time
    // initialisers have no preconditions.
    unsafe {
        CudaLibraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            nccl: nccl_library_candidates()
                .iter()
                .any(|name| libloading::Library::new(name).is_ok()),
            cublaslt: cudarc::cublaslt::sys::is_culib_present(),
        }
    }
}

/// The variable naming the NCCL library to load (a path), instead of the names on the
/// loader's path.
pub const NCCL_LIBRARY_VAR: &str = "BURN_MEGATRON_NCCL_LIBRARY";

/// The NCCL libraries to try, in order: the path in [`NCCL_LIBRARY_VAR`] alone when it is
/// set (a named library that fails to load is an error, not a reason to load another), else
/// `libnccl.so.2` and `libnccl.so` on the loader's path.
///
/// ```
/// let names = burn_megatron_kernels::cuda::nccl_library_candidates();
/// assert!(!names.is_empty());
/// ```
pub fn nccl_library_candidates() -> Vec<std::ffi::OsString> {
    match std::env::var_os(NCCL_LIBRARY_VAR) {
        Some(path) if !path.is_empty() => vec![path],
        _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
    }
}

/// Why there is no CUDA device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CudaUnavailable {
    /// No `libcuda`: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded (is the NVIDIA driver installed?)")]
    NoDriver,
    /// The driver failed to start.
    #[error("the CUDA driver failed to initialise: {0}")]
    Driver(String),
    /// Fewer devices than the ordinal asked for.
    #[error("CUDA device {ordinal} asked for, the driver sees {count}")]
    NoSuchDevice {
        /// The device asked for.
        ordinal: usize,
        /// The devices the driver sees.
        count: usize,
    },
    /// No `libnvrtc`, which compiles the kernels.
    #[error(
        "no NVRTC: libnvrtc could not be loaded, and the CubeCL kernels compile through it \
         (install the CUDA toolkit or the nvidia-cuda-nvrtc wheel, and put its lib directory \
         on LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
}

/// CUDA device `ordinal` (add `.autodiff()` to train on it), once the driver is loaded and
/// started, sees the device, and NVRTC is there to compile kernels.
pub fn cuda_device(ordinal: usize) -> Result<Device, CudaUnavailable> {
    let libraries = cuda_libraries();
    if !libraries.driver {
        return Err(CudaUnavailable::NoDriver);
    }
    cudarc::driver::result::init().map_err(|e| CudaUnavailable::Driver(format!("{e:?}")))?;
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| CudaUnavailable::Driver(format!("{e:?}")))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaUnavailable::NoSuchDevice { ordinal, count });
    }
    if !libraries.nvrtc {
        return Err(CudaUnavailable::NoNvrtc);
    }
    Ok(Device::cuda(ordinal))
}

/// A CUDA device's memory as its driver counts it, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// In use, by every process on the device (on a device of one's own: this process's
    /// context and CubeCL's memory pools, which keep what they reserved).
    pub used: u64,
    /// The device's memory.
    pub total: u64,
}

impl std::fmt::Display for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{:.2} GiB of {:.1} GiB in use",
            gib(self.used),
            gib(self.total)
        )
    }
}

/// CUDA device `ordinal`'s memory in use and in all (`cuMemGetInfo` in its primary context,
/// the one Burn's CUDA backend runs in).
///
/// ```no_run
/// match burn_megatron_kernels::cuda::device_memory(0) {
///     Ok(memory) => println!("device 0: {memory}"),
///     Err(why) => println!("no CUDA: {why}"),
/// }
/// ```
pub fn device_memory(ordinal: usize) -> Result<DeviceMemory, CudaUnavailable> {
    if !cuda_libraries().driver {
        return Err(CudaUnavailable::NoDriver);
    }
    let driver = |e: cudarc::driver::DriverError| CudaUnavailable::Driver(format!("{e:?}"));
    // Retains the primary context and makes it current on this thread.
    let _context = cudarc::driver::CudaContext::new(ordinal).map_err(driver)?;
    let (free, total) = cudarc::driver::result::mem_get_info().map_err(driver)?;
    Ok(DeviceMemory {
        used: (total - free) as u64,
        total: total as u64,
    })
}

#[cfg(test)]
mod tests;
