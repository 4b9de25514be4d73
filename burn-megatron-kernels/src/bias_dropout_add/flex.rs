//! Flex's dropout and bias + dropout + residual add on f32: one parallel pass that hashes
//! each flat index and writes the output (the reference builds the mask on the host in one
//! thread, uploads it, and walks the tensor three or four more times). The same arithmetic
//! in the same order as the reference, so the results are bit for bit the reference's;
//! other dtypes go through it.

use super::{
    MaskWindow, dropout_keys, hash_with_keys, keep_scale, reference_bias_dropout_add,
    reference_dropout,
};
use crate::cpu::f32_values;
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

fn f32_out(values: Vec<f32>, t: &FlexTensor) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, t.shape().to_vec()))
}

pub(super) fn dropout(v: FlexTensor, prob: f32, seed: u64, window: MaskWindow) -> FlexTensor {
    if prob == 0.0 || v.dtype() != DType::F32 {
        return reference_dropout::<Flex>(v, prob, seed, window);
    }
    let Some(x) = f32_values(&v) else {
        return reference_dropout::<Flex>(v, prob, seed, window);
    };
    let (keys, threshold, scale) = (
        dropout_keys(seed),
        super::dropout_threshold(prob),
        keep_scale(prob),
    );
    // A window's rows are runs of consecutive mask indices: one SIMD pass per run.
    let run = if window.is_whole() {
        CHUNK
    } else {
        window.cols.max(1)
    };
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(run)
        .zip(x.par_chunks(run))
        .enumerate()
        .for_each(|(c, (out, x))| {
            let start = window.index((c * run) as u64) as u32;
            pulp::Arch::new().dispatch(Dropout {
                keys,
                threshold,
                scale,
                start,
                x,
                out,
            });
        });
    f32_out(out, &v)
}

/// One chunk of [`dropout`], compiled for the CPU's SIMD level: the hash's 32-bit
/// multiplies vectorise only beyond SSE2.
struct Dropout<'a> {
    keys: (u32, u32),
    threshold: u32,
    scale: f32,
    start: u32,
    x: &'a [f32],
    out: &'a mut [f32],
}

impl pulp::WithSimd for Dropout<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let (keys, threshold, scale, start) = (self.keys, self.threshold, self.scale, self.start);
        for (i, (o, x)) in self.out.iter_mut().zip(self.x).enumerate() {
            let keep = hash_with_keys(keys, start.wrapping_add(i as u32)) >= threshold;
            *o = if keep { x * scale } else { 0.0 };
        }
    }
}

pub(super) fn bias_dropout_add(
    x: FlexTensor,
    bias: FlexTensor,
    has_bias: bool,
    residual: FlexTensor,
    prob: f32,
    seed: u64,
) -> FlexTensor {
    let reference = |x, bias, residual| {
        reference_bias_dropout_add::<Flex>(x, bias, has_bias, residual, prob, seed)
    };
    if [x.dtype(), bias.dtype(), residual.dtype()] != [DType::F32; 3] {
        return reference(x, bias, residual);
    }
    let values = (f32_values(&x), f32_values(&residual), f32_values(&bias));
    let (Some(xs), Some(rs), Some(bs)) = values else {
        return reference(x, bias, residual);
    };
    let n = if has_bias { bs.len() } else { 1 };
    let (keys, threshold, scale) = (
        dropout_keys(seed),
        super::dropout_threshold(prob),
        keep_scale(prob),
    );
    let mut out = vec![0.0f32; xs.len()];
    out.par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK))
        .zip(rs.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, ((out, xs), rs))| {
            let start = c * CHUNK;
            for (i, ((o, x), r)) in out.iter_mut().zip(xs).zip(rs).enumerate() {
                let index = start + i;
                let v = if has_bias { x + bs[index % n] } else { *x };
                // As the reference: without dropout `r + v`, with it `r + mask(v · scale)`.
                *o = if prob == 0.0 {
                    r + v
                } else if hash_with_keys(keys, index as u32) >= threshold {
                    r + v * scale
                } else {
                    r + 0.0
                };
            }
        });
    f32_out(out, &x)
}
