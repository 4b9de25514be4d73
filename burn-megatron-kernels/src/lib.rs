//! Fused kernels for burn-megatron.
//!
//! Each op is a Burn backend extension with three implementations: a CubeCL kernel on the
//! Cube backend (feature `wgpu`; the same source serves CUDA), a reference composed of
//! Burn's own ops on every other backend (and as the tests' ground truth), and an autodiff
//! implementation whose backward is a handwritten derivative (a kernel too on Cube). Code
//! above this crate calls the same function on every backend.

mod adam;
mod bias_gelu;
mod cast;
#[cfg(feature = "wgpu")]
mod cube_sum;
#[cfg(feature = "wgpu")]
pub mod device;
mod error;
#[cfg(feature = "wgpu")]
mod launch;
mod norm;
mod ops;

pub use adam::{
    AdamHyper, FlatAdamState, FusedAdamOps, WeightDecay, fused_adam_step, reference_adam_step,
};
pub use bias_gelu::{
    BiasGeluOps, Gelu, bias_gelu, reference_bias_gelu, reference_bias_gelu_backward,
};
pub use cast::{
    MasterCastOps, master_to_model, master_to_model_segments, reference_master_cast, round_to,
};
pub use error::KernelError;
pub use norm::{
    SumOfSquaresOps, multi_tensor_sum_of_squares, reference_segment_sum_of_squares,
    segment_sum_of_squares,
};
