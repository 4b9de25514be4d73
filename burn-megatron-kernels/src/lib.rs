//! Fused kernels for burn-megatron.
//!
//! Each op is a Burn backend extension with three implementations: a CubeCL kernel on the
//! Cube backend (feature `wgpu`; the same source serves CUDA), a reference composed of
//! Burn's own ops on every other backend (and as the tests' ground truth), and an autodiff
//! implementation whose backward is a handwritten derivative (a kernel too on Cube). Code
//! above this crate calls the same function on every backend.
//!
//! Features: `wgpu` or `cuda` turn on the Cube backend and the kernels (`cube`); without
//! them every backend runs the references.

mod adam;
mod attention;
mod bias_dropout_add;
mod bias_gelu;
mod cast;
#[cfg(feature = "cube")]
mod column_sum;
mod cpu;
mod cpu_elem;
mod cpu_rows;
mod cross_entropy;
#[cfg(feature = "cube")]
mod cube_sum;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod error;
mod grad_accum;
#[cfg(test)]
mod kernel_names;
#[cfg(feature = "cube")]
mod launch;
mod layer_norm;
mod linear;
mod norm;
mod ops;
mod rms_norm;
mod rotary;
mod softmax;
mod swiglu;

pub use adam::{
    AdamHyper, FlatAdamState, FusedAdamOps, WeightDecay, fused_adam_step,
    multi_tensor_fused_adam_step, reference_adam_step,
};
pub use attention::{
    AttentionParams, ChunkedAttentionOps, FLASH_MAX_HEAD_DIM, FLASH_QUERY_BLOCK, FLASH_VAR,
    FlashAttentionOps, FlashKernels, FlashKernelsGuard, FlashLaunches, chunked_attention,
    flash_attention, flash_attention_backward, flash_attention_with_lse, flash_kernels,
    flash_kernels_on_this_thread, flash_launches, set_flash_kernels, thread_flash_launches,
};
#[cfg(feature = "cuda")]
pub use attention::{FlashSource, NvrtcReport, flash_cuda_sources, nvrtc_compile_sm90};
pub use bias_dropout_add::{
    BiasDropoutAddOps, MaskWindow, bias_dropout_add, dropout, dropout_hash, dropout_keep,
    dropout_mask, dropout_threshold, reference_bias_dropout_add, reference_dropout,
};
pub use bias_gelu::{
    BiasGeluOps, Gelu, bias_gelu, reference_bias_gelu, reference_bias_gelu_backward,
};
pub use cast::{
    MasterCastOps, master_to_model, master_to_model_segments, reference_master_cast, round_to,
};
pub use cross_entropy::{
    CrossEntropyOps, LabelSmoothing, cross_entropy_backward, cross_entropy_row_stats,
    reference_cross_entropy_backward, reference_cross_entropy_row_stats,
};
pub use error::KernelError;
pub use grad_accum::{
    GradAccumOps, accumulate_weight_grad, linear_with_grad_accumulation,
    reference_accumulate_weight_grad,
};
pub use layer_norm::{
    LayerNormOps, layer_norm, reference_layer_norm_backward, reference_layer_norm_forward,
};
pub use linear::{LinearOps, batched_matmul, linear};
pub use norm::{
    SumOfSquaresOps, multi_tensor_sum_of_squares, reference_segment_sum_of_squares,
    segment_sum_of_squares,
};
pub use rms_norm::{RmsNormOps, reference_rms_norm_backward, reference_rms_norm_forward, rms_norm};
pub use rotary::{
    RotaryOps, apply_rotary, reference_apply_rotary, reference_apply_rotary_backward,
};
pub use softmax::{
    MASKED_SCORE, ScaledMaskedSoftmaxOps, reference_scaled_masked_softmax,
    reference_scaled_masked_softmax_backward, scaled_masked_softmax,
};
pub use swiglu::{SwigluOps, reference_swiglu, reference_swiglu_backward, swiglu};
