//! The chunked schedule, once for every backend: each block of query rows is a handful of
//! backend ops (two or five batched products, the fused softmax, dropout), with the keys and
//! values shared by a group's heads read in place.

use super::{AttentionParams, window};
use crate::MASKED_SCORE;
use crate::ops::cast;
use crate::{BiasDropoutAddOps, LinearOps, ScaledMaskedSoftmaxOps};
use burn::backend::TensorMetadata;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::tensor::{DType, FloatDType, Shape, Slice, TensorData};

/// What the schedule needs of a backend.
pub(super) trait Parts: LinearOps + ScaledMaskedSoftmaxOps + BiasDropoutAddOps {}

impl<B: LinearOps + ScaledMaskedSoftmaxOps + BiasDropoutAddOps> Parts for B {}

/// One block: query rows `row0..row0 + rows` and the keys `0..keys` any of them can see.
#[derive(Clone, Copy, Debug)]
struct Block {
    row0: usize,
    rows: usize,
    keys: usize,
}

/// The sizes of one call.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    heads: usize,
    groups: usize,
    sq: usize,
    sk: usize,
    d: usize,
}

impl Dims {
    fn of<B: Parts>(q: &FloatTensor<B>, k: &FloatTensor<B>) -> Self {
        let ([b, heads, sq, d], [_, groups, sk, _]) =
            (q.shape().dims::<4>(), k.shape().dims::<4>());
        Self {
            b,
            heads,
            groups,
            sq,
            sk,
            d,
        }
    }

    /// The blocks in order. Under the causal mask (`sq ≤ sk`, queries at the last `sq` key
    /// positions) a block sees the keys up to its last row's position.
    fn blocks(self, p: &AttentionParams) -> Vec<Block> {
        let chunk = p.query_chunk.clamp(1, self.sq.max(1));
        (0..self.sq)
            .step_by(chunk)
            .map(|row0| {
                let rows = chunk.min(self.sq - row0);
                let keys = match p.causal {
                    true => row0 + rows + self.sk - self.sq,
                    false => self.sk,
                };
                Block { row0, rows, keys }
            })
            .collect()
    }

    /// `[b, heads, rows, x]` → `[b, groups, heads/groups · rows, x]`: a group's heads' rows
    /// stacked, so that one product per group serves them all.
    fn grouped<B: Parts>(self, t: FloatTensor<B>) -> FloatTensor<B> {
        let [_, _, rows, x] = t.shape().dims::<4>();
        let per_group = self.heads / self.groups;
        B::float_reshape(t, Shape::from([self.b, self.groups, per_group * rows, x]))
    }

    /// The inverse of [`Dims::grouped`].
    fn per_head<B: Parts>(self, t: FloatTensor<B>, rows: usize) -> FloatTensor<B> {
        let x = t.shape().dims::<4>()[3];
        B::float_reshape(t, Shape::from([self.b, self.heads, rows, x]))
    }
}

/// `t[:, :, start..start + len, :]`.
fn rows<B: Parts>(t: &FloatTensor<B>, start: usize, len: usize) -> FloatTensor<B> {
    if start == 0 && len == t.shape().dims::<4>()[2] {
        return t.clone();
    }
    let all = || Slice::from(..);
    B::float_slice(
        t.clone(),
        &[all(), all(), Slice::from(start..start + len), all()],
    )
}

/// `t`'s last two dims swapped (a view).
fn transposed<B: Parts>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::float_swap_dims(t, 2, 3)
}

/// One block's forward up to the probabilities.
struct Probs<B: Parts> {
    /// The block's queries, grouped.
    q: FloatTensor<B>,
    /// The keys and values the block sees.
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    /// Their padding.
    pad: BoolTensor<B>,
    /// Softmax output `[b, heads, rows, keys]`, before dropout.
    probs: FloatTensor<B>,
    /// After dropout (the same tensor without it).
    dropped: FloatTensor<B>,
}

#[allow(clippy::too_many_arguments)]
fn probs<B: Parts>(
    dims: Dims,
    block: Block,
    q: &FloatTensor<B>,
    k: &FloatTensor<B>,
    v: &FloatTensor<B>,
    pad: &BoolTensor<B>,
    padded: bool,
    p: &AttentionParams,
) -> Probs<B> {
    let Block { row0, rows, keys } = block;
    let q = dims.grouped::<B>(self::rows::<B>(q, row0, rows));
    let (k, v) = (self::rows::<B>(k, 0, keys), self::rows::<B>(v, 0, keys));
    let pad = match padded && keys < dims.sk {
        true => B::bool_slice(pad.clone(), &[Slice::from(..), Slice::from(0..keys)]),
        false => pad.clone(),
    };
    let scores = B::batched_matmul(q.clone(), transposed::<B>(k.clone()));
    let scores = dims.per_head::<B>(scores, rows);
    let probs = B::scaled_masked_softmax(scores, pad.clone(), padded, p.scale, p.causal);
    let dropped = match p.dropout > 0.0 {
        true => B::dropout(
            probs.clone(),
            p.dropout,
            p.seed,
            window(row0, rows, keys, dims.sq, dims.sk),
        ),
        false => probs.clone(),
    };
    Probs {
        q,
        k,
        v,
        pad,
        probs,
        dropped,
    }
}

/// The attention output `[b, heads, sq, d]`.
pub(super) fn forward<B: Parts>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    pad: BoolTensor<B>,
    padded: bool,
    p: AttentionParams,
) -> FloatTensor<B> {
    let dims = Dims::of::<B>(&q, &k);
    let mut outs: Vec<_> = dims
        .blocks(&p)
        .into_iter()
        .map(|block| {
            let Probs { v, dropped, .. } = probs::<B>(dims, block, &q, &k, &v, &pad, padded, &p);
            let out = B::batched_matmul(dims.grouped::<B>(dropped), v);
            dims.per_head::<B>(out, block.rows)
        })
        .collect();
    match outs.len() {
        1 => outs.pop().expect("one block"),
        _ => B::float_cat(outs, 2),
    }
}

/// Sums blocks' key or value gradients `[b, groups, keys, d]` (keys growing under a causal
/// mask) into one `[b, groups, sk, d]`: a single block's as it is, several in f32 (f64 for
/// f64).
struct KeyGrad<B: Parts> {
    sum: Option<FloatTensor<B>>,
    blocks: usize,
}

impl<B: Parts> KeyGrad<B> {
    fn new(blocks: usize) -> Self {
        Self { sum: None, blocks }
    }

    fn add(&mut self, part: FloatTensor<B>, dims: Dims) {
        if self.blocks == 1 && part.shape().dims::<4>()[2] == dims.sk {
            self.sum = Some(part);
            return;
        }
        let wide = wide(part.dtype());
        let part = cast::<B>(part, wide);
        let keys = part.shape().dims::<4>()[2];
        let sum = self.sum.take().unwrap_or_else(|| {
            let shape = Shape::from([dims.b, dims.groups, dims.sk, dims.d]);
            B::float_zeros(shape, &part.device(), wide)
        });
        self.sum = Some(match keys == dims.sk {
            true => B::float_add(sum, part),
            false => {
                let all = || Slice::from(..);
                let range = [all(), all(), Slice::from(0..keys), all()];
                let head = B::float_add(B::float_slice(sum.clone(), &range), part);
                B::float_slice_assign(sum, &range, head)
            }
        });
    }

    /// The sum in `dtype`.
    fn finish(self, dtype: DType) -> FloatTensor<B> {
        let sum = self
            .sum
            .expect("at least one block: an empty sequence is refused");
        cast::<B>(sum, FloatDType::from(dtype))
    }
}

/// The gradients of a backward's blocks as they are formed: `dq` per block of rows, `dk` and
/// `dv` summed over the blocks ([`KeyGrad`]). Both backwards make the same four products per
/// block and differ only in how they form `dS` from `dP`.
struct BlockGrads<B: Parts> {
    dq: Vec<FloatTensor<B>>,
    dk: KeyGrad<B>,
    dv: KeyGrad<B>,
}

impl<B: Parts> BlockGrads<B> {
    fn new(blocks: usize) -> Self {
        Self {
            dq: Vec::with_capacity(blocks),
            dk: KeyGrad::new(blocks),
            dv: KeyGrad::new(blocks),
        }
    }

    /// `dv += Pᵀ·dO` from the block's grouped (dropped-out) probabilities and output
    /// gradient; returns `dP = dO·vᵀ` per head (`[b, heads, rows, keys]`), before dropout.
    fn values(
        &mut self,
        dims: Dims,
        rows: usize,
        dropped: FloatTensor<B>,
        grad: FloatTensor<B>,
        v: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let dv = B::batched_matmul(transposed::<B>(dropped), grad.clone());
        self.dv.add(dv, dims);
        dims.per_head::<B>(B::batched_matmul(grad, transposed::<B>(v)), rows)
    }

    /// `dq = dS·k` and `dk += (qᵀ·dS)ᵀ` from the block's grouped score gradient and queries.
    fn scores(
        &mut self,
        dims: Dims,
        rows: usize,
        d_scores: FloatTensor<B>,
        q: FloatTensor<B>,
        k: FloatTensor<B>,
    ) {
        let dq = B::batched_matmul(d_scores.clone(), k);
        self.dq.push(dims.per_head::<B>(dq, rows));
        let dk_t = B::batched_matmul(transposed::<B>(q), d_scores);
        self.dk.add(transposed::<B>(dk_t), dims);
    }

    /// `(dq [b, heads, sq, d], dk, dv)`, the key gradients in `dtype`.
    fn finish(mut self, dtype: DType) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
        let dq = match self.dq.len() {
            1 => self.dq.pop().expect("one block"),
            _ => B::float_cat(self.dq, 2),
        };
        (dq, self.dk.finish(dtype), self.dv.finish(dtype))
    }
}

/// `(dq, dk, dv)`: per block, the probabilities again, then the products of the unfused
/// composition's backward (`dv = Pᵀ·dO`, `dP = dO·vᵀ` through dropout, the softmax's
/// backward, `dq = dS·k`, `dkᵀ = qᵀ·dS`).
pub(super) fn backward<B: Parts>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    pad: BoolTensor<B>,
    padded: bool,
    grad: FloatTensor<B>,
    p: AttentionParams,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dims = Dims::of::<B>(&q, &k);
    let blocks = dims.blocks(&p);
    let mut grads = BlockGrads::<B>::new(blocks.len());
    for block in blocks {
        let Block { row0, rows, keys } = block;
        let parts = probs::<B>(dims, block, &q, &k, &v, &pad, padded, &p);
        let grad = dims.grouped::<B>(self::rows::<B>(&grad, row0, rows));
        let dropped = dims.grouped::<B>(parts.dropped);
        let mut d_probs = grads.values(dims, rows, dropped, grad, parts.v);
        if p.dropout > 0.0 {
            let window = window(row0, rows, keys, dims.sq, dims.sk);
            d_probs = B::dropout(d_probs, p.dropout, p.seed, window);
        }
        let d_scores = B::scaled_masked_softmax_backward(
            parts.probs,
            d_probs,
            parts.pad,
            padded,
            p.scale,
            p.causal,
        );
        let d_scores = dims.grouped::<B>(d_scores);
        grads.scores(dims, rows, d_scores, parts.q, parts.k);
    }
    grads.finish(k.dtype())
}

/// The dtype the statistics are kept in: f32 (f64 for f64).
fn wide(dtype: DType) -> FloatDType {
    match dtype {
        DType::F64 => FloatDType::F64,
        _ => FloatDType::F32,
    }
}

/// One block's scaled scores `[b, heads, rows, keys]` in `wide`, masked keys (causal, padded)
/// at [`MASKED_SCORE`], and the mask.
#[allow(clippy::too_many_arguments)]
fn masked_scores<B: Parts>(
    dims: Dims,
    Block { row0, rows, keys }: Block,
    q: &FloatTensor<B>,
    k: &FloatTensor<B>,
    pad: &BoolTensor<B>,
    padded: bool,
    p: &AttentionParams,
    wide: FloatDType,
) -> (FloatTensor<B>, Option<BoolTensor<B>>) {
    let device = q.device();
    let q = dims.grouped::<B>(self::rows::<B>(q, row0, rows));
    let k = self::rows::<B>(k, 0, keys);
    let scores = dims.per_head::<B>(B::batched_matmul(q, transposed::<B>(k)), rows);
    let scores = B::float_mul_scalar(cast::<B>(scores, wide), p.scale.into());
    let shape = Shape::from([dims.b, dims.heads, rows, keys]);
    let mut mask = None;
    if p.causal {
        let hidden = (0..rows * keys)
            .map(|e| e % keys + dims.sq > row0 + e / keys + dims.sk)
            .collect();
        let hidden = TensorData::new(hidden, [1, 1, rows, keys]);
        mask = Some(B::bool_expand(
            B::bool_from_data(hidden, &device),
            shape.clone(),
        ));
    }
    if padded {
        let pad = B::bool_slice(pad.clone(), &[Slice::from(..), Slice::from(0..keys)]);
        let pad = B::bool_reshape(pad, Shape::from([dims.b, 1, 1, keys]));
        let pad = B::bool_expand(pad, shape);
        mask = Some(match mask {
            Some(causal) => B::bool_or(causal, pad),
            None => pad,
        });
    }
    match mask {
        Some(mask) => (
            B::float_mask_fill(scores, mask.clone(), MASKED_SCORE.into()),
            Some(mask),
        ),
        None => (scores, None),
    }
}

/// Each query row's log-sum-exp `[b, heads, sq]` (f32; f64 for f64) of its scaled, masked
/// scores over the keys its block multiplies: the statistic flash attention keeps, from the
/// same products and masks as the rest of this schedule.
pub(super) fn log_sum_exp<B: Parts>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    pad: BoolTensor<B>,
    padded: bool,
    p: AttentionParams,
) -> FloatTensor<B> {
    let dims = Dims::of::<B>(&q, &k);
    let wide = wide(q.dtype());
    let mut parts: Vec<_> = dims
        .blocks(&p)
        .into_iter()
        .map(|block| {
            let (scores, _) = masked_scores::<B>(dims, block, &q, &k, &pad, padded, &p, wide);
            let shape = scores.shape();
            let max = B::float_max_dim(scores.clone(), 3);
            let shifted = B::float_sub(scores, B::float_expand(max.clone(), shape));
            let sum = B::float_sum_dim(B::float_exp(shifted), 3);
            B::float_add(max, B::float_log(sum))
        })
        .collect();
    let lse = match parts.len() {
        1 => parts.pop().expect("one block"),
        _ => B::float_cat(parts, 2),
    };
    B::float_reshape(lse, Shape::from([dims.b, dims.heads, dims.sq]))
}

/// `(dq, dk, dv)` from the forward's output `out` and log-sum-exp `lse` (`[b, heads, sq]`), as
/// the flash kernels form them: per block, `P = exp(S − lse)` and `D = rowsum(dO ∘ out)` in
/// f32 (f64 for f64), `dv = Pᵀ·dO` and `dP = dO·vᵀ` through dropout, `dS = P ∘ (dP − D)`
/// (zero at masked keys), `dq = dS·k`, `dkᵀ = qᵀ·dS`. With the statistics of a larger
/// attention that these keys are a part of (ring attention's merged output and
/// log-sum-exp), these are that attention's gradients through these keys.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_from_stats<B: Parts>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    pad: BoolTensor<B>,
    padded: bool,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    p: AttentionParams,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dims = Dims::of::<B>(&q, &k);
    let dtype = k.dtype();
    let wide = wide(dtype);
    let narrow = FloatDType::from(dtype);
    let lse = B::float_reshape(
        cast::<B>(lse, wide),
        Shape::from([dims.b, dims.heads, dims.sq, 1]),
    );
    let blocks = dims.blocks(&p);
    let mut grads = BlockGrads::<B>::new(blocks.len());
    for block in blocks {
        let Block { row0, rows, keys } = block;
        let (scores, mask) = masked_scores::<B>(dims, block, &q, &k, &pad, padded, &p, wide);
        let shape = scores.shape();
        let row_lse = B::float_expand(self::rows::<B>(&lse, row0, rows), shape.clone());
        let probs = B::float_exp(B::float_sub(scores, row_lse));
        let window = window(row0, rows, keys, dims.sq, dims.sk);
        let dropped = match p.dropout > 0.0 {
            true => B::dropout(probs.clone(), p.dropout, p.seed, window),
            false => probs.clone(),
        };
        let grad = self::rows::<B>(&grad, row0, rows);
        let dropped = dims.grouped::<B>(cast::<B>(dropped, narrow));
        let grad_g = dims.grouped::<B>(grad.clone());
        let (k_b, v_b) = (self::rows::<B>(&k, 0, keys), self::rows::<B>(&v, 0, keys));
        let mut d_probs = cast::<B>(grads.values(dims, rows, dropped, grad_g, v_b), wide);
        if p.dropout > 0.0 {
            d_probs = B::dropout(d_probs, p.dropout, p.seed, window);
        }
        let out_b = cast::<B>(self::rows::<B>(&out, row0, rows), wide);
        let delta = B::float_sum_dim(B::float_mul(cast::<B>(grad, wide), out_b), 3);
        let centred = B::float_sub(d_probs, B::float_expand(delta, shape));
        let mut d_scores = B::float_mul_scalar(B::float_mul(probs, centred), p.scale.into());
        if let Some(mask) = mask {
            d_scores = B::float_mask_fill(d_scores, mask, 0.0.into());
        }
        let d_scores = dims.grouped::<B>(cast::<B>(d_scores, narrow));
        let q_b = dims.grouped::<B>(self::rows::<B>(&q, row0, rows));
        grads.scores(dims, rows, d_scores, q_b, k_b);
    }
    grads.finish(dtype)
}
