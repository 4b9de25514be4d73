//! Flex's SwiGLU: one pass over the elements forward, one backward for both gradients (the
//! reference walks and allocates the tensors five and eleven times), on f32, f16 or bf16
//! values widened to f32, chunks split over rayon's threads, each compiled for the CPU's
//! SIMD level, with a sigmoid built on [`crate::cpu::exp`] so that the loops vectorise.
//! Mixed or other dtypes go through the reference.

use super::{reference_swiglu, reference_swiglu_backward};
use crate::cpu::exp;
use crate::cpu_elem::Elem;
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, bf16, f16};
use rayon::prelude::*;

/// Elements per rayon task: below this, splitting costs more than it saves.
const CHUNK: usize = 1 << 14;

/// `σ(x)` in its stable form, `1 / (1 + e^-x)` for `x ≥ 0` and `e^x / (1 + e^x)` below,
/// without branches (both from `e^-|x|`). NaN stays NaN.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    let inv = 1.0 / (1.0 + e);
    if x >= 0.0 { inv } else { e * inv }
}

pub(super) fn forward(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
    let native = match (gate.dtype(), up.dtype()) {
        (DType::F32, DType::F32) => forward_as::<f32>(&gate, &up),
        (DType::BF16, DType::BF16) => forward_as::<bf16>(&gate, &up),
        (DType::F16, DType::F16) => forward_as::<f16>(&gate, &up),
        _ => None,
    };
    native.unwrap_or_else(|| reference_swiglu::<Flex>(gate, up))
}

pub(super) fn backward(
    gate: FlexTensor,
    up: FlexTensor,
    grad: FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let native = match (gate.dtype(), up.dtype(), grad.dtype()) {
        (DType::F32, DType::F32, DType::F32) => backward_as::<f32>(&gate, &up, &grad),
        (DType::BF16, DType::BF16, DType::BF16) => backward_as::<bf16>(&gate, &up, &grad),
        (DType::F16, DType::F16, DType::F16) => backward_as::<f16>(&gate, &up, &grad),
        _ => None,
    };
    native.unwrap_or_else(|| reference_swiglu_backward::<Flex>(gate, up, grad))
}

fn forward_as<E: Elem>(gate: &FlexTensor, up: &FlexTensor) -> Option<FlexTensor> {
    let (g, u) = (E::values(gate)?, E::values(up)?);
    if g.len() != u.len() {
        return None;
    }
    let mut out = vec![E::from_f32(0.0); g.len()];
    out.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(u.par_chunks(CHUNK))
        .for_each(|((out, gate), up)| pulp::Arch::new().dispatch(Forward { gate, up, out }));
    Some(E::tensor(out, &gate.shape()))
}

fn backward_as<E: Elem>(
    gate: &FlexTensor,
    up: &FlexTensor,
    grad: &FlexTensor,
) -> Option<(FlexTensor, FlexTensor)> {
    let (g, u, dy) = (E::values(gate)?, E::values(up)?, E::values(grad)?);
    if g.len() != u.len() || g.len() != dy.len() {
        return None;
    }
    let mut d_gate = vec![E::from_f32(0.0); g.len()];
    let mut d_up = vec![E::from_f32(0.0); g.len()];
    d_gate
        .par_chunks_mut(CHUNK)
        .zip(d_up.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .zip(u.par_chunks(CHUNK))
        .zip(dy.par_chunks(CHUNK))
        .for_each(|((((d_gate, d_up), gate), up), dy)| {
            pulp::Arch::new().dispatch(Backward {
                gate,
                up,
                dy,
                d_gate,
                d_up,
            })
        });
    let shape = gate.shape();
    Some((E::tensor(d_gate, &shape), E::tensor(d_up, &shape)))
}

struct Forward<'a, E> {
    gate: &'a [E],
    up: &'a [E],
    out: &'a mut [E],
}

impl<E: Elem> pulp::WithSimd for Forward<'_, E> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for ((out, &g), &u) in self.out.iter_mut().zip(self.gate).zip(self.up) {
            let g = g.to_f32();
            *out = E::from_f32(g * sigmoid(g) * u.to_f32());
        }
    }
}

struct Backward<'a, E> {
    gate: &'a [E],
    up: &'a [E],
    dy: &'a [E],
    d_gate: &'a mut [E],
    d_up: &'a mut [E],
}

impl<E: Elem> pulp::WithSimd for Backward<'_, E> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let outs = self.d_gate.iter_mut().zip(self.d_up.iter_mut());
        let ins = self.gate.iter().zip(self.up).zip(self.dy);
        for ((d_gate, d_up), ((&g, &u), &dy)) in outs.zip(ins) {
            let (g, u, dy) = (g.to_f32(), u.to_f32(), dy.to_f32());
            let s = sigmoid(g);
            *d_up = E::from_f32(dy * (g * s));
            *d_gate = E::from_f32(dy * u * s * (1.0 + g * (1.0 - s)));
        }
    }
}
