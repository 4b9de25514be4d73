//! `plan`: what each pipeline rank of a GPT-family or BERT run will hold, before launching.
//! Pure arithmetic over `gpt_pretrain`'s or `bert_pretrain`'s flags; see `examples/plan.rs`
//! for what is reported.
//!
//! Weights, gradients and optimizer state follow Megatron-LM's `report_theoretical_memory`
//! (parameters per stage, then bytes per parameter), adapted to this library: fp32 runs
//! keep no master copy, an overlapped reduction holds the linear layers' gradients as FP32
//! main gradients in place of Burn's (as Megatron's grad buffer), and the output layer is
//! counted on the last stage even when tied (its copy).
//!
//! Activations are an inventory of the tensors this implementation keeps for backward,
//! per layer, in the spirit of Korthikanti et al.'s Table 2 but for these kernels: the
//! fused norms (LayerNorm and RMSNorm) keep their input, each linear
//! layer its (sequence-gathered) input, attention the queries, keys and values, its
//! `[b, heads, s, s]` probabilities (and their dropout, whose mask is never kept), the MLP
//! its up/gate outputs and activation. The microbatches alive at once come from walking the
//! schedule's op order, as `forward_backward_func` runs it. Under context parallelism a rank
//! holds `1/CP` of the tokens, and attention what its comm type keeps (`attention_kept`).

use crate::pretrain::{Args as BertArgs, AttentionBackend, CpCommType, GptArgs, TrainArgs};
use burn_megatron::models::{AttnBackend, NormKind, PositionEmbeddingType};
use burn_megatron::pipeline::{Pass, PipelineSchedule};
use burn_megatron::recompute::{RecomputeConfig, RecomputeGranularity, RecomputeModule};
use burn_megatron::tensor_parallel::padded_vocab_size;

/// Which model's ends the stages hold.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Model {
    /// GPT: embeddings (maybe learned positions), final norm and output layer.
    Gpt,
    /// BERT: embeddings with token types and their LayerNorm; the MLM head on `rows`
    /// positions per microbatch (the masked ones, or all), the pooler and binary head.
    Bert { rows: usize },
}

/// A run's shape and layout, read from the flags.
#[derive(Debug, Clone)]
pub struct Setup {
    model: Model,
    /// Layers of each virtual stage (`chunk·P + stage`): even, or Megatron's uneven split.
    stage_layers: Vec<usize>,
    h: usize,
    heads: usize,
    groups: usize,
    hn: usize,
    ffn: usize,
    gated: bool,
    bias: bool,
    qkv_bias: bool,
    layer_norm: bool,
    learned_positions: bool,
    max_positions: usize,
    tied: bool,
    vocab: usize,
    seq: usize,
    micro_batch: usize,
    attention_dropout: bool,
    /// `--attention-backend chunked` or `flash`: the probabilities are recomputed in
    /// backward, not kept (flash keeps a log-sum-exp per query row, 1/head_dim of the
    /// queries, left out; the ring keeps its log-sum-exps whatever this says).
    chunked_attention: bool,
    tp: usize,
    pp: usize,
    vp: usize,
    dp: usize,
    /// Context-parallel size and how K/V travel (causal attention in the GPT family,
    /// bidirectional in BERT).
    cp: usize,
    cp_comm: CpCommType,
    sp: bool,
    zero: bool,
    overlap: bool,
    recompute: RecomputeConfig,
    /// Bytes per weight, gradient and activation element (4 in fp32, 2 in bf16/fp16).
    elem: u64,
    schedule: PipelineSchedule,
}

/// What one pipeline rank holds.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    /// Pipeline rank.
    pub stage: usize,
    /// Parameters held by each of its TP ranks.
    pub parameters: u64,
    /// Bytes of weights.
    pub weight_bytes: u64,
    /// Bytes of gradients (FP32 main gradients under the overlapped reduction).
    pub gradient_bytes: u64,
    /// Bytes of optimizer state (master weights under bf16/fp16, Adam's moments), ÷ DP with
    /// the distributed optimizer.
    pub optimizer_bytes: u64,
    /// Activation bytes one microbatch keeps for backward, summed over this rank's chunks.
    pub activation_bytes: u64,
    /// The same without recomputation and sequence parallelism (for comparison).
    pub activation_bytes_plain: u64,
    /// Chunk-microbatches whose activations are alive at once (the schedule's peak).
    pub in_flight_microbatches: usize,
    /// Backward's largest transient: the replayed region, the vocabulary gradient, or one
    /// layer's parameter gradients formed before its activations are freed.
    pub transient_bytes: u64,
    /// The predicted peak.
    pub total_bytes: u64,
    /// Bytes this rank sends per step: tensor-, pipeline-, data- and context-parallel.
    pub sent_bytes: [u64; 4],
}

impl Setup {
    /// The setup `args` describe (after `args.validate()`), for a real vocabulary of
    /// `vocab_size` entries.
    pub fn new(args: &GptArgs, vocab_size: usize) -> Result<Self, String> {
        let layout = args.validate()?;
        if let Some(e) = args.moe.num_experts {
            return Err(format!(
                "plan: --num-experts {e} is not modelled yet (the experts' weights over EP, \
                 the tokens they receive, the all-to-all)"
            ));
        }
        let c = args.model_config(vocab_size)?;
        let a = &args.train;
        let t = &c.transformer;
        let heads = t.attention.num_attention_heads;
        Ok(Self {
            model: Model::Gpt,
            stage_layers: a.layers_per_virtual_stage()?,
            h: t.hidden_size,
            heads,
            groups: t.attention.query_groups(),
            hn: t.attention.head_dim(t.hidden_size),
            ffn: t.mlp.ffn_hidden_size,
            gated: t.mlp.gated_linear_unit,
            bias: t.add_bias_linear,
            qkv_bias: t.add_bias_linear || t.attention.add_qkv_bias,
            layer_norm: t.normalization == NormKind::LayerNorm,
            learned_positions: c.position_embedding_type == PositionEmbeddingType::LearnedAbsolute,
            max_positions: c.max_position_embeddings,
            tied: !c.untie_embeddings_and_output_weights,
            vocab: padded_vocab_size(
                vocab_size,
                a.make_vocab_size_divisible_by,
                a.tensor_model_parallel_size,
            ),
            seq: a.seq_length,
            micro_batch: a.micro_batch_size,
            attention_dropout: t.attention.attention_dropout > 0.0,
            chunked_attention: t.attention.attention_backend != AttnBackend::Unfused,
            tp: a.tensor_model_parallel_size,
            pp: a.pipeline_model_parallel_size,
            vp: a.num_model_chunks(),
            dp: a.data_parallel_size(),
            cp: a.context_parallel_size,
            cp_comm: a.cp_comm_type,
            sp: a.sequence_parallel_on(),
            zero: a.use_distributed_optimizer,
            overlap: a.overlap_grad_reduce,
            recompute: t.recompute.clone(),
            elem: if a.bf16 || a.fp16 { 2 } else { 4 },
            schedule: a.schedule(&layout),
        })
    }

    /// The setup of `bert_pretrain`'s `args` (after `args.validate()`), for a vocabulary of
    /// `vocab_size` entries: post-LayerNorm encoder layers with biases and GeLU, the MLM head
    /// on the masked positions (Megatron's 15%, rounded up per sample) unless
    /// `--mlm-head-all-positions`.
    pub fn new_bert(args: &BertArgs, vocab_size: usize) -> Result<Self, String> {
        let layout = args.validate()?;
        let a: &TrainArgs = &args.train;
        let (b, s, cp) = (a.micro_batch_size, a.seq_length, a.context_parallel_size);
        // Per CP rank: its share of the sequence's (masked) positions.
        let rows = if args.mlm_head_all_positions {
            b * s / cp
        } else {
            (b * (s * 15).div_ceil(100)).div_ceil(cp)
        };
        Ok(Self {
            model: Model::Bert { rows },
            stage_layers: a.layers_per_virtual_stage()?,
            h: a.hidden_size,
            heads: a.num_attention_heads,
            groups: a.num_attention_heads,
            hn: a.hidden_size / a.num_attention_heads,
            ffn: a.ffn_hidden_size.unwrap_or(4 * a.hidden_size),
            gated: false,
            bias: true,
            qkv_bias: true,
            layer_norm: true,
            learned_positions: true,
            max_positions: a.max_position_embeddings.unwrap_or(s),
            tied: true,
            vocab: padded_vocab_size(
                vocab_size,
                a.make_vocab_size_divisible_by,
                a.tensor_model_parallel_size,
            ),
            seq: s,
            micro_batch: b,
            attention_dropout: a.attention_dropout > 0.0,
            chunked_attention: a.attention_backend != AttentionBackend::Unfused,
            tp: a.tensor_model_parallel_size,
            pp: a.pipeline_model_parallel_size,
            vp: a.num_model_chunks(),
            dp: a.data_parallel_size(),
            cp: a.context_parallel_size,
            cp_comm: a.cp_comm_type,
            sp: a.sequence_parallel_on(),
            zero: a.use_distributed_optimizer,
            overlap: a.overlap_grad_reduce,
            recompute: a.recompute(),
            elem: if a.bf16 || a.fp16 { 2 } else { 4 },
            schedule: a.schedule(&layout),
        })
    }

    /// Whether the run trains in bf16/fp16 (FP32 master weights in the optimizer).
    fn mixed(&self) -> bool {
        self.elem == 2
    }

    fn layer_params(&self) -> u64 {
        let (h, t) = (self.h as u64, self.tp as u64);
        let qkv = ((self.heads + 2 * self.groups) * self.hn) as u64;
        let dense = (self.heads * self.hn) as u64;
        let up = if self.gated { 2 } else { 1 } * self.ffn as u64;
        let split = h * qkv + dense * h + up * h + self.ffn as u64 * h;
        let split_bias = u64::from(self.qkv_bias) * qkv + u64::from(self.bias) * up;
        let norms = 2 * h * if self.layer_norm { 2 } else { 1 };
        let dup_bias = u64::from(self.bias) * 2 * h;
        (split + split_bias) / t + norms + dup_bias
    }

    /// Elements one layer keeps for backward for one microbatch, and how many of them a
    /// `full` region keeps instead (its input).
    fn layer_activations(&self) -> (u64, u64) {
        let (h, t) = (self.h as u64, self.tp as u64);
        // This rank's tokens: 1/CP of the sequence.
        let tokens = (self.seq * self.micro_batch / self.cp) as u64;
        // Activations between the tensor-parallel regions, split under SP.
        let local = if self.sp { tokens / t } else { tokens };
        let norm = local * h;
        let (queries, kv, scores) = self.attention_kept();
        let (qkv, probs) = if self.recompute.selects(RecomputeModule::CoreAttn) {
            // The region keeps its input, this rank's projections.
            let heads = ((self.heads + 2 * self.groups) * self.hn) as u64 / t;
            (tokens * heads, 0)
        } else if self.cp > 1 && self.cp_comm == CpCommType::P2p {
            // The ring keeps its inputs and each query row's log-sum-exp (`scores`), whatever
            // the backend; its dropout masks are a seed per block.
            (queries + kv, scores)
        } else if self.chunked_attention {
            // The op keeps its inputs; a block's scores live only while it runs.
            (queries + kv, 0)
        } else {
            let dropout = if self.attention_dropout { 2 } else { 1 };
            (queries + kv, scores * dropout)
        };
        let context = tokens * (self.heads * self.hn) as u64 / t;
        let mlp = tokens * self.ffn as u64 / t * if self.gated { 3 } else { 2 };
        // Two norms, each with the linear input it feeds: this rank's positions under SP
        // (the column layers gather again in backward rather than keep the whole sequence);
        // recomputed (`layernorm`), a norm's region keeps only its local input. The MLP's
        // norm is not recomputed where `mlp` recomputes the whole MLP.
        let plain_norm = norm + local * h;
        let norms = self.recompute.selects(RecomputeModule::Layernorm);
        let attention_norm = if norms { local * h } else { plain_norm };
        let mlp_norm = if norms && !self.recompute.selects(RecomputeModule::Mlp) {
            local * h
        } else {
            plain_norm
        };
        let mut kept = attention_norm + mlp_norm + qkv + context + probs;
        if !self.recompute.selects(RecomputeModule::Mlp) {
            kept += mlp;
            // `mlp_act`: the activation's output (the second layer's input) is not kept.
            if self.recompute.selects(RecomputeModule::MlpAct) {
                kept -= tokens * self.ffn as u64 / t;
            }
        }
        (kept, local * h)
    }

    /// What one layer's attention keeps per microbatch without `core_attn` recomputation:
    /// the queries, the keys and values, and the softmax's `[b, heads, q, k]` scores. Under
    /// context parallelism (load-balanced chunks of `L = s / 2CP`) the visible scores per
    /// head are, causal, for its two query chunks the keys up to each chunk's end,
    /// `(2CP + 1)·L²`, and bidirectional (BERT) every key, `s²/CP`:
    /// - `all_gather`: every rank's K/V (in sequence order), and the visible scores;
    /// - `p2p`: one op with a recomputing backward keeps its input (the queries and this
    ///   rank's own K/V block) and each query's log-sum-exp, no scores;
    /// - `a2a`: the exchanged Q/K/V (the whole sequence for `1/CP` of the heads; groups
    ///   that do not split are repeated per head), and the visible scores of those heads
    ///   over the whole sequence, the same count.
    fn attention_kept(&self) -> (u64, u64, u64) {
        let t = self.tp as u64;
        let (b, s, c, hn) = (
            self.micro_batch as u64,
            self.seq as u64,
            self.cp as u64,
            self.hn as u64,
        );
        let (np, ng) = (self.heads as u64 / t, self.groups as u64 / t);
        let tokens = b * s / c;
        let l = s / (2 * c);
        if c == 1 {
            return (tokens * np * hn, tokens * 2 * ng * hn, b * np * s * s);
        }
        // a2a: the whole sequence for `np/c` heads, causal in its 2c chunks each against
        // the keys up to its end, `b·(np/c)·Σ_{i≤2c} i·l² = b·np·(2c+1)·l²`, as all_gather.
        let visible = match self.model {
            Model::Gpt => b * np * (2 * c + 1) * l * l,
            Model::Bert { .. } => b * np * s * s / c,
        };
        match self.cp_comm {
            CpCommType::AllGather => (tokens * np * hn, b * s * 2 * ng * hn, visible),
            CpCommType::P2p => (tokens * np * hn, tokens * 2 * ng * hn, tokens * np),
            CpCommType::A2a => {
                let kv_heads = if ng.is_multiple_of(c) { ng } else { np };
                (tokens * np * hn, tokens * 2 * kv_heads * hn, visible)
            }
        }
    }

    /// Elements one microbatch of a chunk of `layers` layers keeps, and the largest region
    /// its backward replays.
    fn chunk_activations(&self, layers: usize, first: bool, last: bool) -> (u64, u64) {
        let (layer, input) = self.layer_activations();
        let full = self.recompute.granularity == Some(RecomputeGranularity::Full);
        let (mut kept, mut replay) = (layers as u64 * layer, 0);
        if first && matches!(self.model, Model::Bert { .. }) {
            // The embeddings' LayerNorm's input, over the rank's whole share of the sequence.
            kept += (self.seq * self.micro_batch * self.h / self.cp) as u64;
        }
        if full {
            kept = 0;
            for (range, recomputed) in self.recompute.layer_regions(layers) {
                let n = range.len() as u64;
                if recomputed {
                    kept += input;
                    replay = replay.max(n * layer);
                } else {
                    kept += n * layer;
                }
            }
        }
        if last {
            let tokens = (self.seq * self.micro_batch / self.cp) as u64;
            let local = if self.sp {
                tokens / self.tp as u64
            } else {
                tokens
            };
            let norm = local * self.h as u64;
            // The final norm, the output layer's gathered input, the logits.
            kept += norm + tokens * self.h as u64 + tokens * (self.vocab / self.tp) as u64;
        }
        (kept, replay)
    }

    /// The plan of every pipeline rank.
    pub fn plan(&self) -> Result<Vec<StagePlan>, String> {
        (0..self.pp).map(|p| self.stage(p)).collect()
    }

    fn stage(&self, p: usize) -> Result<StagePlan, String> {
        let (h, v) = (self.h as u64, self.vp);
        let stages = self.pp * v;
        let vocab_rows = (self.vocab / self.tp) as u64 * h;
        let mut params = 0;
        let mut per_mb = Vec::new();
        // Backward's transients on top of the kept activations: a replayed region (its
        // backward forms the microbatch's gradients meanwhile), or the logits' gradient.
        let (mut replay_max, mut logits_grad) = (0u64, 0u64);
        let tokens = (self.seq * self.micro_batch / self.cp) as u64;
        for c in 0..v {
            let vs = c * self.pp + p;
            let (first, last) = (vs == 0, vs + 1 == stages);
            let per_chunk = self.stage_layers[vs];
            params += per_chunk as u64 * self.layer_params();
            if first {
                params +=
                    vocab_rows + u64::from(self.learned_positions) * self.max_positions as u64 * h;
                if let Model::Bert { .. } = self.model {
                    // Two token types and the embeddings' LayerNorm.
                    params += 2 * h + 2 * h;
                }
            }
            if last {
                params += match self.model {
                    Model::Gpt => h * if self.layer_norm { 2 } else { 1 },
                    // MLM dense + LayerNorm + bias, pooler, binary head.
                    Model::Bert { .. } => {
                        (h * h + h)
                            + 2 * h
                            + (self.vocab / self.tp) as u64
                            + (h * h + h)
                            + (2 * h + 2)
                    }
                };
                if !self.tied || !first {
                    params += vocab_rows;
                }
            }
            let (kept, replay) = self.chunk_activations(per_chunk, first, last);
            per_mb.push(kept);
            replay_max = replay_max.max(replay);
            if last {
                let rows = match self.model {
                    Model::Gpt => tokens,
                    Model::Bert { rows } => rows as u64,
                };
                logits_grad = rows * (self.vocab / self.tp) as u64;
            }
        }
        let e = self.elem;
        let weight_bytes = params * e;
        // The overlapped reducer keeps each hooked gradient as its FP32 main gradient
        // instead of Burn's copy, until the step's reduction writes it back.
        let buckets = if self.overlap { 4 * params } else { 0 };
        let gradient_bytes = if self.overlap { buckets } else { params * e };
        // Adam's two moments, and FP32 master weights under bf16/fp16; the distributed
        // optimizer keeps an FP32 master shard whatever the dtype.
        let optimizer_bytes = if self.zero {
            // Sharded over the data- and context-parallel ranks (Megatron's `dp-cp` group).
            params * 12 / (self.dp * self.cp) as u64
        } else {
            params * if self.mixed() { 12 } else { 8 }
        };
        let activation_bytes = per_mb.iter().sum::<u64>() * e;
        let plain = Setup {
            recompute: RecomputeConfig::new(),
            sp: false,
            ..self.clone()
        };
        let activation_bytes_plain = (0..v)
            .map(|c| {
                let vs = c * self.pp + p;
                plain
                    .chunk_activations(self.stage_layers[vs], vs == 0, vs + 1 == stages)
                    .0
            })
            .sum::<u64>()
            * e;
        // Gradients of earlier microbatches are summed and kept while later ones run, and a
        // backward forms the next microbatch's beside them: once a backward has run, the sum
        // is alive, and a replayed region's backward adds the new ones. The last step's
        // gradients were consumed by the optimizer before this step began.
        // Under the overlapped reduction those sums are the main gradients (`buckets`), and
        // the gradients written back at its end replace them.
        let grads = params * e;
        let held = if self.overlap { 0 } else { grads };
        // Burn's backward forms a layer's parameter gradients before that layer's saved
        // activations go: the top layer's, on every rank that holds one (measured at PP 2,
        // GPT 4 × 256, seq 256: 3.1 MB on top of the kept activations, 2.5 MB of them that
        // layer's gradients).
        let layer_grads = if self.rank_layers(p) > 0 {
            self.layer_params() * e
        } else {
            0
        };
        let transient = (logits_grad * e).max(layer_grads).max(if replay_max > 0 {
            replay_max * e + held
        } else {
            0
        });
        // The schedule's op order on this rank: the chunk-microbatches alive at each op. A
        // backward runs with its microbatch's activations still kept and its transient on
        // top; the peak may come at the activations' peak or at a later backward, fewer
        // microbatches alive beside the summed gradients (full recomputation at PP 2 with
        // two microbatches: the second backward).
        let ops = self.schedule.ops(p).map_err(|e| e.to_string())?;
        let (mut live, mut peak_count, mut count) = (0u64, 0usize, 0usize);
        let (mut backwards, mut dynamic) = (0usize, 0u64);
        for op in ops {
            let accumulated = if backwards > 0 { held } else { 0 };
            match op.pass {
                Pass::Forward => {
                    live += per_mb[op.chunk];
                    count += 1;
                    dynamic = dynamic.max(live * e + accumulated);
                }
                Pass::Backward => {
                    dynamic = dynamic.max(live * e + accumulated + transient);
                    live -= per_mb[op.chunk];
                    count -= 1;
                    backwards += 1;
                }
            }
            peak_count = peak_count.max(count);
        }
        let total_bytes = weight_bytes + buckets + optimizer_bytes + dynamic.max(grads + held);
        Ok(StagePlan {
            stage: p,
            parameters: params,
            weight_bytes,
            gradient_bytes,
            optimizer_bytes,
            activation_bytes,
            activation_bytes_plain,
            in_flight_microbatches: peak_count,
            transient_bytes: transient,
            total_bytes,
            sent_bytes: self.sent(p, params),
        })
    }

    /// Bytes rank `p` sends per step, ring collectives (`2(n−1)/n` of the buffer for an
    /// all-reduce, `(n−1)/n` for an all-gather or a reduce-scatter): tensor-, pipeline-,
    /// data- and context-parallel.
    fn sent(&self, p: usize, params: u64) -> [u64; 4] {
        let e = self.elem;
        let m = self.schedule.num_microbatches as u64;
        // Gradients are reduced over the data- and context-parallel ranks together.
        let (t, d, c) = (self.tp as u64, (self.dp * self.cp) as u64, self.cp as u64);
        let tokens = (self.seq * self.micro_batch / self.cp) as u64;
        let hidden = tokens * self.h as u64 * e;
        let layers = self.rank_layers(p) as u64;
        // Per layer and microbatch: two all-reduces forward and two backward (or their
        // all-gather/reduce-scatter halves under SP), plus the forward's again when the
        // layer is replayed in full.
        let replayed = self.recompute.granularity == Some(RecomputeGranularity::Full);
        let per_layer = (4 + if replayed { 2 } else { 0 }) * 2 * (t - 1) * hidden / t;
        let tp = layers * m * per_layer;
        // One activation forward and one gradient back per chunk and microbatch.
        let act = if self.sp { hidden / t } else { hidden };
        let pp = if self.pp > 1 {
            2 * m * self.vp as u64 * act
        } else {
            0
        };
        // FP32 gradients all-reduced, or reduce-scattered and the weights all-gathered.
        let dp = if self.zero {
            (d - 1) * params * (4 + e) / d
        } else {
            2 * (d - 1) * params * 4 / d
        };
        // Per layer and microbatch, what K/V cost over CP: all_gather gathers them forward
        // and reduce-scatters their gradients; p2p passes this rank's block CP − 1 times
        // forward, and backward the blocks CP − 1 times again and their gradients CP times
        // (the last shift brings them home); a2a exchanges
        // (CP − 1)/CP of the Q/K/V and of the context, twice each way. A replayed layer
        // (full recomputation, or core_attn, whose region holds the exchange) does its
        // forward's again.
        let kv = tokens * (2 * self.groups * self.hn) as u64 / t * e;
        let qkv = tokens * ((self.heads + 2 * self.groups) * self.hn) as u64 / t * e;
        let context = tokens * (self.heads * self.hn) as u64 / t * e;
        let (forward, backward) = match self.cp_comm {
            CpCommType::AllGather => ((c - 1) * kv, (c - 1) * kv),
            CpCommType::P2p => ((c - 1) * kv, (2 * c - 1) * kv),
            CpCommType::A2a => {
                let once = (c - 1) * (qkv + context) / c;
                (once, once)
            }
        };
        let again = replayed || self.recompute.selects(RecomputeModule::CoreAttn);
        let cp = layers * m * (forward * if again { 2 } else { 1 } + backward);
        [tp, pp, dp, cp]
    }

    /// Megatron's pipeline bubble: `(P − 1) / (V · M)` of the ideal step.
    pub fn bubble(&self) -> f64 {
        (self.pp - 1) as f64 / (self.vp * self.schedule.num_microbatches) as f64
    }

    /// Forward + backward FLOPs of one step on the busiest rank (3× the forward's
    /// multiply-adds × 2), with the forward again for what is recomputed: its layers, and the
    /// output layer on the last stage's rank. The pipeline's step waits for that rank, so an
    /// uneven split that moves layers off it is faster.
    pub fn flops_per_rank(&self) -> f64 {
        let (h, s) = (self.h as f64, self.seq as f64);
        let tokens =
            (self.seq * self.micro_batch * self.schedule.num_microbatches / self.cp) as f64;
        let qkv = ((self.heads + 2 * self.groups) * self.hn) as f64;
        let dense = (self.heads * self.hn) as f64;
        let mlp = (if self.gated { 3.0 } else { 2.0 }) * self.ffn as f64;
        let linear = h * (qkv + dense + mlp);
        let attention = 2.0 * s * dense;
        let layer = 2.0 * tokens * (linear + attention);
        let recomputed = match self.recompute.granularity {
            Some(RecomputeGranularity::Full) => layer,
            Some(RecomputeGranularity::Selective) => {
                let mut f = 0.0;
                if self.recompute.selects(RecomputeModule::CoreAttn) {
                    f += 2.0 * tokens * attention;
                }
                if self.recompute.selects(RecomputeModule::Mlp) {
                    f += 2.0 * tokens * h * mlp;
                }
                f
            }
            None => 0.0,
        };
        let head = 2.0 * tokens * h * self.vocab as f64;
        let rank = |p: usize| {
            let last = p + 1 == self.pp;
            self.rank_layers(p) as f64 * (3.0 * layer + recomputed)
                + if last { 3.0 * head } else { 0.0 }
        };
        (0..self.pp).map(rank).fold(0.0, f64::max) / self.tp as f64
    }

    /// Layers pipeline rank `p` holds, over its chunks.
    fn rank_layers(&self, p: usize) -> usize {
        burn_megatron::topology::LayerSplit::per_rank(&self.stage_layers, self.pp)[p]
    }
}
