//! The wgpu device for kernel tests and benchmarks: Vulkan on the CPU adapter (Mesa's
//! lavapipe where no GPU is present), opened once per process.

use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor, TensorData};
use std::sync::atomic::{AtomicU64, Ordering};

/// Host reads of tensors through [`ReadBack`], this process's threads together.
static HOST_READS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The same, this thread's alone.
    static THREAD_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A tensor read back to the host, counted: on a GPU the host waits for every kernel
/// queued before the read, so each one inside a training step stalls the launch queue.
/// The library's reads inside a step all go through here (the loss of each micro-batch,
/// the index checks, the grad norm and inf/NaN check, and the collectives staged through
/// host memory), so that [`host_reads`] counts the step's synchronisations.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::device::{ReadBack, host_reads};
/// let before = host_reads();
/// let data = Tensor::<1>::ones([3], &Device::flex()).read_back();
/// assert_eq!(data.num_elements(), 3);
/// assert!(host_reads() > before);
/// assert_eq!(burn_megatron_kernels::device::thread_host_reads(), 1);
/// ```
pub trait ReadBack {
    /// `into_data`, counted in [`host_reads`].
    fn read_back(self) -> TensorData;
}

impl<const D: usize, K: Basic> ReadBack for Tensor<D, K> {
    fn read_back(self) -> TensorData {
        count_host_read();
        self.into_data()
    }
}

/// Counts a host read made below the tensor API (a backend tensor read inside an autodiff
/// op: the tensor-parallel mappings' collectives staged through host memory).
pub fn count_host_read() {
    HOST_READS.fetch_add(1, Ordering::Relaxed);
    THREAD_READS.with(|n| n.set(n.get() + 1));
}

/// Reads through [`ReadBack`] by this thread so far: one rank's, when ranks are threads
/// (a rank's step reads on its own thread: its forward, backward and optimizer step).
pub fn thread_host_reads() -> u64 {
    THREAD_READS.with(|n| n.get())
}

/// Reads through [`ReadBack`] so far, over every thread of this process (every rank, when
/// ranks are threads).
pub fn host_reads() -> u64 {
    HOST_READS.load(Ordering::Relaxed)
}

/// The CPU-kind Vulkan wgpu device, or why there is none: no Vulkan driver, or this build
/// lacks the `wgpu` feature. Opening a wgpu device twice fails, so the result is cached.
///
/// ```
/// match burn_megatron_kernels::device::wgpu_cpu_device() {
///     Ok(device) => println!("kernels run on {device:?}"),
///     Err(why) => println!("references only: {why}"),
/// }
/// ```
pub fn wgpu_cpu_device() -> Result<Device, String> {
    #[cfg(feature = "wgpu")]
    {
        use burn::tensor::DeviceKind;
        use std::sync::OnceLock;
        static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
        DEVICE
            .get_or_init(|| {
                Device::wgpu_options()
                    .device_kind(DeviceKind::Cpu)
                    .graphics_api(burn::tensor::wgpu::WgpuBackend::Vulkan)
                    .init()
                    .map_err(|e| format!("{e:?}"))
            })
            .clone()
    }
    #[cfg(not(feature = "wgpu"))]
    Err("built without the `wgpu` feature".into())
}

/// A GPU-kind Vulkan wgpu device (discrete, else integrated), or why there is none. Cached,
/// as [`wgpu_cpu_device`].
pub fn wgpu_gpu_device() -> Result<Device, String> {
    #[cfg(feature = "wgpu")]
    {
        use burn::tensor::DeviceKind;
        use std::sync::OnceLock;
        static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
        DEVICE
            .get_or_init(|| {
                let open = |kind| {
                    Device::wgpu_options()
                        .device_kind(kind)
                        .graphics_api(burn::tensor::wgpu::WgpuBackend::Vulkan)
                        .init()
                        .map_err(|e| format!("{e:?}"))
                };
                // wgpu's error lists every adapter: the first line of it says enough.
                open(DeviceKind::DiscreteGpu(0))
                    .or_else(|_| open(DeviceKind::IntegratedGpu(0)))
                    .map_err(|e| {
                        let e: String = e.chars().take(120).collect();
                        format!("no Vulkan GPU (no discrete or integrated adapter): {e}…")
                    })
            })
            .clone()
    }
    #[cfg(not(feature = "wgpu"))]
    Err("built without the `wgpu` feature".into())
}

/// CUDA device `ordinal`, or why there is none: `cuda::cuda_device` (feature `cuda`) in
/// every build, for code that compiles with and without the feature; without it, an error
/// saying so.
pub fn cuda_device(ordinal: usize) -> Result<Device, String> {
    #[cfg(feature = "cuda")]
    return crate::cuda::cuda_device(ordinal).map_err(|e| e.to_string());
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err("built without the `cuda` feature".into())
    }
}

/// What CubeCL's memory pools of one device hold, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolMemory {
    /// Held by live tensors (and CubeCL's own buffers), padding excluded.
    pub in_use: u64,
    /// Reserved from the device by the pools (they keep what they reserved).
    pub reserved: u64,
}

/// The memory of `device`'s CubeCL pools (every stream's), when it is a Cube device (CUDA,
/// wgpu); `None` elsewhere (Flex, whose tensors are host memory). Host-side bookkeeping: waits
/// for CubeCL's device thread, not for the GPU.
///
/// ```
/// use burn::tensor::Device;
/// assert_eq!(burn_megatron_kernels::device::pool_memory(&Device::flex()), None);
/// ```
pub fn pool_memory(device: &Device) -> Option<PoolMemory> {
    #[cfg(feature = "cube")]
    {
        let device = device.clone().inner();
        if let burn::backend::DispatchDevice::Cube(cube) = device.as_dispatch() {
            let scope = cubecl::MemoryScope::Device;
            let usage = cube.client().memory_report(scope).usage();
            return Some(PoolMemory {
                in_use: usage.bytes_in_use,
                reserved: usage.bytes_reserved,
            });
        }
    }
    let _ = device;
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    /// A live 4 MiB tensor shows in its Cube device's pools (other tests may hold more).
    #[test]
    fn pool_memory_counts_a_live_tensor_on_a_cube_device() {
        let device = match wgpu_cpu_device() {
            Ok(device) => device,
            Err(why) if !cfg!(feature = "wgpu") => return eprintln!("not run: {why}"),
            Err(why) => panic!("the wgpu feature is on but no device opened: {why}"),
        };
        let t = Tensor::<1>::zeros([1 << 20], &device);
        let held = pool_memory(&device).expect("a wgpu device is a Cube device");
        assert!(held.in_use >= 4 << 20, "{held:?}");
        assert!(held.reserved >= held.in_use, "{held:?}");
        drop(t);
    }
}
