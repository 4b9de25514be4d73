//! Rotary position embedding (RoPE), rotate-half form, fused: for activations `x`
//! `[s, b, heads, hn]` and cos/sin tables `[s, b or 1, 1, rot]` (`rot` even, at most `hn`),
//!
//! `out[.., :rot] = x[.., :rot]·cos + rotate_half(x[.., :rot])·sin`, with
//! `rotate_half([x₁, x₂]) = [−x₂, x₁]` over the halves of the rotated channels, and
//! `out[.., rot:] = x[.., rot:]` (Megatron's `rotary_percent < 1`).
//!
//! The tables hold each frequency twice, `[f₀ … f_{rot/2−1}, f₀ … f_{rot/2−1}]`, as
//! burn-megatron's `RotaryTables` (and Megatron-Core, and transformers) build them. They are
//! constants: not differentiated, their autodiff graph (if any) cut.
//!
//! # Backward
//!
//! The op is linear in `x`; its gradient is the transpose,
//! `dx[.., :rot] = [d₁·cos₁ + d₂·sin₂, d₂·cos₂ − d₁·sin₁]` (the rotation by `−sin` when the
//! tables' halves are equal), the pass-through channels' gradient copied.
//!
//! # Implementations
//!
//! Flex: one pass per direction, in f32 for every float dtype (the tables rounded to the
//! activations' dtype first, as the reference casts them). Cube: one CubeCL kernel per
//! direction, the same arithmetic. Elsewhere, and as the ground truth: the reference
//! composed of Burn ops ([`reference_apply_rotary`]).

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;
mod reference;

pub use reference::{reference_apply_rotary, reference_apply_rotary_backward};

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// The rotary embedding as backend ops: native loops on Flex, a kernel on Cube backends.
/// Shapes are validated by [`apply_rotary`], not here.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait RotaryOps: Backend {
    /// `x` (`[s, b, heads, hn]`) with its first `rot` channels rotated by the tables
    /// (`[s, b or 1, 1, rot]`); see the module docs.
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// The gradient with respect to `x` from the output's gradient `grad`: the transposed
    /// rotation (see the module docs).
    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl RotaryOps for Flex {
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        flex::forward(x, cos, sin)
    }

    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        flex::backward(grad, cos, sin)
    }
}

/// The tables fit `x` (see [`apply_rotary`]'s errors).
fn check(x: &Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Result<(), KernelError> {
    let shape = |m: String| Err(KernelError::Shape(m));
    let ([s, b, _, hn], table) = (x.dims(), cos.dims());
    if sin.dims() != table {
        return shape(format!(
            "rotary cos {table:?} and sin {:?} tables differ in shape",
            sin.dims()
        ));
    }
    let [ts, tb, th, rot] = table;
    if ts != s || (tb != 1 && tb != b) || th != 1 {
        return shape(format!(
            "rotary tables {table:?} must be [s, b or 1, 1, rot] = [{s}, {b} or 1, 1, rot] for \
             activations {:?}",
            x.dims()
        ));
    }
    if rot == 0 || !rot.is_multiple_of(2) || rot > hn {
        return shape(format!(
            "rotary tables {table:?}: the rotated channels ({rot}) must be even, at least 2 and \
             at most the head dim of the activations {:?}",
            x.dims()
        ));
    }
    for (name, dtype) in [("x", x.dtype()), ("cos", cos.dtype()), ("sin", sin.dtype())] {
        if !dtype.is_float() {
            return Err(KernelError::Argument(format!(
                "rotary {name} must be a float tensor, got {dtype:?}"
            )));
        }
    }
    Ok(())
}

/// Rotary position embedding, rotate-half form, of `x` (`[s, b, heads, hn]`) with the
/// tables `cos` and `sin` (`[s, b or 1, 1, rot]`, each frequency twice, see the module
/// docs): the first `rot` channels of each head rotated, the others passed through.
/// Differentiable in `x` (the tables are constants); one pass per direction on Flex, one
/// kernel on Cube backends. The result has `x`'s dtype.
///
/// # Errors
///
/// [`KernelError::Shape`] when the tables differ in shape, are not `[s, b or 1, 1, rot]`
/// for `x`'s `s` and `b`, or `rot` is odd, 0 or above `hn`; [`KernelError::Argument`] when
/// a tensor is not float.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::apply_rotary;
/// let device = Device::flex();
/// // One position, one head of 4 channels, the first 2 rotated by 90°.
/// let x = Tensor::<4>::from_floats([[[[1.0, 2.0, 3.0, 4.0]]]], &device);
/// let cos = Tensor::<4>::from_floats([[[[0.0, 0.0]]]], &device);
/// let sin = Tensor::<4>::from_floats([[[[1.0, 1.0]]]], &device);
/// let y: Vec<f32> = apply_rotary(x, cos, sin).unwrap().into_data().to_vec().unwrap();
/// assert_eq!(y, [-2.0, 1.0, 3.0, 4.0]);
/// ```
pub fn apply_rotary(
    x: Tensor<4>,
    cos: Tensor<4>,
    sin: Tensor<4>,
) -> Result<Tensor<4>, KernelError> {
    check(&x, &cos, &sin)?;
    Ok(Tensor::from_dispatch(Dispatch::rotary(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
    )))
}
