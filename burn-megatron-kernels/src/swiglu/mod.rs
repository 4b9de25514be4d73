//! SwiGLU's activation, `silu(gate) · up` with `silu(g) = g·σ(g)` (Megatron's `--swiglu`,
//! Llama's MLP), with its handwritten backward
//! `d_gate = dy·up·σ(g)·(1 + g·(1 − σ(g)))`, `d_up = dy·silu(g)`, both in one pass.
//!
//! Computed in f32 whatever the dtype (f16/bf16 in, the same dtype out, rounded once).
//! Implementations: Flex's native loops (one pass forward, one pass backward for both
//! gradients); CubeCL kernels on Cube (one unit per element); the reference from Burn ops
//! everywhere else.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{FloatDType, Tensor};

/// SwiGLU's activation as backend ops. `gate`, `up` and `grad` have one shape; the results
/// have the dtypes of `gate` (forward, `d_gate`) and `up` (`d_up`). The methods do not
/// validate; [`swiglu`] does.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait SwigluOps: Backend {
    /// `silu(gate) · up`, computed in f32.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `(d_gate, d_up)` for the output gradient `grad`, computed in f32.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

fn widen<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_cast(t, FloatDType::F32)
}

/// `(σ(g), silu(g))` of f32 `g`.
fn sigmoid_and_silu<B: Backend>(g: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let s = B::sigmoid(g.clone());
    (s.clone(), B::float_mul(g, s))
}

/// The reference forward from Burn ops: `silu(gate) · up` in f32 (Burn's `sigmoid`), cast
/// to `gate`'s dtype.
pub fn reference_swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = gate.dtype();
    let (_, silu) = sigmoid_and_silu::<B>(widen::<B>(gate));
    B::float_cast(B::float_mul(silu, widen::<B>(up)), FloatDType::from(dtype))
}

/// The reference backward from Burn ops, in f32: `(grad·up·σ(g)·(1 + g·(1 − σ(g))),
/// grad·silu(g))`, cast to the dtypes of `gate` and `up`.
pub fn reference_swiglu_backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let (gate_dtype, up_dtype) = (gate.dtype(), up.dtype());
    let (g, u, dy) = (widen::<B>(gate), widen::<B>(up), widen::<B>(grad));
    let (s, silu) = sigmoid_and_silu::<B>(g.clone());
    let d_up = B::float_mul(dy.clone(), silu);
    let one_minus_s = B::float_add_scalar(B::float_neg(s.clone()), 1.0f32.into());
    let slope = B::float_add_scalar(B::float_mul(g, one_minus_s), 1.0f32.into());
    let d_gate = B::float_mul(B::float_mul(B::float_mul(dy, u), s), slope);
    (
        B::float_cast(d_gate, FloatDType::from(gate_dtype)),
        B::float_cast(d_up, FloatDType::from(up_dtype)),
    )
}

impl SwigluOps for Flex {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        flex::forward(gate, up)
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        flex::backward(gate, up, grad)
    }
}

/// `silu(gate) · up` (`silu(g) = g·σ(g)`): SwiGLU's activation, computed in f32 whatever
/// the dtype, differentiable with respect to both inputs through a handwritten backward
/// (one fused pass on Flex, one kernel on Cube). Errors when the shapes or dtypes differ.
///
/// ```
/// use burn::tensor::activation::silu;
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::swiglu;
/// let device = Device::flex();
/// let gate = Tensor::<2>::from_floats([[0.0, 1.0], [-2.0, 3.0]], &device);
/// let up = Tensor::<2>::from_floats([[1.0, 2.0], [0.5, -1.0]], &device);
/// let y = swiglu(gate.clone(), up.clone()).unwrap();
/// y.into_data()
///     .assert_approx_eq::<f32>(&(silu(gate) * up).into_data(), Default::default());
/// ```
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Result<Tensor<D>, KernelError> {
    if gate.dims() != up.dims() {
        return Err(KernelError::Shape(format!(
            "swiglu needs gate and up of one shape, got {:?} and {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    if gate.dtype() != up.dtype() || !gate.dtype().is_float() {
        return Err(KernelError::Argument(format!(
            "swiglu needs gate and up of one float dtype, got {:?} and {:?}",
            gate.dtype(),
            up.dtype()
        )));
    }
    Ok(Tensor::from_dispatch(Dispatch::swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    )))
}
