//! The bias + dropout + residual CubeCL kernels: the mask hash is recomputed per element from
//! the seed halves, in u32 arithmetic only (WGSL has no u64).

use super::{BiasDropoutAddOps, MaskWindow, dropout_threshold, keep_scale};
use crate::launch::elementwise_launch;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

/// The kernel's copy of [`super::fmix32`]; u32 multiplication wraps on every target.
#[cube]
fn fmix32(h: u32) -> u32 {
    let h = h ^ (h >> 16u32);
    let h = h * 0x85EB_CA6Bu32;
    let h = h ^ (h >> 13u32);
    let h = h * 0xC2B2_AE35u32;
    h ^ (h >> 16u32)
}

/// The kernel's copy of [`super::dropout_hash`] (the flash attention kernels use it too). The
/// per-seed keys are recomputed by every unit: a few integer ops against a memory-bound
/// element, and no extra launch arguments.
#[cube]
pub(crate) fn dropout_hash(index: u32, seed_lo: u32, seed_hi: u32) -> u32 {
    let k1 = fmix32(seed_lo ^ fmix32(seed_hi ^ 0x9E37_79B9u32));
    let k2 = fmix32(k1 + 0x7F4A_7C15u32);
    fmix32(fmix32(index ^ k1) + k2)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn bias_dropout_add_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    residual: &Tensor<F>,
    out: &mut Tensor<F>,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    scale: f32,
    #[comptime] has_bias: bool,
    #[comptime] dropout: bool,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let mut v = x[pos];
    if has_bias {
        v += bias[pos % bias.len()];
    }
    if dropout {
        let keep = dropout_hash(pos as u32, seed_lo, seed_hi) >= threshold;
        // select, not a multiply by the mask: a dropped inf/NaN gives 0 as in the reference.
        v = select(keep, v * F::cast_from(scale), F::new(0.0));
    }
    out[pos] = residual[pos] + v;
}

/// A [`MaskWindow`] as kernel scalars (callers check that the larger tensor's indices fit in
/// u32).
#[derive(CubeLaunch, CubeType)]
struct Window {
    rows: u32,
    cols: u32,
    total_rows: u32,
    total_cols: u32,
    row0: u32,
}

/// `MaskWindow::index` of `pos`.
#[cube]
fn window_index(pos: u32, w: &Window) -> u32 {
    let row = pos / w.cols;
    ((row / w.rows) * w.total_rows + w.row0 + row % w.rows) * w.total_cols + pos % w.cols
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dropout_kernel<F: Float>(
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,
    scale: f32,
    window: Window,
    #[comptime] windowed: bool,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let mut index = pos as u32;
    if windowed {
        index = window_index(index, &window);
    }
    let keep = dropout_hash(index, seed_lo, seed_hi) >= threshold;
    out[pos] = select(keep, v[pos] * F::cast_from(scale), F::new(0.0));
}

impl BiasDropoutAddOps for CubeBackend {
    fn bias_dropout_add(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        has_bias: bool,
        residual: FloatTensor<Self>,
        prob: f32,
        seed: u64,
    ) -> FloatTensor<Self> {
        let (x, residual) = (into_contiguous(x), into_contiguous(residual));
        let (out, Some((cube_dim, count))) = elementwise_launch(&x) else {
            return x; // empty: nothing to compute, the input has the output's shape
        };
        // Without a bias the kernel never reads its bias argument.
        let bias = into_contiguous(bias);
        let client = x.client.clone();
        let dtype = dtype_to_storage_type(x.dtype);
        bias_dropout_add_kernel::launch(
            &client,
            count,
            cube_dim,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            residual.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            seed as u32,
            (seed >> 32) as u32,
            dropout_threshold(prob),
            keep_scale(prob),
            has_bias,
            prob != 0.0,
            dtype,
        );
        out
    }

    fn dropout(
        v: FloatTensor<Self>,
        prob: f32,
        seed: u64,
        window: MaskWindow,
    ) -> FloatTensor<Self> {
        if prob == 0.0 {
            return v;
        }
        let v = into_contiguous(v);
        let (out, Some((cube_dim, count))) = elementwise_launch(&v) else {
            return v;
        };
        let client = v.client.clone();
        let dtype = dtype_to_storage_type(v.dtype);
        dropout_kernel::launch(
            &client,
            count,
            cube_dim,
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            seed as u32,
            (seed >> 32) as u32,
            dropout_threshold(prob),
            keep_scale(prob),
            WindowLaunch::new(
                window.rows as u32,
                window.cols as u32,
                window.total_rows as u32,
                window.total_cols as u32,
                window.row0 as u32,
            ),
            !window.is_whole(),
            dtype,
        );
        out
    }
}
