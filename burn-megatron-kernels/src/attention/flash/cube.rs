//! The flash attention CubeCL kernels: one unit per query row (forward, `dq`) or per key row
//! (`dk`, `dv`), the other side streamed through shared memory a tile at a time, every
//! statistic and sum in f32.
//!
//! - forward: a cube per [`FLASH_QUERY_BLOCK`] query rows of one head; each unit keeps its
//!   row's query and output in registers and folds the key tiles in with the online softmax;
//!   it writes the output and the row's log-sum-exp.
//! - `dq`: the same cubes; each unit forms `D = dO·O` for its row, then replays the key tiles
//!   with the saved log-sum-exp (no second max/sum pass) and sums `dS·k`. It writes `D`.
//! - `dk`, `dv`: a cube per [`FLASH_QUERY_BLOCK`] keys of one query group; each unit keeps its
//!   key and value rows and their gradients, and streams every head of the group and every
//!   query block that sees it. Sums over heads are in registers: no atomics, deterministic.
//!
//! The masks, the dropout hash and the `−10000` masked score are the fused softmax's and
//! dropout's, so results agree with the composed attention element for element (within f32
//! summation order).

use super::FLASH_QUERY_BLOCK;
use crate::bias_dropout_add::kernel_dropout_hash;
use crate::softmax::MASKED_SCORE;
use cubecl::prelude::*;

/// The sizes and scalars every kernel reads.
#[derive(CubeLaunch, CubeType)]
pub(super) struct Attn {
    pub(super) heads: u32,
    pub(super) groups: u32,
    pub(super) sq: u32,
    pub(super) sk: u32,
    pub(super) scale: f32,
    pub(super) seed_lo: u32,
    pub(super) seed_hi: u32,
    pub(super) threshold: u32,
    pub(super) keep_scale: f32,
    /// The comptime `tile` again, as a runtime bound: loops over a tile's rows stay loops
    /// (lavapipe's LLVM unrolled them whole, and took minutes to compile the tests).
    pub(super) tile: u32,
}

/// `x` through dropout at flat index `index` of the `[b, heads, sq, sk]` probabilities: the
/// same hash as [`crate::dropout`]'s kernel, so the same elements drop.
#[cube]
pub(super) fn dropped(x: f32, index: usize, a: &Attn, #[comptime] dropout: bool) -> f32 {
    let mut y = x;
    if dropout {
        let keep = kernel_dropout_hash(index as u32, a.seed_lo, a.seed_hi) >= a.threshold;
        y = select(keep, x * a.keep_scale, 0.0f32);
    }
    y
}

/// The keys query block `block` multiplies: all of them, or under the causal mask (bottom-right
/// aligned) those up to its last row's position.
#[cube]
pub(super) fn key_limit(block: usize, a: &Attn, #[comptime] causal: bool) -> usize {
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let mut keys = sk;
    if causal {
        let end = block * FLASH_QUERY_BLOCK + FLASH_QUERY_BLOCK;
        keys = select(end < sq, end, sq) + sk - sq;
    }
    keys
}

/// Where a cube of query rows works: `CUBE_POS` is (query block, head, batch).
#[derive(CubeType)]
pub(super) struct QueryCube {
    pub(super) b: usize,
    /// `b · heads + head`.
    pub(super) bh: usize,
    /// The block's first query row.
    pub(super) row0: usize,
    /// Where the head's query group's `[sk, d]` keys (and values) start.
    pub(super) kv_base: usize,
    /// The keys the block multiplies ([`key_limit`]).
    pub(super) keys: usize,
}

/// This cube's [`QueryCube`], for head dimension `d`.
#[cube]
pub(super) fn query_cube(a: &Attn, #[comptime] d: usize, #[comptime] causal: bool) -> QueryCube {
    let (block, h, b) = (
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        CUBE_POS_Z as usize,
    );
    let group = h / ((a.heads / a.groups) as usize);
    QueryCube {
        b,
        bh: b * (a.heads as usize) + h,
        row0: block * FLASH_QUERY_BLOCK,
        kv_base: (b * (a.groups as usize) + group) * (a.sk as usize) * d,
        keys: key_limit(block, a, causal),
    }
}

/// Whether query row `row` of batch `b` may not see key `key` (it still counts, at −10000).
#[cube]
pub(super) fn masked<M: Numeric>(
    pad: &Tensor<M>,
    b: usize,
    row: usize,
    key: usize,
    a: &Attn,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
) -> bool {
    let mut m = false;
    if causal {
        m = key + (a.sq as usize) > row + (a.sk as usize);
    }
    if has_pad {
        // Clamped: units past the keys still evaluate the mask, and discard it.
        let sk = a.sk as usize;
        m = m || pad[b * sk + select(key < sk, key, sk - 1)] != M::from_int(0);
    }
    m
}

/// Copies rows `first..first + tile` of the `[rows, d]` matrix at `base` of `t` into `to`, as
/// f32 times `factor`, zeros past `end`. Every unit of the cube takes part.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float>(
    t: &Tensor<F>,
    base: usize,
    first: usize,
    end: usize,
    factor: f32,
    to: &mut Shared<[f32]>,
    #[comptime] tile: usize,
    #[comptime] d: usize,
) {
    let mut e = UNIT_POS_X as usize;
    while e < tile * d {
        let row = first + e / d;
        let mut x = 0.0f32;
        if row < end {
            x = f32::cast_from(t[base + row * d + e % d]) * factor;
        }
        to[e] = x;
        e += FLASH_QUERY_BLOCK;
    }
}

/// Σ `a[a0 + c] · b[b0 + c]` over `c < d`.
#[cube]
fn dot_local(a: &Array<f32>, b: &Shared<[f32]>, b0: usize, #[comptime] d: usize) -> f32 {
    let mut x = 0.0f32;
    for c in 0..d {
        x += a[c] * b[b0 + c];
    }
    x
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_forward_kernel<F: Float, M: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    pad: &Tensor<M>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    a: Attn,
    #[comptime] d: usize,
    #[comptime] tile: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let qc = query_cube(&a, d, causal);
    let (b, bh, row0, kv_base, keys) = (qc.b, qc.bh, qc.row0, qc.kv_base, qc.keys);
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let row = row0 + UNIT_POS_X as usize;
    let live = row < sq;
    let q_at = (bh * sq + select(live, row, row0)) * d;

    let mut qr = Array::<f32>::new(d);
    let mut o = Array::<f32>::new(d);
    for c in 0..d {
        qr[c] = f32::cast_from(q[q_at + c]) * a.scale;
        o[c] = 0.0f32;
    }
    let mut s = Array::<f32>::new(tile);
    let mut ks = Shared::<[f32]>::new_slice(tile * d);
    let mut vs = Shared::<[f32]>::new_slice(tile * d);
    // A finite start (WGSL has no −∞): exp(lowest − max) is 0 at the first tile.
    let mut m = f32::new(f32::MIN);
    let mut l = 0.0f32;
    let mut first = 0usize;
    while first < keys {
        sync_cube();
        load_tile::<F>(k, kv_base, first, keys, 1.0f32, &mut ks, tile, d);
        load_tile::<F>(v, kv_base, first, keys, 1.0f32, &mut vs, tile, d);
        sync_cube();
        let mut tile_max = f32::new(f32::MIN);
        for j in 0..a.tile as usize {
            let key = first + j;
            let hidden = masked::<M>(pad, b, row, key, &a, has_pad, causal);
            let x = select(
                hidden,
                f32::new(MASKED_SCORE),
                dot_local(&qr, &ks, j * d, d),
            );
            s[j] = x;
            if key < keys {
                tile_max = f32::max(tile_max, x);
            }
        }
        let m_new = f32::max(m, tile_max);
        let alpha = f32::exp(m - m_new);
        l *= alpha;
        for c in 0..d {
            o[c] *= alpha;
        }
        for j in 0..a.tile as usize {
            let key = first + j;
            if key < keys {
                let p = f32::exp(s[j] - m_new);
                l += p;
                let p = dropped(p, (bh * sq + row) * sk + key, &a, dropout);
                for c in 0..d {
                    o[c] += p * vs[j * d + c];
                }
            }
        }
        m = m_new;
        first += tile;
    }
    if live {
        for c in 0..d {
            out[q_at + c] = F::cast_from(o[c] / l);
        }
        lse[bh * sq + row] = m + f32::ln(l);
    }
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_dq_kernel<F: Float, M: Numeric>(
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
    #[comptime] tile: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let qc = query_cube(&a, d, causal);
    let (b, bh, row0, kv_base, keys) = (qc.b, qc.bh, qc.row0, qc.kv_base, qc.keys);
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let row = row0 + UNIT_POS_X as usize;
    let live = row < sq;
    let stat_at = bh * sq + select(live, row, row0);
    let q_at = stat_at * d;

    let mut qr = Array::<f32>::new(d);
    let mut dor = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    // D = rowsum(dO ∘ O) = rowsum(P ∘ dP'), the softmax backward's dot product.
    let mut delta_row = 0.0f32;
    for c in 0..d {
        qr[c] = f32::cast_from(q[q_at + c]) * a.scale;
        let g = f32::cast_from(grad[q_at + c]);
        dor[c] = g;
        delta_row += g * f32::cast_from(out[q_at + c]);
        acc[c] = 0.0f32;
    }
    let row_lse = lse[stat_at];
    let mut ks = Shared::<[f32]>::new_slice(tile * d);
    let mut vs = Shared::<[f32]>::new_slice(tile * d);
    let mut first = 0usize;
    while first < keys {
        sync_cube();
        load_tile::<F>(k, kv_base, first, keys, 1.0f32, &mut ks, tile, d);
        load_tile::<F>(v, kv_base, first, keys, 1.0f32, &mut vs, tile, d);
        sync_cube();
        for j in 0..a.tile as usize {
            let key = first + j;
            let hidden = masked::<M>(pad, b, row, key, &a, has_pad, causal);
            if key < keys && !hidden {
                let p = f32::exp(dot_local(&qr, &ks, j * d, d) - row_lse);
                let dp = dropped(
                    dot_local(&dor, &vs, j * d, d),
                    (bh * sq + row) * sk + key,
                    &a,
                    dropout,
                );
                let ds = p * (dp - delta_row);
                for c in 0..d {
                    acc[c] += ds * ks[j * d + c];
                }
            }
        }
        first += tile;
    }
    if live {
        for c in 0..d {
            dq[q_at + c] = F::cast_from(acc[c] * a.scale);
        }
        delta[stat_at] = delta_row;
    }
}

#[cube(launch, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_dkv_kernel<F: Float, M: Numeric>(
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
    #[comptime] tile: usize,
    #[comptime] has_pad: bool,
    #[comptime] causal: bool,
    #[comptime] dropout: bool,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let (block, group, b) = (
        CUBE_POS_X as usize,
        CUBE_POS_Y as usize,
        CUBE_POS_Z as usize,
    );
    let (sq, sk) = (a.sq as usize, a.sk as usize);
    let key0 = block * FLASH_QUERY_BLOCK;
    let key = key0 + UNIT_POS_X as usize;
    let live = key < sk;
    let kv_at = ((b * (a.groups as usize) + group) * sk + select(live, key, key0)) * d;

    let mut kr = Array::<f32>::new(d);
    let mut vr = Array::<f32>::new(d);
    let mut dkr = Array::<f32>::new(d);
    let mut dvr = Array::<f32>::new(d);
    for c in 0..d {
        kr[c] = f32::cast_from(k[kv_at + c]);
        vr[c] = f32::cast_from(v[kv_at + c]);
        dkr[c] = 0.0f32;
        dvr[c] = 0.0f32;
    }
    let mut qs = Shared::<[f32]>::new_slice(tile * d);
    let mut gs = Shared::<[f32]>::new_slice(tile * d);
    let mut lse_s = Shared::<[f32]>::new_slice(tile);
    let mut delta_s = Shared::<[f32]>::new_slice(tile);
    let per_group = (a.heads / a.groups) as usize;
    // Spelled out: kernel code has no `div_ceil`.
    #[allow(clippy::manual_div_ceil)]
    let blocks = (sq + FLASH_QUERY_BLOCK - 1) / FLASH_QUERY_BLOCK;
    for hh in 0..per_group {
        let bh = b * (a.heads as usize) + group * per_group + hh;
        let q_base = bh * sq * d;
        for qb in 0..blocks {
            let keys = key_limit(qb, &a, causal);
            // The same for the whole cube: blocks that see none of these keys are skipped.
            if keys > key0 {
                let end = qb * FLASH_QUERY_BLOCK + FLASH_QUERY_BLOCK;
                let end = select(end < sq, end, sq);
                let mut first = qb * FLASH_QUERY_BLOCK;
                while first < end {
                    sync_cube();
                    load_tile::<F>(q, q_base, first, end, a.scale, &mut qs, tile, d);
                    load_tile::<F>(grad, q_base, first, end, 1.0f32, &mut gs, tile, d);
                    let r = UNIT_POS_X as usize;
                    if r < tile {
                        let at = select(first + r < end, first + r, end - 1);
                        lse_s[r] = lse[bh * sq + at];
                        delta_s[r] = delta[bh * sq + at];
                    }
                    sync_cube();
                    for r in 0..a.tile as usize {
                        let row = first + r;
                        let hidden = masked::<M>(pad, b, row, key, &a, has_pad, causal);
                        if row < end && key < keys {
                            let x = select(
                                hidden,
                                f32::new(MASKED_SCORE),
                                dot_local(&kr, &qs, r * d, d),
                            );
                            let p = f32::exp(x - lse_s[r]);
                            let at = (bh * sq + row) * sk + key;
                            let pd = dropped(p, at, &a, dropout);
                            for c in 0..d {
                                dvr[c] += pd * gs[r * d + c];
                            }
                            if !hidden {
                                let dp = dropped(dot_local(&vr, &gs, r * d, d), at, &a, dropout);
                                let ds = p * (dp - delta_s[r]);
                                for c in 0..d {
                                    dkr[c] += ds * qs[r * d + c];
                                }
                            }
                        }
                    }
                    first += tile;
                }
            }
        }
    }
    if live {
        for c in 0..d {
            dk[kv_at + c] = F::cast_from(dkr[c]);
            dv[kv_at + c] = F::cast_from(dvr[c]);
        }
    }
}
