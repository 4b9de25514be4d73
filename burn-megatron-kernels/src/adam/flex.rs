//! Flex's fused Adam: one pass over a range of the flat buffers, updated in place when
//! nothing else holds them, chunks over rayon's threads, each compiled for the CPU's SIMD level. The
//! same operations in the same order as the reference (burn-optim's), so the same bits.

use super::{AdamHyper, AdamScalars, ranged, reference_adam_step};
use crate::cpu::{f32_tensor, f32_values};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, FloatDType};
use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 15;

/// `t` (f32) as a tensor whose storage is exactly its elements in order and held by it
/// alone, so that it can be written in place: `t` itself when it already is, else a copy.
fn owned(t: FlexTensor) -> FlexTensor {
    let n = t.shape().num_elements();
    let whole = t.layout().contiguous_offsets() == Some((0, n)) && t.storage::<f32>().len() == n;
    if whole && t.is_unique() {
        return t;
    }
    let values = f32_values(&t).map(|v| v.into_owned()).unwrap_or_default();
    f32_tensor(values, &[n])
}

pub(super) fn fused_adam(
    param: FlexTensor,
    exp_avg: FlexTensor,
    exp_avg_sq: FlexTensor,
    grad: FlexTensor,
    hyper: AdamHyper,
    offset: usize,
) -> (FlexTensor, FlexTensor, FlexTensor, FlexTensor) {
    let (n, len) = (param.shape().num_elements(), grad.shape().num_elements());
    let f32_state = [&param, &exp_avg, &exp_avg_sq]
        .iter()
        .all(|t| t.dtype() == DType::F32);
    let sizes = [&exp_avg, &exp_avg_sq]
        .iter()
        .all(|t| t.shape().num_elements() == n);
    if !f32_state || !sizes || offset + len > n {
        let state = [param, exp_avg, exp_avg_sq];
        return ranged::<Flex>(state, grad, offset, |p, m, v, g| {
            reference_adam_step::<Flex>(p, m, v, g, &hyper)
        });
    }
    let grad = match grad.dtype() {
        DType::F32 => grad,
        _ => Flex::float_cast(grad, FloatDType::F32),
    };
    let shape = param.shape();
    let (mut p, mut m, mut v) = (owned(param), owned(exp_avg), owned(exp_avg_sq));
    let Some(g) = f32_values(&grad) else {
        unreachable!("cast to f32 above")
    };
    let s = hyper.scalars();
    let range = offset..offset + len;
    let bad: usize = p.storage_mut::<f32>()[range.clone()]
        .par_chunks_mut(CHUNK)
        .zip(m.storage_mut::<f32>()[range.clone()].par_chunks_mut(CHUNK))
        .zip(v.storage_mut::<f32>()[range].par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .map(|(((p, m), v), g)| pulp::Arch::new().dispatch(Chunk { s, p, m, v, g }))
        .sum();
    let reshape = |t: FlexTensor| t.reshape(shape.clone());
    (
        reshape(p),
        reshape(m),
        reshape(v),
        f32_tensor(vec![bad as f32], &[1]),
    )
}

struct Chunk<'a> {
    s: AdamScalars,
    p: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    g: &'a [f32],
}

impl pulp::WithSimd for Chunk<'_> {
    type Output = usize;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> usize {
        let s = self.s;
        let mut bad = 0usize;
        let elements = self
            .p
            .iter_mut()
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut());
        for (((p, m), v), &g) in elements.zip(self.g) {
            // burn-optim's order; multiplying by an exact 1 changes no bit.
            let unscaled = g * s.inv_scale * s.clip;
            // An all-ones exponent is inf or NaN.
            bad += usize::from(unscaled.to_bits() & 0x7f80_0000 == 0x7f80_0000);
            let g = match s.l2 {
                Some(w) => *p * w + unscaled,
                None => unscaled,
            };
            let m_new = *m * s.beta1 + g * s.one_minus_beta1;
            let v_new = *v * s.beta2 + g * g * s.one_minus_beta2;
            let update = if s.l2.is_some() {
                (m_new * s.adam_factor) / (v_new.sqrt() + s.adam_eps)
            } else {
                (m_new / s.correction1) / ((v_new / s.correction2).sqrt() + s.eps)
            };
            *p = *p * s.keep - update * s.lr;
            *m = m_new;
            *v = v_new;
        }
        bad
    }
}
