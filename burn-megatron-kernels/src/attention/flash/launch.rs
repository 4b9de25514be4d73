//! The flash kernels' launches on Burn's Cube backend: which set serves a call (the
//! tensor cores where the device, dtype and head dimension allow, see [`FlashKernels`]), their
//! geometry and scalars, and the backend ops.

use super::cube::{AttnLaunch, flash_dkv_kernel, flash_dq_kernel, flash_forward_kernel};
use super::tensor_core::{
    TC_MAX_HEAD_DIM, flash_tc_dkv_kernel, flash_tc_dq_kernel, flash_tc_forward_kernel,
};
use super::{FLASH_QUERY_BLOCK, FlashAttentionOps, FlashKernels, KernelPath, count_launch};
use crate::attention::AttentionParams;
use crate::bias_dropout_add::{dropout_threshold, keep_scale};
use crate::launch::empty_like;
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::prelude::*;

/// Key (forward, `dq`) or query (`dk`, `dv`) rows per shared-memory tile: as many as fit two
/// f32 tiles of `d` columns in the shared memory a cube may use (at most 40 KiB, under CUDA's
/// 48 KiB of static shared memory), a power of two up to [`FLASH_QUERY_BLOCK`].
fn tile_rows(like: &CubeTensor, d: usize) -> usize {
    let limit = like.client.properties().hardware.max_shared_memory_size;
    let budget = limit
        .min(40 << 10)
        .saturating_sub(2 * 4 * FLASH_QUERY_BLOCK);
    let mut tile = FLASH_QUERY_BLOCK;
    while tile > 1 && 2 * tile * d * 4 > budget {
        tile /= 2;
    }
    tile
}

fn tc_path(emulate: bool) -> KernelPath {
    match emulate {
        true => KernelPath::Emulated,
        false => KernelPath::TensorCores,
    }
}

/// Shared memory of the tensor-core kernels at head dimension `d` (the `dq` kernel's, the
/// largest): `F` tiles of Q, dO (32 rows), K, V (16) and dS, f32 tiles of S, dP and dQ.
fn tensor_core_shared_bytes(d: usize, elem: usize) -> usize {
    let br = FLASH_QUERY_BLOCK;
    (2 * br * d + 2 * 16 * d + br * 16) * elem + (2 * br * 16 + br * d + 2 * br) * 4
}

/// How the tensor-core kernels serve `q` (head dimension `d`), if they do: the plane size to
/// launch them with and whether to emulate the matrix products ([`FlashKernels`]). They need
/// `d` a multiple of 16 up to [`TC_MAX_HEAD_DIM`], four planes of at least 8 units (a unit per
/// query row of a block) and the shared memory; on the matrix instructions, f16 or bf16 and a
/// device with 16 × 16 × 16 instructions of that dtype into f32.
fn tensor_cores(q: &CubeTensor, d: usize) -> Option<(u32, bool)> {
    let emulate = match super::flash_kernels() {
        FlashKernels::Scalar => return None,
        FlashKernels::Auto => false,
        FlashKernels::Emulated => true,
    };
    if !d.is_multiple_of(16) || d > TC_MAX_HEAD_DIM {
        return None;
    }
    let props = q.client.properties();
    let hw = &props.hardware;
    let plane = hw.plane_size_max;
    let elem = q.dtype.size();
    // The kernels take `UNIT_POS_Y` for the plane (warp) index: a device whose subgroup
    // size varies (some Vulkan GPUs) could split a row of units over two subgroups.
    let fits = tensor_core_shared_bytes(d, elem) <= hw.max_shared_memory_size
        && hw.plane_size_min == plane
        && (8..=hw.max_units_per_cube / 4).contains(&plane)
        && 4 <= hw.max_cube_dim.1;
    if emulate {
        return fits.then_some((plane, true));
    }
    if !matches!(q.dtype, DType::F16 | DType::BF16) {
        return None;
    }
    let storage = dtype_to_storage_type(q.dtype);
    let config = MmaConfig {
        a_type: storage,
        b_type: storage,
        cd_type: dtype_to_storage_type(DType::F32),
        m: 16,
        n: 16,
        k: 16,
    };
    (props.features.matmul.cmma.contains(&config) && fits).then_some((plane, false))
}

/// The kernels' scalars for `q` `[b, heads, sq, d]` and `k` `[b, groups, sk, d]`.
fn attn(q: &CubeTensor, k: &CubeTensor, p: &AttentionParams, tile: usize) -> AttnLaunch {
    let ([_, heads, sq, _], [_, groups, sk, _]) = (q.shape().dims::<4>(), k.shape().dims::<4>());
    AttnLaunch::new(
        heads as u32,
        groups as u32,
        sq as u32,
        sk as u32,
        p.scale,
        p.seed as u32,
        (p.seed >> 32) as u32,
        dropout_threshold(p.dropout),
        keep_scale(p.dropout),
        tile as u32,
    )
}

/// Cubes of [`FLASH_QUERY_BLOCK`] rows over `rows`, one per `(block, y, z)`.
fn grid(rows: usize, y: usize, z: usize) -> CubeCount {
    CubeCount::Static(rows.div_ceil(FLASH_QUERY_BLOCK) as u32, y as u32, z as u32)
}

fn dtypes(x: &CubeTensor, pad: &CubeTensor) -> [ElemType; 2] {
    [
        dtype_to_storage_type(x.dtype),
        dtype_to_storage_type(pad.dtype),
    ]
}

impl FlashAttentionOps for CubeBackend {
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let pad = into_contiguous(key_padding);
        let [b, heads, sq, d] = q.shape().dims::<4>();
        let out = empty_like(&q, q.shape(), q.dtype);
        let lse = empty_like(&q, Shape::from([b, heads, sq]), DType::F32);
        let client = q.client.clone();
        let (has_pad, causal, dropout) = (padded, params.causal, params.dropout > 0.0);
        if let Some((plane, emulate)) = tensor_cores(&q, d) {
            count_launch(tc_path(emulate));
            flash_tc_forward_kernel::launch(
                &client,
                grid(sq, heads, b),
                CubeDim::new_2d(plane, 4),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.into_tensor_arg(),
                pad.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                attn(&q, &k, &params, 16),
                d,
                has_pad,
                causal,
                dropout,
                emulate,
                dtypes(&q, &pad),
            );
            return (out, lse_as_stats(lse, q.dtype));
        }
        count_launch(KernelPath::Scalar);
        let tile = tile_rows(&q, d);
        flash_forward_kernel::launch(
            &client,
            grid(sq, heads, b),
            CubeDim::new_1d(FLASH_QUERY_BLOCK as u32),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.into_tensor_arg(),
            pad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            attn(&q, &k, &params, tile),
            d,
            tile,
            has_pad,
            causal,
            dropout,
            dtypes(&q, &pad),
        );
        (out, lse_as_stats(lse, q.dtype))
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        // The kernels keep their statistics in f32, whatever the public dtype (f64 for f64).
        let lse = match lse.dtype {
            DType::F32 => lse,
            _ => burn_cubecl::kernel::cast(lse, DType::F32),
        };
        let (out, lse, grad) = (
            into_contiguous(out),
            into_contiguous(lse),
            into_contiguous(grad),
        );
        let pad = into_contiguous(key_padding);
        let [b, heads, sq, d] = q.shape().dims::<4>();
        let [_, groups, sk, _] = k.shape().dims::<4>();
        let dq = empty_like(&q, q.shape(), q.dtype);
        let dk = empty_like(&k, k.shape(), k.dtype);
        let dv = empty_like(&v, v.shape(), v.dtype);
        let delta = empty_like(&q, Shape::from([b, heads, sq]), DType::F32);
        let client = q.client.clone();
        let (has_pad, causal, dropout) = (padded, params.causal, params.dropout > 0.0);
        if let Some((plane, emulate)) = tensor_cores(&q, d) {
            count_launch(tc_path(emulate));
            let units = CubeDim::new_2d(plane, 4);
            flash_tc_dq_kernel::launch(
                &client,
                grid(sq, heads, b),
                units,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                pad.clone().into_tensor_arg(),
                out.into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                attn(&q, &k, &params, 16),
                d,
                has_pad,
                causal,
                dropout,
                emulate,
                dtypes(&q, &pad),
            );
            flash_tc_dkv_kernel::launch(
                &client,
                CubeCount::Static(sk.div_ceil(16) as u32, groups as u32, b as u32),
                units,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.into_tensor_arg(),
                pad.clone().into_tensor_arg(),
                grad.into_tensor_arg(),
                lse.into_tensor_arg(),
                delta.into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                attn(&q, &k, &params, 16),
                d,
                has_pad,
                causal,
                dropout,
                emulate,
                dtypes(&q, &pad),
            );
            return (dq, dk, dv);
        }
        count_launch(KernelPath::Scalar);
        let tile = tile_rows(&q, d);
        let units = CubeDim::new_1d(FLASH_QUERY_BLOCK as u32);
        flash_dq_kernel::launch(
            &client,
            grid(sq, heads, b),
            units,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            pad.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            attn(&q, &k, &params, tile),
            d,
            tile,
            has_pad,
            causal,
            dropout,
            dtypes(&q, &pad),
        );
        flash_dkv_kernel::launch(
            &client,
            grid(sk, groups, b),
            units,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.into_tensor_arg(),
            pad.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            attn(&q, &k, &params, tile),
            d,
            tile,
            has_pad,
            causal,
            dropout,
            dtypes(&q, &pad),
        );
        (dq, dk, dv)
    }
}

/// The log-sum-exp in the statistics dtype `flash_attention_backward` takes for `dtype`:
/// f64 for f64 inputs (as the composed schedule keeps it), f32 otherwise.
fn lse_as_stats(lse: CubeTensor, dtype: DType) -> CubeTensor {
    match dtype {
        DType::F64 => burn_cubecl::kernel::cast(lse, DType::F64),
        _ => lse,
    }
}
