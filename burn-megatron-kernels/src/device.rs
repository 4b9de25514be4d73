//! The wgpu device for kernel tests and benchmarks: Vulkan on the CPU adapter (Mesa's
//! lavapipe where no GPU is present), opened once per process.

use burn::tensor::Device;

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

/// CUDA device 0, or why there is none (built without the `cuda` feature, or no driver or
/// device).
pub fn cuda_device() -> Result<Device, String> {
    #[cfg(feature = "cuda")]
    return crate::cuda::cuda_device(0).map_err(|e| e.to_string());
    #[cfg(not(feature = "cuda"))]
    Err("built without the `cuda` feature".into())
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
