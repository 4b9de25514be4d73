//! The decoder (Llama-style) ops against their references composed of Burn ops: forward
//! values and the gradient of every input through `.backward()` on the autodiff device, on
//! Flex (its native loops; f32 and bf16) and, with feature `wgpu`, the CubeCL kernels on
//! wgpu (lavapipe; built with the feature, a missing adapter fails them).

#[path = "../common/mod.rs"]
mod common;

mod rms_norm;
mod rotary;
mod swiglu;
