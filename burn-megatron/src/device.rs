//! The devices a rank computes on, in every build: without the feature a device needs, its
//! constructor says so in its error rather than failing to compile (the CUDA errors as types
//! are `cuda`'s, feature `cuda`).
//!
//! ```
//! // Rank r on CUDA device r; without a GPU (or the `cuda` feature), an error naming why.
//! let device = burn_megatron::device::cuda_device(0);
//! # let _ = device;
//! ```

pub use burn_megatron_kernels::device::{
    PoolMemory, cuda_device, pool_memory, wgpu_cpu_device, wgpu_gpu_device,
};
