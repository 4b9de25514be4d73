//! Fused kernels for burn-megatron.
//!
//! Each op is a Burn backend extension with three implementations: a CubeCL kernel on the
//! Cube backend (feature `wgpu`; the same source serves CUDA), a reference composed of
//! Burn's own ops on every other backend (and as the tests' ground truth), and an autodiff
//! implementation whose backward is a handwritten derivative (a kernel too on Cube). Code
//! above this crate calls the same function on every backend.

mod bias_dropout_add;
mod bias_gelu;
#[cfg(feature = "wgpu")]
pub mod device;
mod error;
#[cfg(feature = "wgpu")]
mod launch;
mod ops;
mod softmax;

pub use bias_dropout_add::{
    BiasDropoutAddOps, bias_dropout_add, dropout_hash, dropout_keep, dropout_mask,
    dropout_threshold, reference_bias_dropout_add, reference_dropout,
};
pub use bias_gelu::{
    BiasGeluOps, Gelu, bias_gelu, reference_bias_gelu, reference_bias_gelu_backward,
};
pub use error::KernelError;
pub use softmax::{
    MASKED_SCORE, ScaledMaskedSoftmaxOps, reference_scaled_masked_softmax,
    reference_scaled_masked_softmax_backward, scaled_masked_softmax,
};
