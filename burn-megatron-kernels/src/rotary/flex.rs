//! Flex's rotary embedding: one pass over the rows of `hn` channels, forward or backward,
//! in f32 whatever the activations' dtype (f16/bf16 values are widened, the result rounded
//! once). The tables are rounded to the activations' dtype first, as the reference (and
//! Megatron-Core, and transformers) cast them. Other dtypes go through the reference.

use super::reference::{reference_apply_rotary, reference_apply_rotary_backward};
use crate::cpu_elem::Elem;
use crate::cpu_rows::{RowFill, fill_rows};
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, bf16, f16};
use std::borrow::Cow;

/// `x·cos + rotate_half(x)·sin` over the first `rot` channels of each row (see the module
/// docs of `rotary`).
pub(super) fn forward(x: FlexTensor, cos: FlexTensor, sin: FlexTensor) -> FlexTensor {
    match native(&x, &cos, &sin, false) {
        Some(out) => out,
        None => reference_apply_rotary::<Flex>(x, cos, sin),
    }
}

/// The forward's transpose applied to `grad`.
pub(super) fn backward(grad: FlexTensor, cos: FlexTensor, sin: FlexTensor) -> FlexTensor {
    match native(&grad, &cos, &sin, true) {
        Some(out) => out,
        None => reference_apply_rotary_backward::<Flex>(grad, cos, sin),
    }
}

fn native(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor, back: bool) -> Option<FlexTensor> {
    match x.dtype() {
        DType::F32 => typed::<f32>(x, cos, sin, back),
        DType::BF16 => typed::<bf16>(x, cos, sin, back),
        DType::F16 => typed::<f16>(x, cos, sin, back),
        _ => None,
    }
}

/// A table's values as f32, rounded to `E` (a borrow when both are f32).
fn table<E: Elem>(t: &FlexTensor, x_is_f32: bool) -> Option<Cow<'_, [f32]>> {
    let widened: Cow<'_, [f32]> = match t.dtype() {
        DType::F32 => <f32 as Elem>::values(t)?,
        DType::BF16 => bf16::values(t)?.iter().map(|v| v.to_f32()).collect(),
        DType::F16 => f16::values(t)?.iter().map(|v| v.to_f32()).collect(),
        _ => return None,
    };
    Some(if x_is_f32 {
        widened
    } else {
        widened.iter().map(|&v| E::round(v)).collect()
    })
}

fn typed<E: Elem>(
    x: &FlexTensor,
    cos: &FlexTensor,
    sin: &FlexTensor,
    backward: bool,
) -> Option<FlexTensor> {
    let x_is_f32 = x.dtype() == DType::F32;
    let (values, cos_v, sin_v) = (
        E::values(x)?,
        table::<E>(cos, x_is_f32)?,
        table::<E>(sin, x_is_f32)?,
    );
    let [s, b, heads, hn] = x.shape().dims::<4>();
    let [_, table_batch, _, rot] = cos.shape().dims::<4>();
    let op = Rotate {
        x: &values,
        cos: &cos_v,
        sin: &sin_v,
        b,
        per_sample: table_batch != 1,
        heads,
        hn,
        rot,
        backward,
    };
    let out = fill_rows(s * b * heads, hn, &op);
    Some(E::tensor(out, &[s, b, heads, hn]))
}

struct Rotate<'a, E> {
    /// `[s, b, heads, hn]`, row-major.
    x: &'a [E],
    /// `[s, b or 1, rot]`.
    cos: &'a [f32],
    sin: &'a [f32],
    b: usize,
    /// The tables have a row per sample (else one per position, shared by the batch).
    per_sample: bool,
    heads: usize,
    hn: usize,
    rot: usize,
    /// The transpose: `[d₁·c₁ + d₂·s₂, d₂·c₂ − d₁·s₁]`, not `[x₁·c₁ − x₂·s₁, x₂·c₂ + x₁·s₂]`.
    backward: bool,
}

impl<E: Elem> RowFill<E> for Rotate<'_, E> {
    #[inline(always)]
    fn row(&self, i: usize, out: &mut [E], _: &mut Vec<f32>) {
        let (pos, sample) = (i / self.heads / self.b, i / self.heads % self.b);
        let t = if self.per_sample {
            pos * self.b + sample
        } else {
            pos
        } * self.rot;
        let (rot, half) = (self.rot, self.rot / 2);
        let (c1, c2) = self.cos[t..t + rot].split_at(half);
        let (s1, s2) = self.sin[t..t + rot].split_at(half);
        let x = &self.x[i * self.hn..(i + 1) * self.hn];
        let (x1, x2) = x[..rot].split_at(half);
        let (o1, rest) = out.split_at_mut(half);
        let (o2, o3) = rest.split_at_mut(half);
        let lanes = o1.iter_mut().zip(o2.iter_mut()).zip(x1.iter().zip(x2));
        let tables = c1.iter().zip(c2).zip(s1.iter().zip(s2));
        if self.backward {
            for (((o1, o2), (&a, &b)), ((&c1, &c2), (&s1, &s2))) in lanes.zip(tables) {
                let (a, b) = (a.to_f32(), b.to_f32());
                *o1 = E::from_f32(a * c1 + b * s2);
                *o2 = E::from_f32(b * c2 - a * s1);
            }
        } else {
            for (((o1, o2), (&a, &b)), ((&c1, &c2), (&s1, &s2))) in lanes.zip(tables) {
                let (a, b) = (a.to_f32(), b.to_f32());
                *o1 = E::from_f32(a * c1 - b * s1);
                *o2 = E::from_f32(b * c2 + a * s2);
            }
        }
        o3.copy_from_slice(&x[rot..]);
    }
}
