//! Fused kernels for burn-megatron (work in progress).
