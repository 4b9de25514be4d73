//! The wgpu device for kernel tests and benchmarks: Vulkan on the CPU adapter (Mesa's
//! lavapipe where no GPU is present), opened once per process.

use burn::tensor::{Device, DeviceKind};
use std::sync::OnceLock;

/// The CPU-kind Vulkan wgpu device, or why there is none (no Vulkan driver). Opening a
/// wgpu device twice fails, so the result is cached.
pub fn wgpu_cpu_device() -> Result<Device, String> {
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
