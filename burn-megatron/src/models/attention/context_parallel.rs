//! Attention over a sequence split by context parallelism: K/V all-gathered, passed around
//! the ring, or traded for heads (Ulysses), as the group's comm type says.

use super::{CoreAttention, CpAttention};
use crate::context_parallel::CpCommType;
use crate::tensor_parallel::RngTracker;
use crate::tensor_parallel::mappings::all_to_all;
use burn::tensor::{Bool, Tensor};

impl CoreAttention {
    /// Context parallelism: every key and value of the sequence, all-gathered in one
    /// collective (keys already rotated at their own positions). Causal attention then runs
    /// per local chunk against the keys up to that chunk's end, in global order, so the
    /// fused kernel's causal mode applies and fully masked key blocks are never computed;
    /// bidirectional attention sees every gathered key (the padding follows their order).
    pub(super) fn forward_cp(
        self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        c: &CpAttention,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        let ng = self.groups_per_rank;
        match c.cp.comm_type() {
            CpCommType::P2p => {
                let kv = Tensor::cat(vec![k, v], 2);
                return self.forward_ring(q, kv, &c.cp, c.causal, padding, rng);
            }
            CpCommType::A2a => return self.forward_ulysses(q, k, v, c, padding, rng),
            CpCommType::AllGather => {}
        }
        let kv = c.cp.gather_sequence(Tensor::cat(vec![k, v], 2));
        let to_heads = |x: Tensor<4>| x.permute([1, 2, 0, 3]);
        if !c.causal {
            let (k, v) = (kv.clone().narrow(2, 0, ng), kv.narrow(2, ng, ng));
            return self.attend(q, to_heads(k), to_heads(v), padding, false, rng);
        }
        let order = c.cp.global_order(&kv.device());
        let kv = kv.select(0, order.clone());
        let padding = padding.map(|p| p.select(1, order));
        let chunks = c.cp.chunks().map(|chunk| (chunk, c.cp.chunk_length()));
        self.attend_causal_chunks(q, kv, &chunks, padding, rng)
    }

    /// Causal attention of query chunks over keys and values in sequence order (`kv`,
    /// `[s, b, 2·groups, hn]`, keys then values): `q` holds the chunks `(index, length)`
    /// one after the other, and each attends only to the keys up to its own end, so the
    /// fused kernel's causal mode applies and the key blocks above the diagonal are never
    /// computed (nor their scores kept).
    fn attend_causal_chunks(
        self,
        q: Tensor<4>,
        kv: Tensor<4>,
        chunks: &[(usize, usize)],
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        let ng = self.groups_per_rank;
        let to_heads = |x: Tensor<4>| x.permute([1, 2, 0, 3]);
        let mut start = 0;
        let parts = chunks.iter().map(|&(chunk, len)| {
            let keys = (chunk + 1) * len;
            let kv = kv.clone().narrow(0, 0, keys);
            let (k, v) = (kv.clone().narrow(2, 0, ng), kv.narrow(2, ng, ng));
            let pad = padding.clone().map(|p| p.narrow(1, 0, keys));
            let part = q.clone().narrow(0, start, len);
            start += len;
            self.attend(part, to_heads(k), to_heads(v), pad, true, rng)
        });
        Tensor::cat(parts.collect(), 0)
    }

    /// Ulysses (`--cp-comm-type a2a`): one all-to-all sends each CP peer its share of this
    /// rank's heads for this rank's tokens, so every rank then holds the whole sequence for
    /// `1/CP` of the heads and attends as the unsplit model does (causal: in sequence
    /// order, each of the 2·CP chunks against the keys up to its end, as the all-gather path
    /// attends); a second all-to-all sends the context back. Query groups that do not split
    /// over CP are first repeated to one key per head. [`Gpt`](crate::models::Gpt) checks
    /// that the heads split before any work.
    fn forward_ulysses(
        self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        c: &CpAttention,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        let (n, comm) = (c.cp.size(), c.cp.comm());
        let [len, b, np, hn] = q.dims();
        let (mut ng, mut qpg) = (self.groups_per_rank, self.heads_per_group);
        let (k, v) = if ng.is_multiple_of(n) {
            (k, v)
        } else {
            let shape = [len, b, ng, qpg, hn];
            let per_head = |x: Tensor<4>| {
                x.unsqueeze_dim::<5>(3)
                    .expand(shape)
                    .reshape([len, b, np, hn])
            };
            (ng, qpg) = (np, 1);
            (per_head(k), per_head(v))
        };
        // [len, b, n, heads/n, hn] → peer-major rows, one block of `len` per peer.
        let by_peer = |x: Tensor<4>, heads: usize| x.reshape([len, b, n, heads / n, hn]);
        let (npl, ngl) = (np / n, ng / n);
        let qkv = Tensor::cat(vec![by_peer(q, np), by_peer(k, ng), by_peer(v, ng)], 3)
            .permute([2, 0, 1, 3, 4])
            .reshape([n * len, b, npl + 2 * ngl, hn]);
        let splits = vec![len; n];
        let by_construction = "equal splits of n · len rows over the n members";
        // Every rank's tokens (gathered order) for this rank's heads.
        let mut qkv = all_to_all(qkv, &splits, &splits, comm).expect(by_construction);
        let mut padding = padding;
        let device = qkv.device();
        if c.causal {
            let order = c.cp.global_order(&device);
            qkv = qkv.select(0, order.clone());
            padding = padding.map(|p| p.select(1, order));
        }
        let core = CoreAttention {
            groups_per_rank: ngl,
            heads_per_group: qpg,
            ..self
        };
        let q = qkv.clone().narrow(2, 0, npl);
        let kv = qkv.narrow(2, npl, 2 * ngl);
        let context = if c.causal {
            // The whole sequence, cut into the 2·CP chunks of the causal split.
            let len = c.cp.chunk_length();
            let chunks: Vec<_> = (0..2 * n).map(|chunk| (chunk, len)).collect();
            let context = core.attend_causal_chunks(q, kv, &chunks, padding, rng);
            context.select(0, c.cp.gathered_order(&device))
        } else {
            let to_heads = |x: Tensor<4>| x.permute([1, 2, 0, 3]);
            let (k, v) = (kv.clone().narrow(2, 0, ngl), kv.narrow(2, ngl, ngl));
            core.attend(q, to_heads(k), to_heads(v), padding, false, rng)
        };
        // Back: this rank's tokens, every peer's heads in peer (= head) order.
        all_to_all(context, &splits, &splits, comm)
            .expect(by_construction)
            .reshape([n, len, b, npl * hn])
            .permute([1, 2, 0, 3])
            .reshape([len, b, np * hn])
    }
}
