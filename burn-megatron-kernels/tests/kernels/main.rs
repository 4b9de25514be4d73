//! Every fused kernel against its reference, in one test binary (each binary links Burn):
//! on Flex (the native reference paths) and, with a Cube feature, the CubeCL kernels on the
//! device `KERNEL_TEST_DEVICE` names (see [`common::cube_device`]): lavapipe in CI, a GPU
//! under `scripts/gpu_check.sh`. Tests on the Cube device end in `_on_cube`.

mod common;

mod adam;
mod attention;
mod bias_dropout_add;
mod bias_gelu;
mod cast;
mod cross_entropy;
mod dropout;
mod flash;
mod gemm;
mod grad_accum;
mod layer_norm;
mod linear;
mod linear_grad_accum;
mod norm;
mod rms_norm;
mod rotary;
mod softmax;
mod swiglu;
