//! `--device`: where the ranks of a `threads` or `mpi` run compute (under `nccl` each rank is
//! on its local GPU).

use burn::tensor::Device;

/// The device of every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TrainDevice {
    /// Burn's Flex CPU backend.
    #[default]
    Cpu,
    /// CUDA GPU 0, all ranks on it (build with `--features cuda`; the driver and NVRTC are
    /// loaded at run time).
    Cuda,
    /// A Vulkan GPU through wgpu (build with `--features wgpu`).
    Wgpu,
}

impl TrainDevice {
    /// The autodiff device, or why it cannot be had here (checked before any rank starts:
    /// a missing CUDA library is an error, not a panic inside the bindings).
    pub fn resolve(self) -> Result<Device, String> {
        use burn_megatron_kernels::device::{cuda_device, wgpu_gpu_device};
        let (name, device) = match self {
            TrainDevice::Cpu => ("cpu", Ok(Device::flex())),
            TrainDevice::Cuda => ("cuda", cuda_device(0)),
            TrainDevice::Wgpu => ("wgpu", wgpu_gpu_device()),
        };
        device
            .map(|d| d.autodiff())
            .map_err(|e| format!("--device {name}: {e}"))
    }
}
