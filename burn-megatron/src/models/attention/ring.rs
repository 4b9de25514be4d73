//! Ring attention (`--cp-comm-type p2p`) as one op with a handwritten backward
//! (Transformer Engine's `AttnFuncWithCPAndKVP2P`: FlashAttention's recurrences over blocks).
//!
//! Forward: this rank's K/V block (its two chunks) travels around the CP ring; at each step
//! every (query chunk, key chunk) block a causal mask leaves visible is attended, giving its
//! output normalised over its own keys and each row's log-sum-exp, and a query chunk's blocks
//! are merged by their log-sum-exps in f32. The op keeps its input, its output and each query's
//! log-sum-exp: no block's scores or probabilities. Backward: the K/V blocks travel the ring
//! again with their gradients beside them; each block's share of the gradients comes from the
//! merged output and log-sum-exp (`P = exp(S − lse)`, `D = rowsum(dO ∘ O)`), each rank adds
//! its share, and one more shift brings every block's gradient home.
//!
//! A block is attended by Burn ops (scores, softmax, two products), or with
//! `--attention-backend flash` by the flash attention op, one kernel per block and direction
//! on CUDA and wgpu. Attention dropout draws one seed per block from the model-parallel
//! stream, in the same order either way; both hash each element's index in the block's
//! `[b, heads, L, L]` probabilities, so both drop the same elements. The backward reuses the
//! forward's seeds.
//!
//! Every exchange is posted before a step's compute and received after it. Sends never
//! wait for the receiver, so the next block is on its way while this one is attended (the
//! overlap Megatron gets from NCCL's asynchronous send/recv). Each send and receive is
//! timed in [`RingStats`](crate::context_parallel::RingStats).

use super::{AttnBackend, CoreAttention};
use crate::comm::tensor::{recv, send};
use crate::context_parallel::ContextParallel;
use crate::recompute::{RecomputeOps, Region, Replayed};
use crate::tensor_parallel::{RngRegion, RngTracker};
use burn::backend::Dispatch;
use burn::tensor::{Bool, DType, Device, DispatchTensor, Tensor, TensorData};
use burn_megatron_kernels::{
    AttentionParams, batched_matmul, dropout, flash_attention_backward, flash_attention_with_lse,
};
use std::time::Instant;

/// Scores of masked keys, as Megatron fills them (fully masked rows stay finite).
const MASKED: f32 = -10_000.0;

/// What is checked before a ring runs, for the `expect`s of its block ops.
const CHECKED: &str = "shapes, dropout and head dims are checked at init and by construction";

/// One layer's ring: the group, the geometry, and the key padding.
#[derive(Clone)]
struct Ring {
    cp: ContextParallel,
    /// Query groups, heads per group, channels per head.
    ng: usize,
    qpg: usize,
    hn: usize,
    /// Batch and chunk length (`s / 2CP`).
    b: usize,
    l: usize,
    causal: bool,
    dropout: f64,
    /// Blocks through the flash attention op rather than Burn ops.
    flash: bool,
    /// `[b, s]` key padding in gathered (rank) order.
    padding: Option<Tensor<2, Bool>>,
    device: Device,
}

/// One visible block of a step: query half `qh` against half `kh` of `source`'s K/V block.
#[derive(Clone, Copy)]
struct Block {
    qh: usize,
    kh: usize,
    source: usize,
    /// On the causal diagonal (query and key chunk the same).
    diagonal: bool,
}

/// A query half's blocks merged so far: output (`[b, heads, L, hn]`) and log-sum-exp
/// (`[b, heads, L]`), both f32.
type Merged = (Tensor<4>, Tensor<3>);

/// What the backward reads: the inputs, the output, each query half's log-sum-exp, and the
/// dropout seed of every block in the order they were attended.
struct Saved {
    q: Tensor<4>,
    kv: Tensor<4>,
    out: Tensor<3>,
    lse: [Tensor<3>; 2],
    seeds: Vec<Option<u64>>,
}

impl Ring {
    fn scale(&self) -> f32 {
        1.0 / (self.hn as f32).sqrt()
    }

    /// Half `h` of `[2L, b, heads, hn]` as `[b, heads, L, hn]`.
    fn half(&self, x: &Tensor<4>, h: usize) -> Tensor<4> {
        x.clone()
            .narrow(0, h * self.l, self.l)
            .permute([1, 2, 0, 3])
    }

    /// `[b, heads, L, hn]` → `[b, groups, heads/groups · L, hn]`: a group's heads stacked
    /// along the rows, so that one product serves every head of a query group.
    fn rows(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, heads, l, hn] = x.dims();
        x.reshape([b, self.ng, heads / self.ng * l, hn])
    }

    /// Half `kh` of a K/V block (`[2L, b, 2·groups, hn]`): keys and values `[b, groups, L, hn]`.
    fn keys_values(&self, kv: &Tensor<4>, kh: usize) -> (Tensor<4>, Tensor<4>) {
        let half = self.half(kv, kh);
        (
            half.clone().narrow(1, 0, self.ng),
            half.narrow(1, self.ng, self.ng),
        )
    }

    /// The blocks of step `step`: those of the keys of rank `(me − step) mod CP` that a causal
    /// mask leaves visible.
    fn blocks(&self, step: usize) -> Vec<Block> {
        let (cp, me) = (self.cp.size(), self.cp.rank());
        let source = (me + cp - step) % cp;
        let (queries, keys) = (self.cp.chunks(), [source, 2 * cp - 1 - source]);
        let mut visible = Vec::new();
        for (qh, &qc) in queries.iter().enumerate() {
            for (kh, &kc) in keys.iter().enumerate() {
                if !(self.causal && kc > qc) {
                    let diagonal = self.causal && kc == qc;
                    visible.push(Block {
                        qh,
                        kh,
                        source,
                        diagonal,
                    });
                }
            }
        }
        visible
    }

    /// `[b, L]`: the padding of the block's keys.
    fn key_padding(&self, blk: Block) -> Option<Tensor<2, Bool>> {
        let start = blk.source * 2 * self.l + blk.kh * self.l;
        self.padding.clone().map(|p| p.narrow(1, start, self.l))
    }

    /// `[b, groups, qpg·L, L]`, true at the block's masked keys: above the diagonal of a
    /// diagonal block, and padded keys.
    fn mask(&self, blk: Block) -> Option<Tensor<4, Bool>> {
        let (b, ng, l) = (self.b, self.ng, self.l);
        let rows = self.qpg * l;
        let mut mask = None;
        if blk.diagonal {
            let above: Vec<bool> = (0..rows * l).map(|i| i % l > (i / l) % l).collect();
            let m = Tensor::<2, Bool>::from_data(TensorData::new(above, [rows, l]), &self.device);
            mask = Some(m.reshape([1, 1, rows, l]).expand([b, ng, rows, l]));
        }
        if let Some(p) = self.key_padding(blk) {
            let p = p.reshape([b, 1, 1, l]).expand([b, ng, rows, l]);
            mask = Some(match mask {
                Some(m) => m.bool_or(p),
                None => p,
            });
        }
        mask
    }

    /// The flash op's parameters for a block (its diagonal is an ordinary causal square).
    fn params(&self, blk: Block, seed: Option<u64>) -> AttentionParams {
        AttentionParams {
            causal: blk.diagonal,
            dropout: seed.map_or(0.0, |_| self.dropout as f32),
            seed: seed.unwrap_or(0),
            ..AttentionParams::new(self.scale())
        }
    }

    /// A block's scaled, masked scores `[b, groups, qpg·L, L]` from grouped queries.
    fn scores(&self, q: &Tensor<4>, k: &Tensor<4>, mask: &Option<Tensor<4, Bool>>) -> Tensor<4> {
        let s = batched_matmul(q.clone(), k.clone().swap_dims(2, 3)).mul_scalar(self.scale());
        match mask {
            Some(m) => s.mask_fill(m.clone(), MASKED),
            None => s,
        }
    }

    /// The dropout multiplier (0 or `1/(1−p)`) of `seed`'s mask over `like`'s elements.
    fn keep(&self, like: &Tensor<4>, seed: Option<u64>) -> Option<Tensor<4>> {
        seed.map(|seed| dropout(like.ones_like(), self.dropout as f32, seed).expect(CHECKED))
    }

    /// One block's output over its own keys (`[b, heads, L, hn]`) and log-sum-exp
    /// (`[b, heads, L]`), for queries `q` (`[b, heads, L, hn]`).
    fn attend(
        &self,
        q: &Tensor<4>,
        kv: &Tensor<4>,
        blk: Block,
        seed: Option<u64>,
    ) -> (Tensor<4>, Tensor<3>) {
        let (k, v) = self.keys_values(kv, blk.kh);
        if self.flash {
            let (q, padding, params) = (q.clone(), self.key_padding(blk), self.params(blk, seed));
            return flash_attention_with_lse(q, k, v, padding, params).expect(CHECKED);
        }
        let [b, np, l, hn] = q.dims();
        let s = self.scores(&self.rows(q.clone()), &k, &self.mask(blk));
        let max = s.clone().max_dim(3);
        let p = (s - max.clone()).exp();
        let sum = p.clone().sum_dim(3);
        let p = match self.keep(&p, seed) {
            Some(m) => p * m,
            None => p,
        };
        let o = batched_matmul(p, v) / sum.clone();
        (
            o.reshape([b, np, l, hn]),
            (max + sum.log()).reshape([b, np, l]),
        )
    }

    /// A block's share `(dq, dk, dv)` of the gradients, from the query half's merged output
    /// `out`, log-sum-exp `lse` and output gradient `dout` (all `[b, heads, L, ·]`); `delta`
    /// is `rowsum(dout ∘ out)` as grouped rows (the Burn-op blocks; the flash op forms it).
    fn gradients(
        &self,
        (q, out, lse, dout): (&Tensor<4>, &Tensor<4>, &Tensor<3>, &Tensor<4>),
        delta: Option<&Tensor<4>>,
        kv: &Tensor<4>,
        blk: Block,
        seed: Option<u64>,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let (k, v) = self.keys_values(kv, blk.kh);
        let params = self.params(blk, seed);
        let Some(delta) = delta else {
            let (q, out, lse, dout) = (q.clone(), out.clone(), lse.clone(), dout.clone());
            let padding = self.key_padding(blk);
            return flash_attention_backward(q, k, v, padding, out, lse, dout, params)
                .expect(CHECKED);
        };
        let [b, np, l, hn] = q.dims();
        let (q, dout) = (self.rows(q.clone()), self.rows(dout.clone()));
        let lse = lse.clone().reshape([b, self.ng, np / self.ng * l, 1]);
        let mask = self.mask(blk);
        let s = self.scores(&q, &k, &mask);
        let p = (s.clone() - lse.cast(s.dtype())).exp();
        let keep = self.keep(&p, seed);
        let kept = match &keep {
            Some(m) => p.clone() * m.clone(),
            None => p.clone(),
        };
        let dv = batched_matmul(kept.swap_dims(2, 3), dout.clone());
        let mut dp = batched_matmul(dout, v.swap_dims(2, 3));
        if let Some(m) = keep {
            dp = dp * m;
        }
        let mut ds = p * (dp - delta.clone());
        if let Some(m) = mask {
            ds = ds.mask_fill(m, 0.0);
        }
        let ds = ds.mul_scalar(self.scale());
        let dq = batched_matmul(ds.clone(), k).reshape([b, np, l, hn]);
        let dk = batched_matmul(ds.swap_dims(2, 3), q);
        (dq, dk, dv)
    }

    /// Queues `x` for the next rank of the ring (never waits for it): from device memory
    /// for CUDA tensors over NCCL, else through host memory. Returns its dtype, for the
    /// matching [`receive`](Self::receive).
    fn post(&self, x: &Tensor<4>) -> DType {
        let (cp, rank) = (self.cp.size(), self.cp.rank());
        let (next, previous) = ((rank + 1) % cp, (rank + cp - 1) % cp);
        let bytes = x.shape().num_elements() * x.dtype().size();
        let start = Instant::now();
        // Every member sends first: the channels open in the group's order, not the ring's
        // (see `Communicator::connect`).
        let comm = self.cp.comm();
        comm.connect(&[next, previous])
            .unwrap_or_else(|e| panic!("{e}"));
        send(&**comm, x.clone(), next).unwrap_or_else(|e| panic!("{e}"));
        self.cp.record_ring_send(start, bytes);
        x.dtype()
    }

    /// The previous rank's block of `dims` and `dtype`, waiting if it has not arrived.
    fn receive(&self, dtype: DType, dims: [usize; 4]) -> Tensor<4> {
        let cp = self.cp.size();
        let previous = (self.cp.rank() + cp - 1) % cp;
        let start = Instant::now();
        let comm = self.cp.comm();
        let t =
            recv(&**comm, dims, dtype, &self.device, previous).unwrap_or_else(|e| panic!("{e}"));
        self.cp.record_ring_receive(start);
        t
    }

    /// The attention output `[2L, b, heads·hn]`, each query half's log-sum-exp and the
    /// blocks' dropout seeds (drawn from `rng`'s model-parallel stream).
    fn forward(&self, q: Tensor<4>, kv: Tensor<4>, rng: Option<&RngTracker>) -> Saved {
        let (cp, l, b, np, hn) = (self.cp.size(), self.l, self.b, self.ng * self.qpg, self.hn);
        let dtype = q.dtype();
        let halves: [Tensor<4>; 2] = [0, 1].map(|h| self.half(&q, h));
        let mut merged: [Option<Merged>; 2] = [None, None];
        let mut seeds = Vec::new();
        let mut next = kv.clone();
        for step in 0..cp {
            let sent = (step + 1 < cp).then(|| self.post(&next));
            for blk in self.blocks(step) {
                let q = &halves[blk.qh];
                let seed = rng
                    .and_then(|r| r.dropout_seed(q, self.dropout, RngRegion::TensorModelParallel));
                seeds.push(seed);
                let part = self.attend(q, &next, blk, seed);
                merged[blk.qh] = Some(merge(merged[blk.qh].take(), part));
            }
            if let Some(sent) = sent {
                next = self.receive(sent, next.dims());
            }
        }
        // Every query half sees at least its own diagonal block.
        let [(o0, lse0), (o1, lse1)] =
            merged.map(|m| m.expect("each query half attends its diagonal block"));
        let unheads = |o: Tensor<4>| o.cast(dtype).permute([2, 0, 1, 3]);
        let out = Tensor::cat(vec![unheads(o0), unheads(o1)], 0).reshape([2 * l, b, np * hn]);
        Saved {
            q,
            kv,
            out,
            lse: [lse0, lse1],
            seeds,
        }
    }

    /// The gradients of `q` and of this rank's K/V block (`[2L, b, heads + 2·groups, hn]`)
    /// from the output's gradient `dout`. The blocks' gradients are summed in f32 where the
    /// sums are local (`dq` over every step, a step's `dk`, `dv`); the K/V gradients travel
    /// the ring in the inputs' dtype, rounded once per hop, so that the backward sends no
    /// more bytes than the forward's blocks.
    fn backward(&self, saved: Saved, dout: Tensor<3>) -> Tensor<4> {
        let (cp, l, ng, b, hn) = (self.cp.size(), self.l, self.ng, self.b, self.hn);
        let np = ng * self.qpg;
        let heads = |x: Tensor<3>| x.reshape([2 * l, b, np, hn]);
        let (out, dout) = (heads(saved.out), heads(dout));
        let q: [Tensor<4>; 2] = [0, 1].map(|h| self.half(&saved.q, h));
        let out: [Tensor<4>; 2] = [0, 1].map(|h| self.half(&out, h));
        let dout: [Tensor<4>; 2] = [0, 1].map(|h| self.half(&dout, h));
        // FlashAttention's D = rowsum(dO ∘ O), once per half for the Burn-op blocks.
        let delta: Option<[Tensor<4>; 2]> = (!self.flash)
            .then(|| [0, 1].map(|h| self.rows((dout[h].clone() * out[h].clone()).sum_dim(3))));
        let mut seeds = saved.seeds.into_iter();
        let mut dq: [Option<Tensor<4>>; 2] = [None, None];
        let (mut kv, kv_dims, dtype) = (saved.kv.clone(), saved.kv.dims(), saved.kv.dtype());
        let mut finished: Option<Tensor<4>> = None;
        for step in 0..cp {
            // Queued before the compute, in the order the previous rank receives them: the
            // block for the next step, then the gradient finished in the last one.
            let sent_kv = (step + 1 < cp).then(|| self.post(&kv));
            let sent_grad = finished.as_ref().map(|g| self.post(g));
            let mut dk: [Option<Tensor<4>>; 2] = [None, None];
            let mut dv: [Option<Tensor<4>>; 2] = [None, None];
            for blk in self.blocks(step) {
                let seed = seeds
                    .next()
                    .expect("the backward visits the forward's blocks");
                let h = blk.qh;
                let half = (&q[h], &out[h], &saved.lse[h], &dout[h]);
                let d = delta.as_ref().map(|d| &d[h]);
                let (dq_b, dk_b, dv_b) = self.gradients(half, d, &kv, blk, seed);
                add(&mut dq[h], dq_b.cast(DType::F32));
                add(&mut dk[blk.kh], dk_b.cast(DType::F32));
                add(&mut dv[blk.kh], dv_b.cast(DType::F32));
            }
            // This step's share of the gradient of the block's owner, in its layout.
            let zeros = || Tensor::<4>::zeros([b, ng, l, hn], &self.device).cast(DType::F32);
            let part = |g: Option<Tensor<4>>| g.unwrap_or_else(zeros).permute([2, 0, 1, 3]);
            let [dk0, dk1] = dk;
            let [dv0, dv1] = dv;
            let share = Tensor::cat(
                vec![
                    Tensor::cat(vec![part(dk0), part(dv0)], 2),
                    Tensor::cat(vec![part(dk1), part(dv1)], 2),
                ],
                0,
            );
            if let Some(sent) = sent_kv {
                kv = self.receive(sent, kv_dims);
            }
            let sum = match sent_grad {
                Some(sent) => self.receive(sent, kv_dims).cast(DType::F32) + share,
                None => share,
            };
            finished = Some(sum.cast(dtype));
        }
        let last = finished.expect("a ring has at least one step");
        let sent = self.post(&last);
        let dkv = self.receive(sent, kv_dims).cast(dtype);
        let [dq0, dq1] = dq.map(|g| {
            g.expect("each query half attends its diagonal block")
                .cast(dtype)
                .permute([2, 0, 1, 3])
        });
        Tensor::cat(vec![Tensor::cat(vec![dq0, dq1], 0), dkv], 2)
    }
}

/// `acc` and one more block's `(output, log-sum-exp)` over other keys of the same queries:
/// each weighted by its share of the merged softmax's denominator, in f32.
fn merge(acc: Option<Merged>, (o, lse): (Tensor<4>, Tensor<3>)) -> Merged {
    let (o, lse) = (o.cast(DType::F32), lse.cast(DType::F32));
    let Some((o0, lse0)) = acc else {
        return (o, lse);
    };
    let max = lse0.clone().max_pair(lse.clone());
    let (w0, w1) = ((lse0 - max.clone()).exp(), (lse - max.clone()).exp());
    let total = w0.clone() + w1.clone();
    let weight = |w: Tensor<3>| (w / total.clone()).unsqueeze_dim::<4>(3);
    let o = o0 * weight(w0) + o * weight(w1);
    (o, max + total.log())
}

fn add(acc: &mut Option<Tensor<4>>, x: Tensor<4>) {
    *acc = Some(match acc.take() {
        Some(a) => a + x,
        None => x,
    });
}

impl CoreAttention {
    /// Ring attention over `q` (`[2L, b, heads, hn]`, this rank's two query chunks) and
    /// this rank's K/V block `kv` (`[2L, b, 2·groups, hn]`, keys then values), `padding`
    /// (`[b, s]`) in gathered order → `[2L, b, heads·hn]`. See the module documentation.
    pub(super) fn forward_ring(
        self,
        q: Tensor<4>,
        kv: Tensor<4>,
        cp: &ContextParallel,
        causal: bool,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        let [_, b, np, hn] = q.dims();
        let ring = Ring {
            cp: cp.clone(),
            ng: self.groups_per_rank,
            qpg: self.heads_per_group,
            hn,
            b,
            l: cp.chunk_length(),
            causal,
            dropout: self.attention_dropout,
            flash: self.backend == AttnBackend::Flash,
            padding,
            device: q.device(),
        };
        let ng = self.groups_per_rank;
        let packed = Tensor::cat(vec![q, kv], 2);
        let split = |x: Tensor<4>| (x.clone().narrow(2, 0, np), x.narrow(2, np, 2 * ng));
        if !packed.is_tracked() {
            let (q, kv) = split(packed);
            return ring.forward(q, kv, rng).out;
        }
        let (q, kv) = split(packed.clone().set_require_grad(false));
        let saved = ring.forward(q, kv, rng);
        let out = saved.out.clone();
        let backward = move |grad: DispatchTensor| {
            let dout = Tensor::<3>::from_dispatch(grad);
            let input_grad = ring.backward(saved, dout);
            Replayed {
                input_grad: Some(input_grad.inner().into_dispatch()),
                params: Vec::new(),
            }
        };
        Tensor::from_dispatch(Dispatch::recompute_region(
            out.into_dispatch(),
            packed.clone().into_dispatch(),
            packed.into_dispatch(),
            Region::new(Box::new(backward)),
        ))
    }
}
