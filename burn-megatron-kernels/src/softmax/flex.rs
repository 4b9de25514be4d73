//! Flex's scaled masked softmax: one pass per row and direction, in f32 whatever the scores'
//! dtype (f16/bf16 widened, results rounded once), masks computed from the row index (no
//! mask tensor is built), rows over rayon's threads, a vectorised `exp`. The reference
//! builds the causal mask on the host, expands it, fills, then runs Burn's softmax: five
//! passes over `[b, heads, sq, sk]` forward, six backward.
//!
//! A row's causally masked keys are its tail `j ≥ lim`: they all score −10000, so their
//! exponential is one number, computed once.
//!
//! The `exp` is evaluated in f64 and rounded once, so that it is `expf`'s correctly rounded
//! value nearly always (and the forward the reference's, bit for bit, in all but a few
//! rows): the f32 polynomial of `crate::cpu::exp` (2 ulp) made the GPT pipeline parity test
//! (weights after six AdamW steps at TP 2 × PP 2 × VP 2, one rank as the reference) drift
//! past its 1e-5 tolerance, 1.7e-5 against 5.9e-6 with `expf`.

use super::{
    MASKED_SCORE, reference_scaled_masked_softmax, reference_scaled_masked_softmax_backward,
};
use crate::cpu::{lane_fold, lane_sum};
use crate::cpu_elem::Elem;
use crate::cpu_rows::{RowFill, fill_rows};
use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::tensor::{BoolStore, DType, bf16, f16};

/// `e^x` rounded to f32 from an f64 evaluation (relative error ~1e-13 before the rounding):
/// the correctly rounded value but where `e^x` lies within ~1e-13 of a rounding boundary,
/// as libm's `expf` (which Flex's softmax, the reference, calls) gives it, without branches
/// or calls so that loops of it vectorise. `n = round(x·log2 e)`, `r = x − n·ln 2`
/// (|r| ≤ ln2/2), Taylor to `r¹⁰`, `2ⁿ` built in the exponent bits. Underflows to
/// denormals and 0 and overflows to ∞ as `expf`; NaN stays NaN.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 · 2⁵²: adding it rounds to an integer
    let c = f64::from(x).clamp(-104.0, 89.0);
    let t = c * std::f64::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = c - n * std::f64::consts::LN_2;
    // 1/k! for k = 10 down to 2, by Horner.
    let mut p = 1.0 / 3_628_800.0;
    for f in [362_880.0, 40_320.0, 5_040.0, 720.0, 120.0, 24.0, 6.0, 2.0] {
        p = p * r + 1.0 / f;
    }
    let p = (p * r + 1.0) * r + 1.0;
    // t's low mantissa bits hold n (|n| ≤ 151 < 2⁵¹).
    let k = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f64::from_bits(k.wrapping_add(1023) << 52);
    let y = (p * scale) as f32;
    if x.is_nan() { x } else { y }
}

/// Which keys of a row are masked.
struct Masks<'a> {
    /// The `[b, sk]` key padding (nonzero = padded), when there is one.
    pad: Option<&'a [u8]>,
    causal: bool,
    heads: usize,
    sq: usize,
    sk: usize,
}

impl Masks<'_> {
    /// Row `i`'s key padding, and `lim`: keys from `lim` on are causally masked (`sk` when
    /// not causal). Key `j` of query `q` is masked when `j > q + sk − sq`.
    #[inline(always)]
    fn of_row(&self, i: usize) -> (Option<&[u8]>, usize) {
        let sk = self.sk;
        let lim = if self.causal {
            (i % self.sq + sk + 1).saturating_sub(self.sq)
        } else {
            sk
        };
        let batch = i / (self.heads * self.sq);
        (self.pad.map(|p| &p[batch * sk..(batch + 1) * sk]), lim)
    }
}

/// `t`'s values as bytes (nonzero = true) when Flex stores the bools as bytes.
fn bool_bytes(t: &FlexTensor) -> Option<FlexTensor> {
    matches!(t.dtype(), DType::Bool(BoolStore::Native | BoolStore::U8)).then(|| t.to_contiguous())
}

/// The forward, or the reference's where the loops do not read the dtype or mask storage.
pub(super) fn forward(
    scores: FlexTensor,
    key_padding: FlexTensor,
    padded: bool,
    scale: f32,
    causal: bool,
) -> FlexTensor {
    let pad = padded.then(|| bool_bytes(&key_padding));
    let native = match pad {
        Some(None) => None,
        Some(Some(ref p)) => native_forward(&scores, Some(p.storage::<u8>()), scale, causal),
        None => native_forward(&scores, None, scale, causal),
    };
    native.unwrap_or_else(|| {
        reference_scaled_masked_softmax::<Flex>(scores, key_padding, padded, scale, causal)
    })
}

/// The backward from the forward's output, or the reference's where the loops do not read
/// the dtypes or mask storage.
pub(super) fn backward(
    output: FlexTensor,
    grad: FlexTensor,
    key_padding: FlexTensor,
    padded: bool,
    scale: f32,
    causal: bool,
) -> FlexTensor {
    let pad = padded.then(|| bool_bytes(&key_padding));
    let native = match pad {
        Some(None) => None,
        Some(Some(ref p)) => {
            native_backward(&output, &grad, Some(p.storage::<u8>()), scale, causal)
        }
        None => native_backward(&output, &grad, None, scale, causal),
    };
    native.unwrap_or_else(|| {
        reference_scaled_masked_softmax_backward::<Flex>(
            output,
            grad,
            key_padding,
            padded,
            scale,
            causal,
        )
    })
}

fn masks<'a>(like: &FlexTensor, pad: Option<&'a [u8]>, causal: bool) -> (Masks<'a>, [usize; 4]) {
    let dims = like.shape().dims::<4>();
    let [_, heads, sq, sk] = dims;
    let masks = Masks {
        pad,
        causal,
        heads,
        sq,
        sk,
    };
    (masks, dims)
}

fn native_forward(
    scores: &FlexTensor,
    pad: Option<&[u8]>,
    scale: f32,
    causal: bool,
) -> Option<FlexTensor> {
    fn typed<E: Elem>(
        s: &FlexTensor,
        m: Masks<'_>,
        scale: f32,
        dims: [usize; 4],
    ) -> Option<FlexTensor> {
        let x = E::values(s)?;
        let rows = dims[..3].iter().product();
        let out = fill_rows(rows, m.sk, &Forward { x: &x, m, scale });
        Some(E::tensor(out, &dims))
    }
    let (m, dims) = masks(scores, pad, causal);
    match scores.dtype() {
        DType::F32 => typed::<f32>(scores, m, scale, dims),
        DType::BF16 => typed::<bf16>(scores, m, scale, dims),
        DType::F16 => typed::<f16>(scores, m, scale, dims),
        _ => None,
    }
}

fn native_backward(
    output: &FlexTensor,
    grad: &FlexTensor,
    pad: Option<&[u8]>,
    scale: f32,
    causal: bool,
) -> Option<FlexTensor> {
    fn typed<E: Elem>(
        y: &FlexTensor,
        g: &FlexTensor,
        m: Masks<'_>,
        scale: f32,
        dims: [usize; 4],
    ) -> Option<FlexTensor> {
        let (y, g) = (E::values(y)?, E::values(g)?);
        let rows = dims[..3].iter().product();
        let out = fill_rows(
            rows,
            m.sk,
            &Backward {
                y: &y,
                g: &g,
                m,
                scale,
            },
        );
        Some(E::tensor(out, &dims))
    }
    if grad.dtype() != output.dtype() {
        return None;
    }
    let (m, dims) = masks(output, pad, causal);
    match output.dtype() {
        DType::F32 => typed::<f32>(output, grad, m, scale, dims),
        DType::BF16 => typed::<bf16>(output, grad, m, scale, dims),
        DType::F16 => typed::<f16>(output, grad, m, scale, dims),
        _ => None,
    }
}

struct Forward<'a, E> {
    x: &'a [E],
    m: Masks<'a>,
    scale: f32,
}

impl<E: Elem> RowFill<E> for Forward<'_, E> {
    #[inline(always)]
    fn row(&self, i: usize, out: &mut [E], v: &mut Vec<f32>) {
        let sk = self.m.sk;
        let (pad, lim) = self.m.of_row(i);
        let x = &self.x[i * sk..i * sk + lim];
        // The scaled scores of the keys before the causal cut, padded ones filled.
        v.clear();
        v.extend(x.iter().map(|&x| x.to_f32() * self.scale));
        if let Some(pad) = pad {
            for (v, &p) in v.iter_mut().zip(pad) {
                *v = if p != 0 { MASKED_SCORE } else { *v };
            }
        }
        let tail = sk - lim;
        let mut max = lane_fold(v, f32::NEG_INFINITY, f32::max, f32::max);
        if tail > 0 {
            max = max.max(MASKED_SCORE);
        }
        for e in v.iter_mut() {
            *e = exp(*e - max);
        }
        let tail_exp = exp(MASKED_SCORE - max);
        let sum = lane_sum(v, |e| e) + tail as f32 * tail_exp;
        let inv = 1.0 / sum;
        let (head, rest) = out.split_at_mut(lim);
        for (o, &e) in head.iter_mut().zip(v.iter()) {
            *o = E::from_f32(e * inv);
        }
        rest.fill(E::from_f32(tail_exp * inv));
    }
}

struct Backward<'a, E> {
    y: &'a [E],
    g: &'a [E],
    m: Masks<'a>,
    scale: f32,
}

/// `Σ aᵢ·bᵢ` widened to f32, in 16 lanes (so that it vectorises), then the tail.
#[inline(always)]
fn lane_dot<E: Elem>(a: &[E], b: &[E]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail = ca.remainder().iter().zip(cb.remainder());
    for (a, b) in ca.zip(cb) {
        for ((s, &a), &b) in acc.iter_mut().zip(a).zip(b) {
            *s += a.to_f32() * b.to_f32();
        }
    }
    let joined = acc.iter().fold(0.0, |s, &v| s + v);
    tail.fold(joined, |s, (&a, &b)| s + a.to_f32() * b.to_f32())
}

impl<E: Elem> RowFill<E> for Backward<'_, E> {
    #[inline(always)]
    fn row(&self, i: usize, out: &mut [E], _: &mut Vec<f32>) {
        let sk = self.m.sk;
        let (pad, lim) = self.m.of_row(i);
        let (y, g) = (&self.y[i * sk..(i + 1) * sk], &self.g[i * sk..(i + 1) * sk]);
        // Over the whole row: masked keys' probabilities count (they need not be 0).
        let dot = lane_dot(y, g);
        let (head, rest) = out.split_at_mut(lim);
        for ((o, &y), &g) in head.iter_mut().zip(y).zip(g) {
            *o = E::from_f32(y.to_f32() * (g.to_f32() - dot) * self.scale);
        }
        if let Some(pad) = pad {
            for (o, &p) in head.iter_mut().zip(pad) {
                *o = if p != 0 { E::from_f32(0.0) } else { *o };
            }
        }
        rest.fill(E::from_f32(0.0));
    }
}

#[cfg(test)]
mod tests;
