//! The flash attention kernels on tensor cores (CubeCL's `cmma`: WMMA on CUDA, cooperative
//! matrices on Vulkan), for f16 and bf16 with head dimensions a multiple of 16 up to
//! [`TC_MAX_HEAD_DIM`]: every product is a 16 × 16 × 16 matrix instruction with f32
//! accumulation; the softmax statistics, masks and dropout are the scalar kernels' (`cube.rs`),
//! on the products' f32 results in shared memory.
//!
//! Each cube is four planes (warps). The schedule is the scalar kernels':
//! - forward, a cube per [`FLASH_QUERY_BLOCK`] (32) query rows of one head, keys in tiles of
//!   16: `S = Q·Kᵀ` (two tiles, one plane each), the online softmax (a unit per row), the
//!   output rescaled and `O += P·V` (its `2 · d/16` tiles over the planes), `O` in f32 in
//!   shared memory;
//! - `dq`, the same cubes: `S` and `dP = dO·Vᵀ` at once (planes 0–1 and 2–3), `dS` by a unit
//!   per row, `dQ += dS·K`;
//! - `dk`, `dv`, a cube per 16 keys of one query group, every head of the group and every
//!   16 query rows that see them: `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, `Pᵀ` and `dSᵀ` by a unit per
//!   key, `dV += Pᵀ·dO` and `dK += dSᵀ·Q`.
//!
//! `P` and `dS` are rounded to the inputs' dtype before they enter a product (as
//! FlashAttention does); the row sums use them unrounded.

use super::FLASH_QUERY_BLOCK;
use super::cube::{Attn, dropped, key_limit, masked, query_cube};
use crate::softmax::MASKED_SCORE;
use cubecl::prelude::*;

mod tiles;

use tiles::{fill_shared, load_rows, tile_product};

/// The largest head dimension of the tensor-core kernels: at 128 the `dq` kernel's tiles
/// take 45 KiB of CUDA's 48 KiB of static shared memory.
pub(super) const TC_MAX_HEAD_DIM: usize = 128;

/// Bytes of alignment of every shared-memory tile: WMMA loads and stores want 256-bit
/// aligned addresses (each tile's 16-row blocks then start aligned too: their offsets are
/// multiples of 16 elements).
const ALIGN: usize = 32;

/// Keys per tile (forward, `dq`) and keys per cube (`dk`, `dv`).
const TK: usize = 16;

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_tc_forward_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<M>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    a: Attn,
    #[comptime] d: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
    #[comptime] emulate: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let qc = query_cube(&a, d, causal);
    let (b, bh, row0, kv_base, keys) = (qc.b, qc.bh, qc.row0, qc.kv_base, qc.keys);
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let br = FLASH_QUERY_BLOCK;
    let (unit, plane, planes) = (UNIT_POS as usize, UNIT_POS_Y as usize, CUBE_DIM_Y as usize);

    let mut qs = Shared::<[F]>::new_aligned_slice(br * d, ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(br * TK, ALIGN);
    let mut ps = Shared::<[F]>::new_aligned_slice(br * TK, ALIGN);
    let mut os = Shared::<[f32]>::new_aligned_slice(br * d, ALIGN);
    let mut stats = Shared::<[f32]>::new_aligned_slice(3 * br, ALIGN);
    load_rows::<F>(q, bh * sq * d, row0, sq, &mut qs, br, d);
    fill_shared(&mut os, 0.0f32, br * d);
    if unit < br {
        stats[unit] = f32::new(f32::MIN);
        stats[br + unit] = 0.0f32;
    }
    let mut first = 0usize;
    while first < keys {
        sync_cube();
        load_rows::<F>(k, kv_base, first, keys, &mut ks, TK, d);
        load_rows::<F>(v, kv_base, first, keys, &mut vs, TK, d);
        sync_cube();
        if plane < 2 {
            tile_product::<F>(
                &mut ss,
                plane * 16 * TK,
                TK as u32,
                &qs,
                plane * 16 * d,
                d as u32,
                &ks,
                0,
                d as u32,
                d,
                true,
                false,
                emulate,
            );
        }
        sync_cube();
        if unit < br {
            let row = row0 + unit;
            let m = stats[unit];
            let mut tile_max = f32::new(f32::MIN);
            for j in 0..TK {
                let key = first + j;
                let hidden = masked::<M>(pad, b, row, key, &a, has_pad, causal);
                let x = select(hidden, f32::new(MASKED_SCORE), ss[unit * TK + j] * a.scale);
                ss[unit * TK + j] = x;
                if key < keys {
                    tile_max = f32::max(tile_max, x);
                }
            }
            let m_new = f32::max(m, tile_max);
            let alpha = f32::exp(m - m_new);
            let mut l = stats[br + unit] * alpha;
            for j in 0..TK {
                let key = first + j;
                let mut p = 0.0f32;
                if key < keys {
                    p = f32::exp(ss[unit * TK + j] - m_new);
                }
                l += p;
                let p = dropped(p, (bh * sq + row) * sk + key, &a, dropout);
                ps[unit * TK + j] = F::cast_from(p);
            }
            stats[unit] = m_new;
            stats[br + unit] = l;
            stats[2 * br + unit] = alpha;
        }
        sync_cube();
        let mut e = unit;
        while e < br * d {
            os[e] *= stats[2 * br + e / d];
            e += CUBE_DIM as usize;
        }
        sync_cube();
        let col_tiles = d / 16;
        let mut t = plane;
        while t < 2 * col_tiles {
            let (rt, ct) = (t / col_tiles, t % col_tiles);
            tile_product::<F>(
                &mut os,
                rt * 16 * d + ct * 16,
                d as u32,
                &ps,
                rt * 16 * TK,
                TK as u32,
                &vs,
                ct * 16,
                d as u32,
                TK,
                false,
                true,
                emulate,
            );
            t += planes;
        }
        first += TK;
    }
    sync_cube();
    let mut e = unit;
    while e < br * d {
        let row = row0 + e / d;
        if row < sq {
            out[(bh * sq + row) * d + e % d] = F::cast_from(os[e] / stats[br + e / d]);
        }
        e += CUBE_DIM as usize;
    }
    if unit < br && row0 + unit < sq {
        lse[bh * sq + row0 + unit] = stats[unit] + f32::ln(stats[br + unit]);
    }
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_tc_dq_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<M>,
    out: &Tensor<F>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    dq: &mut Tensor<F>,
    delta: &mut Tensor<f32>,
    a: Attn,
    #[comptime] d: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
    #[comptime] emulate: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let qc = query_cube(&a, d, causal);
    let (b, bh, row0, kv_base, keys) = (qc.b, qc.bh, qc.row0, qc.kv_base, qc.keys);
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let br = FLASH_QUERY_BLOCK;
    let (unit, plane, planes) = (UNIT_POS as usize, UNIT_POS_Y as usize, CUBE_DIM_Y as usize);

    let mut qs = Shared::<[F]>::new_aligned_slice(br * d, ALIGN);
    let mut gs = Shared::<[F]>::new_aligned_slice(br * d, ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(br * TK, ALIGN);
    let mut dps = Shared::<[f32]>::new_aligned_slice(br * TK, ALIGN);
    let mut dss = Shared::<[F]>::new_aligned_slice(br * TK, ALIGN);
    let mut dqs = Shared::<[f32]>::new_aligned_slice(br * d, ALIGN);
    let mut stats = Shared::<[f32]>::new_aligned_slice(2 * br, ALIGN);
    load_rows::<F>(q, bh * sq * d, row0, sq, &mut qs, br, d);
    load_rows::<F>(grad, bh * sq * d, row0, sq, &mut gs, br, d);
    fill_shared(&mut dqs, 0.0f32, br * d);
    if unit < br {
        let row = row0 + unit;
        let at = bh * sq + select(row < sq, row, sq - 1);
        // D = rowsum(dO ∘ O) = rowsum(P ∘ dP'), the softmax backward's dot product.
        let mut dot = 0.0f32;
        for c in 0..d {
            dot += f32::cast_from(grad[at * d + c]) * f32::cast_from(out[at * d + c]);
        }
        stats[unit] = lse[at];
        stats[br + unit] = dot;
        if row < sq {
            delta[at] = dot;
        }
    }
    let mut first = 0usize;
    while first < keys {
        sync_cube();
        load_rows::<F>(k, kv_base, first, keys, &mut ks, TK, d);
        load_rows::<F>(v, kv_base, first, keys, &mut vs, TK, d);
        sync_cube();
        if plane < 2 {
            tile_product::<F>(
                &mut ss,
                plane * 16 * TK,
                TK as u32,
                &qs,
                plane * 16 * d,
                d as u32,
                &ks,
                0,
                d as u32,
                d,
                true,
                false,
                emulate,
            );
        } else if plane < 4 {
            let r = plane - 2;
            tile_product::<F>(
                &mut dps,
                r * 16 * TK,
                TK as u32,
                &gs,
                r * 16 * d,
                d as u32,
                &vs,
                0,
                d as u32,
                d,
                true,
                false,
                emulate,
            );
        }
        sync_cube();
        if unit < br {
            let row = row0 + unit;
            for j in 0..TK {
                let key = first + j;
                let hidden = masked::<M>(pad, b, row, key, &a, has_pad, causal);
                let mut ds = 0.0f32;
                if key < keys && !hidden {
                    let p = f32::exp(ss[unit * TK + j] * a.scale - stats[unit]);
                    let dp = dropped(dps[unit * TK + j], (bh * sq + row) * sk + key, &a, dropout);
                    ds = p * (dp - stats[br + unit]);
                }
                dss[unit * TK + j] = F::cast_from(ds);
            }
        }
        sync_cube();
        let col_tiles = d / 16;
        let mut t = plane;
        while t < 2 * col_tiles {
            let (rt, ct) = (t / col_tiles, t % col_tiles);
            tile_product::<F>(
                &mut dqs,
                rt * 16 * d + ct * 16,
                d as u32,
                &dss,
                rt * 16 * TK,
                TK as u32,
                &ks,
                ct * 16,
                d as u32,
                TK,
                false,
                true,
                emulate,
            );
            t += planes;
        }
        first += TK;
    }
    sync_cube();
    let mut e = unit;
    while e < br * d {
        let row = row0 + e / d;
        if row < sq {
            dq[(bh * sq + row) * d + e % d] = F::cast_from(dqs[e] * a.scale);
        }
        e += CUBE_DIM as usize;
    }
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_tc_dkv_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<M>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    a: Attn,
    #[comptime] d: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
    #[comptime] emulate: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let (block, group, b) = (
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        CUBE_POS_Z as usize,
    );
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let key0 = block * TK;
    let kv_base = (b * (a.groups as usize) + group) * sk * d;
    let (unit, plane, planes) = (UNIT_POS as usize, UNIT_POS_Y as usize, CUBE_DIM_Y as usize);

    let mut ks = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut qs = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut gs = Shared::<[F]>::new_aligned_slice(TK * d, ALIGN);
    let mut st = Shared::<[f32]>::new_aligned_slice(TK * TK, ALIGN);
    let mut dpt = Shared::<[f32]>::new_aligned_slice(TK * TK, ALIGN);
    let mut pt = Shared::<[F]>::new_aligned_slice(TK * TK, ALIGN);
    let mut dst = Shared::<[F]>::new_aligned_slice(TK * TK, ALIGN);
    let mut dks = Shared::<[f32]>::new_aligned_slice(TK * d, ALIGN);
    let mut dvs = Shared::<[f32]>::new_aligned_slice(TK * d, ALIGN);
    let mut stats = Shared::<[f32]>::new_aligned_slice(2 * TK, ALIGN);
    load_rows::<F>(k, kv_base, key0, sk, &mut ks, TK, d);
    load_rows::<F>(v, kv_base, key0, sk, &mut vs, TK, d);
    fill_shared(&mut dks, 0.0f32, TK * d);
    fill_shared(&mut dvs, 0.0f32, TK * d);
    let per_group = (a.heads / a.groups) as usize;
    let br = FLASH_QUERY_BLOCK;
    // Spelled out: kernel code has no `div_ceil`.
    #[allow(clippy::manual_div_ceil)]
    let blocks = (sq + br - 1) / br;
    let col_tiles = d / 16;
    for hh in 0..per_group {
        let bh = b * (a.heads as usize) + group * per_group + hh;
        for qb in 0..blocks {
            let keys = key_limit(qb, &a, causal);
            // The same for the whole cube: blocks that see none of these keys are skipped.
            if keys > key0 {
                let end = select(qb * br + br < sq, qb * br + br, sq);
                let mut first = qb * br;
                while first < end {
                    sync_cube();
                    load_rows::<F>(q, bh * sq * d, first, end, &mut qs, TK, d);
                    load_rows::<F>(grad, bh * sq * d, first, end, &mut gs, TK, d);
                    if unit < TK {
                        let at = bh * sq + select(first + unit < end, first + unit, end - 1);
                        stats[unit] = lse[at];
                        stats[TK + unit] = delta[at];
                    }
                    sync_cube();
                    if plane == 0 {
                        tile_product::<F>(
                            &mut st, 0, TK as u32, &ks, 0, d as u32, &qs, 0, d as u32, d, true,
                            false, emulate,
                        );
                    } else if plane == 1 {
                        tile_product::<F>(
                            &mut dpt, 0, TK as u32, &vs, 0, d as u32, &gs, 0, d as u32, d, true,
                            false, emulate,
                        );
                    }
                    sync_cube();
                    if unit < TK {
                        let key = key0 + unit;
                        for r in 0..TK {
                            let row = first + r;
                            let hidden = masked::<M>(pad, b, row, key, &a, has_pad, causal);
                            let mut p = 0.0f32;
                            let mut ds = 0.0f32;
                            if row < end && key < keys {
                                let x = select(
                                    hidden,
                                    f32::new(MASKED_SCORE),
                                    st[unit * TK + r] * a.scale,
                                );
                                let at = (bh * sq + row) * sk + key;
                                let p_row = f32::exp(x - stats[r]);
                                p = dropped(p_row, at, &a, dropout);
                                if !hidden {
                                    let dp = dropped(dpt[unit * TK + r], at, &a, dropout);
                                    ds = p_row * (dp - stats[TK + r]);
                                }
                            }
                            pt[unit * TK + r] = F::cast_from(p);
                            dst[unit * TK + r] = F::cast_from(ds);
                        }
                    }
                    sync_cube();
                    let mut t = plane;
                    while t < 2 * col_tiles {
                        let ct = t % col_tiles;
                        if t < col_tiles {
                            tile_product::<F>(
                                &mut dvs,
                                ct * 16,
                                d as u32,
                                &pt,
                                0,
                                TK as u32,
                                &gs,
                                ct * 16,
                                d as u32,
                                TK,
                                false,
                                true,
                                emulate,
                            );
                        } else {
                            tile_product::<F>(
                                &mut dks,
                                ct * 16,
                                d as u32,
                                &dst,
                                0,
                                TK as u32,
                                &qs,
                                ct * 16,
                                d as u32,
                                TK,
                                false,
                                true,
                                emulate,
                            );
                        }
                        t += planes;
                    }
                    first += TK;
                }
            }
        }
    }
    sync_cube();
    let mut e = unit;
    while e < TK * d {
        let key = key0 + e / d;
        if key < sk {
            dk[kv_base + key * d + e % d] = F::cast_from(dks[e] * a.scale);
            dv[kv_base + key * d + e % d] = F::cast_from(dvs[e]);
        }
        e += CUBE_DIM as usize;
    }
}
