//! Ring attention (`--cp-comm-type p2p`) as one op with a handwritten backward
//! (Transformer Engine's `AttnFuncWithCPAndKVP2P`: FlashAttention's recurrences, in Burn ops).
//!
//! Forward: this rank's K/V block (its two chunks) travels around the CP ring; at each step
//! the (query chunk, key chunk) blocks a causal mask leaves visible are attended with an
//! online softmax (running max, sum and unnormalised output), so the op keeps only its
//! input, its output and each query's log-sum-exp: no block's scores or probabilities.
//! Backward recomputes each block's probabilities from the log-sum-exp, and the K/V blocks
//! travel the ring again with their gradients beside them, each rank adding its share, until
//! one more shift brings every block's gradient home.
//!
//! Every exchange is posted before a step's compute and received after it. Sends never
//! wait for the receiver, so the next block is on its way while this one is attended (the
//! overlap Megatron gets from NCCL's asynchronous send/recv). Each send and receive is
//! timed in [`RingStats`](crate::context_parallel::RingStats).

use super::CoreAttention;
use crate::comm::tensor::{buffer_to_tensor, tensor_to_buffer};
use crate::comm::{Buffer, CommDType};
use crate::context_parallel::ContextParallel;
use crate::recompute::{RecomputeOps, Region, Replayed};
use crate::tensor_parallel::{RngRegion, RngTracker};
use burn::backend::Dispatch;
use burn::tensor::{Bool, Device, DispatchTensor, Tensor, TensorData};
use burn_megatron_kernels::batched_matmul;
use std::time::Instant;

/// Scores of masked keys, as Megatron fills them (fully masked rows stay finite).
const MASKED: f32 = -10_000.0;

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
    /// `[b, s]` key padding in gathered (rank) order.
    padding: Option<Tensor<2, Bool>>,
    device: Device,
}

/// Running online-softmax state of one query chunk: max, sum, unnormalised output.
type Acc = (Tensor<4>, Tensor<4>, Tensor<4>);

impl Ring {
    fn scale(&self) -> f32 {
        1.0 / (self.hn as f32).sqrt()
    }

    /// `[L, b, heads, hn]` → `[b, groups, heads/groups · L, hn]`: a group's heads stacked
    /// along the rows, so one matmul serves every head of a query group.
    fn rows(&self, x: Tensor<4>, groups: usize) -> Tensor<4> {
        let [l, b, heads, hn] = x.dims();
        x.permute([1, 2, 0, 3])
            .reshape([b, groups, heads / groups * l, hn])
    }

    /// The inverse of [`rows`](Self::rows).
    fn unrows(&self, x: Tensor<4>, heads: usize) -> Tensor<4> {
        let (b, l, hn) = (self.b, self.l, self.hn);
        x.reshape([b, heads, l, hn]).permute([2, 0, 1, 3])
    }

    /// Half `kh` of a K/V block (`[2L, b, 2·groups, hn]`) as rows: (keys, values).
    fn keys_values(&self, kv: &Tensor<4>, kh: usize) -> (Tensor<4>, Tensor<4>) {
        let half = kv.clone().narrow(0, kh * self.l, self.l);
        let k = half.clone().narrow(2, 0, self.ng);
        (
            self.rows(k, self.ng),
            self.rows(half.narrow(2, self.ng, self.ng), self.ng),
        )
    }

    /// The blocks of step `step`: the keys' owner, and each visible (query half, key half)
    /// pair with whether it lies on the diagonal.
    fn blocks(&self, step: usize) -> (usize, Vec<(usize, usize, bool)>) {
        let (cp, me) = (self.cp.size(), self.cp.rank());
        let source = (me + cp - step) % cp;
        let (queries, keys) = (self.cp.chunks(), [source, 2 * cp - 1 - source]);
        let mut visible = Vec::new();
        for (qh, &qc) in queries.iter().enumerate() {
            for (kh, &kc) in keys.iter().enumerate() {
                if !(self.causal && kc > qc) {
                    visible.push((qh, kh, self.causal && kc == qc));
                }
            }
        }
        (source, visible)
    }

    /// `[b, groups, qpg·L, L]`, true at masked keys of half `kh` of `source`'s block: above
    /// the diagonal of a diagonal block, and padded keys.
    fn mask(&self, source: usize, kh: usize, diagonal: bool) -> Option<Tensor<4, Bool>> {
        let (b, ng, l) = (self.b, self.ng, self.l);
        let rows = self.qpg * l;
        let mut mask = None;
        if diagonal {
            let above: Vec<bool> = (0..rows * l).map(|i| i % l > (i / l) % l).collect();
            let m = Tensor::<2, Bool>::from_data(TensorData::new(above, [rows, l]), &self.device);
            mask = Some(m.reshape([1, 1, rows, l]).expand([b, ng, rows, l]));
        }
        if let Some(p) = &self.padding {
            let p = p.clone().narrow(1, source * 2 * l + kh * l, l);
            let p = p.reshape([b, 1, 1, l]).expand([b, ng, rows, l]);
            mask = Some(match mask {
                Some(m) => m.bool_or(p),
                None => p,
            });
        }
        mask
    }

    /// A block's scaled, masked scores `[b, groups, qpg·L, L]`.
    fn scores(&self, q: &Tensor<4>, k: &Tensor<4>, mask: &Option<Tensor<4, Bool>>) -> Tensor<4> {
        let s = batched_matmul(q.clone(), k.clone().swap_dims(2, 3)).mul_scalar(self.scale());
        match mask {
            Some(m) => s.mask_fill(m.clone(), MASKED),
            None => s,
        }
    }

    /// The attention-dropout multiplier of the next block (0 or `1/(1−p)`), drawn from the
    /// model-parallel stream; `None` without dropout.
    fn dropout_mask(&self, like: &Tensor<4>, rng: Option<&RngTracker>) -> Option<Tensor<4>> {
        let rng = rng.filter(|_| self.dropout > 0.0)?;
        let ones = like.ones_like();
        Some(
            rng.dropout(ones, self.dropout, RngRegion::TensorModelParallel)
                .expect("attention_dropout is checked to lie in [0, 1) at init"),
        )
    }

    /// Queues `x` for the next rank of the ring (never waits for it).
    fn post(&self, x: &Tensor<4>) -> (CommDType, usize) {
        let comm = self.cp.comm();
        let buf = tensor_to_buffer(&**comm, "cp_ring_send_recv", x.clone())
            .unwrap_or_else(|e| panic!("{e}"));
        let (dtype, len) = (buf.dtype(), buf.len());
        let next = (self.cp.rank() + 1) % self.cp.size();
        let start = Instant::now();
        comm.send(buf, next).unwrap_or_else(|e| panic!("{e}"));
        self.cp.record_ring_send(start, len * dtype.size());
        (dtype, len)
    }

    /// The previous rank's block of `dims`, waiting if it has not arrived.
    fn receive(&self, (dtype, len): (CommDType, usize), dims: [usize; 4]) -> Tensor<4> {
        let cp = self.cp.size();
        let previous = (self.cp.rank() + cp - 1) % cp;
        let mut buf = Buffer::zeros(dtype, len);
        let start = Instant::now();
        self.cp
            .comm()
            .recv(&mut buf, previous)
            .unwrap_or_else(|e| panic!("{e}"));
        self.cp.record_ring_receive(start);
        buffer_to_tensor(buf, dims, &self.device)
    }

    /// The attention output `[2L, b, heads·hn]` and each query half's log-sum-exp
    /// (`[b, groups, qpg·L, 1]`).
    fn forward(
        &self,
        q: Tensor<4>,
        kv: Tensor<4>,
        rng: Option<&RngTracker>,
    ) -> (Tensor<3>, [Tensor<4>; 2]) {
        let (cp, l, ng) = (self.cp.size(), self.l, self.ng);
        let np = ng * self.qpg;
        let q: [Tensor<4>; 2] = [0, 1].map(|h| self.rows(q.clone().narrow(0, h * l, l), ng));
        let mut acc: [Option<Acc>; 2] = [None, None];
        let mut kv = kv;
        for step in 0..cp {
            let sent = (step + 1 < cp).then(|| self.post(&kv));
            let (source, blocks) = self.blocks(step);
            for (qh, kh, diagonal) in blocks {
                let (k, v) = self.keys_values(&kv, kh);
                let s = self.scores(&q[qh], &k, &self.mask(source, kh, diagonal));
                let block_max = s.clone().max_dim(3).detach();
                let (max, scale) = match &acc[qh] {
                    None => (block_max, None),
                    Some((m, _, _)) => {
                        let max = m.clone().max_pair(block_max);
                        (max.clone(), Some((m.clone() - max).exp()))
                    }
                };
                let p = (s - max.clone()).exp();
                let sum = p.clone().sum_dim(3);
                let p = match self.dropout_mask(&p, rng) {
                    Some(m) => p * m,
                    None => p,
                };
                let o = batched_matmul(p, v);
                acc[qh] = Some(match (acc[qh].take(), scale) {
                    (Some((_, l0, o0)), Some(a)) => (max, l0 * a.clone() + sum, o0 * a + o),
                    _ => (max, sum, o),
                });
            }
            if let Some(sent) = sent {
                kv = self.receive(sent, kv.dims());
            }
        }
        // Every query half sees at least its own diagonal block.
        let [a0, a1] = acc.map(|a| a.expect("each query half attends its diagonal block"));
        let finish = |(m, sum, o): Acc| {
            let out = self.unrows(o / sum.clone(), np);
            (out, m + sum.log())
        };
        let ((o0, lse0), (o1, lse1)) = (finish(a0), finish(a1));
        let out = Tensor::cat(vec![o0, o1], 0).reshape([2 * l, self.b, np * self.hn]);
        (out, [lse0, lse1])
    }

    /// The gradients of `q` (`[2L, b, heads, hn]`) and of this rank's K/V block from the
    /// output's gradient `dout`, the saved inputs, output and log-sum-exps, with `rng`
    /// replaying the forward's dropout masks.
    fn backward(
        &self,
        (q, kv, out, lse): (Tensor<4>, Tensor<4>, Tensor<3>, [Tensor<4>; 2]),
        dout: Tensor<3>,
        rng: Option<&RngTracker>,
    ) -> Tensor<4> {
        let (cp, l, ng, b, hn) = (self.cp.size(), self.l, self.ng, self.b, self.hn);
        let np = ng * self.qpg;
        let half = |x: &Tensor<3>, h: usize| {
            self.rows(x.clone().narrow(0, h * l, l).reshape([l, b, np, hn]), ng)
        };
        let q: [Tensor<4>; 2] = [0, 1].map(|h| self.rows(q.clone().narrow(0, h * l, l), ng));
        let dout: [Tensor<4>; 2] = [0, 1].map(|h| half(&dout, h));
        // FlashAttention's D = rowsum(dO ∘ O).
        let delta: [Tensor<4>; 2] = [0, 1].map(|h| (dout[h].clone() * half(&out, h)).sum_dim(3));
        let mut dq: [Option<Tensor<4>>; 2] = [None, None];
        let (mut kv, kv_dims) = (kv.clone(), kv.dims());
        let mut finished: Option<Tensor<4>> = None;
        for step in 0..cp {
            // Queued before the compute, in the order the previous rank receives them: the
            // block for the next step, then the gradient finished in the last one.
            let sent_kv = (step + 1 < cp).then(|| self.post(&kv));
            let sent_grad = finished.as_ref().map(|g| self.post(g));
            let (source, blocks) = self.blocks(step);
            let mut dk: [Option<Tensor<4>>; 2] = [None, None];
            let mut dv: [Option<Tensor<4>>; 2] = [None, None];
            for (qh, kh, diagonal) in blocks {
                let (k, v) = self.keys_values(&kv, kh);
                let mask = self.mask(source, kh, diagonal);
                let p = (self.scores(&q[qh], &k, &mask) - lse[qh].clone()).exp();
                let drop = self.dropout_mask(&p, rng);
                let kept = match &drop {
                    Some(m) => p.clone() * m.clone(),
                    None => p.clone(),
                };
                add(
                    &mut dv[kh],
                    batched_matmul(kept.swap_dims(2, 3), dout[qh].clone()),
                );
                let mut dp = batched_matmul(dout[qh].clone(), v.swap_dims(2, 3));
                if let Some(m) = drop {
                    dp = dp * m;
                }
                let mut ds = p * (dp - delta[qh].clone());
                if let Some(m) = mask {
                    ds = ds.mask_fill(m, 0.0);
                }
                let ds = ds.mul_scalar(self.scale());
                add(&mut dq[qh], batched_matmul(ds.clone(), k));
                add(
                    &mut dk[kh],
                    batched_matmul(ds.swap_dims(2, 3), q[qh].clone()),
                );
            }
            // This step's share of the gradient of `source`'s block, in its layout.
            let zeros = || Tensor::<4>::zeros([l, b, ng, hn], &self.device);
            let part = |g: Option<Tensor<4>>| g.map_or_else(zeros, |g| self.unrows(g, ng));
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
            finished = Some(match sent_grad {
                Some(sent) => self.receive(sent, kv_dims) + share,
                None => share,
            });
        }
        let last = finished.expect("a ring has at least one step");
        let sent = self.post(&last);
        let dkv = self.receive(sent, kv_dims);
        let [dq0, dq1] = dq.map(|g| {
            let g = g.expect("each query half attends its diagonal block");
            self.unrows(g, np)
        });
        Tensor::cat(vec![Tensor::cat(vec![dq0, dq1], 0), dkv], 2)
    }
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
            padding,
            device: q.device(),
        };
        let ng = self.groups_per_rank;
        let packed = Tensor::cat(vec![q, kv], 2);
        let split = |x: Tensor<4>| (x.clone().narrow(2, 0, np), x.narrow(2, np, 2 * ng));
        if !packed.is_tracked() {
            let (q, kv) = split(packed);
            return ring.forward(q, kv, rng).0;
        }
        // The backward draws the forward's dropout masks again, in the same order.
        let replay_rng = rng.map(RngTracker::fork);
        let saved = packed.clone().set_require_grad(false);
        let (q, kv) = split(saved);
        let (out, lse) = ring.forward(q.clone(), kv.clone(), rng);
        let kept = (q, kv, out.clone(), lse);
        let backward = move |grad: DispatchTensor| {
            let dout = Tensor::<3>::from_dispatch(grad);
            let input_grad = ring.backward(kept, dout, replay_rng.as_ref());
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
