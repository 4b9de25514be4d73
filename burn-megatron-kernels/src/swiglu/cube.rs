//! The SwiGLU CubeCL kernels, for Burn's Cube backend (wgpu here; the same source serves
//! CUDA): one unit per element, computing in f32 whatever the dtype.

use super::{SwigluOps, reference_swiglu, reference_swiglu_backward};
use crate::launch::{elementwise_launch, empty_like};
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

/// `σ(x)` in its stable form (both branches from `e^-|x|`).
#[cube]
fn sigmoid(x: f32) -> f32 {
    let e = f32::exp(-f32::abs(x));
    let inv = 1.0 / (1.0 + e);
    select(x >= 0.0, inv, e * inv)
}

#[cube(launch)]
fn swiglu_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let g = f32::cast_from(gate[pos]);
    out[pos] = F::cast_from(g * sigmoid(g) * f32::cast_from(up[pos]));
}

#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    dy: &Tensor<F>,
    d_gate: &mut Tensor<F>,
    d_up: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= d_gate.len() {
        terminate!();
    }
    let g = f32::cast_from(gate[pos]);
    let u = f32::cast_from(up[pos]);
    let dy = f32::cast_from(dy[pos]);
    let s = sigmoid(g);
    d_up[pos] = F::cast_from(dy * (g * s));
    d_gate[pos] = F::cast_from(dy * u * s * (1.0 + g * (1.0 - s)));
}

impl SwigluOps for CubeBackend {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if gate.dtype != up.dtype {
            return reference_swiglu::<Self>(gate, up);
        }
        let (gate, up) = (into_contiguous(gate), into_contiguous(up));
        let (out, Some((cube_dim, count))) = elementwise_launch(&gate) else {
            return gate; // empty: nothing to compute, the input has the output's shape
        };
        let dtype = dtype_to_storage_type(gate.dtype);
        swiglu_kernel::launch(
            &gate.client.clone(),
            count,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dtype,
        );
        out
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if gate.dtype != up.dtype || gate.dtype != grad.dtype {
            return reference_swiglu_backward::<Self>(gate, up, grad);
        }
        let (gate, up, dy) = (
            into_contiguous(gate),
            into_contiguous(up),
            into_contiguous(grad),
        );
        let (d_gate, Some((cube_dim, count))) = elementwise_launch(&gate) else {
            return (gate, up); // empty: the inputs have the gradients' shapes
        };
        let d_up = empty_like(&gate, d_gate.shape(), gate.dtype);
        let dtype = dtype_to_storage_type(gate.dtype);
        swiglu_backward_kernel::launch(
            &gate.client.clone(),
            count,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            dy.into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
            dtype,
        );
        (d_gate, d_up)
    }
}
