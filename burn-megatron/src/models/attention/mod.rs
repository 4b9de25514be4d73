//! `ParallelAttention`: self-attention with its heads split across tensor-parallel ranks,
//! multi-head or grouped-query (`num_query_groups`), with a padding or causal mask, rotary
//! positions, and a key/value cache for decoding.

use super::TransformerLayerConfig;
use super::rotary::RotaryTables;
use crate::comm::Comm;
use crate::context_parallel::ContextParallel;
use crate::recompute::{RecomputeModule, recompute_fn};
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RngRegion, RngTracker, RowParallelLinear,
    RowParallelLinearConfig, TpError, derive_seed,
};
use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Bool, Device, Tensor};
use burn_megatron_kernels::{
    AttentionParams, FLASH_MAX_HEAD_DIM, batched_matmul, chunked_attention, flash_attention,
    scaled_masked_softmax,
};

mod context_parallel;
mod ring;

/// Which keys a query sees (Megatron's `AttnMaskType`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AttnMaskType {
    /// Every key but padded ones (BERT).
    Padding,
    /// Keys at or before the query's position, and not padded (GPT).
    Causal,
}

/// How the core attention runs (Megatron's `--attention-backend`, with the backends this
/// library has).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AttnBackend {
    /// Scores, masked softmax, dropout and weighted values as separate products and
    /// kernels, the `[b, heads, s, sk]` probabilities kept for backward.
    Unfused,
    /// `burn_megatron_kernels::chunked_attention`: the same computation a block of
    /// `attention_query_chunk` query rows at a time, nothing `[b, heads, s, sk]` kept (the
    /// backward recomputes each block's probabilities), and under a causal mask the key
    /// blocks no query of a block sees never multiplied. The same results as `Unfused` (the
    /// same bits in one block on the CPU), at one more score product per block in backward.
    Chunked,
    /// `burn_megatron_kernels::flash_attention` (Megatron's `flash`): one kernel per
    /// direction on the Cube backends (CUDA, wgpu), keeping each query row's log-sum-exp
    /// and no scores; the chunked schedule on other backends. The same results as
    /// `Unfused` within f32 summation order (softmax statistics in f32 whatever the dtype).
    Flash,
}

/// The attention's own part of a [`TransformerLayerConfig`](super::TransformerLayerConfig),
/// which holds what the attention shares with the MLP (hidden size, biases, sequence
/// parallelism, initialisation, seed) and builds the [`ParallelAttention`].
#[derive(Config, Debug)]
pub struct ParallelAttentionConfig {
    /// Attention (query) heads, divisible by the query groups and the tensor-parallel size.
    pub num_attention_heads: usize,
    /// Key/value heads (Megatron's `--num-query-groups`; grouped-query attention when fewer
    /// than the heads, multi-query at 1). `None`: one per head. Divisible by the
    /// tensor-parallel size: each rank keeps whole groups.
    #[config(default = "None")]
    pub num_query_groups: Option<usize>,
    /// Channels per head (Megatron's `kv_channels`). `None`: `hidden_size / heads`.
    #[config(default = "None")]
    pub kv_channels: Option<usize>,
    /// Padding (BERT) or causal (GPT) masking.
    #[config(default = "AttnMaskType::Padding")]
    pub attn_mask_type: AttnMaskType,
    /// A bias on the QKV projection even without the layer's `add_bias_linear` (Qwen2).
    #[config(default = false)]
    pub add_qkv_bias: bool,
    /// Dropout on the attention probabilities (drawn per TP rank: each holds other heads).
    #[config(default = 0.1)]
    pub attention_dropout: f64,
    /// How the core attention runs (`--attention-backend`): in training, decoding, and every
    /// context-parallel path. The ring exchange (`--cp-comm-type p2p`) merges its blocks by
    /// their log-sum-exps either way, attending each with the flash op under `Flash` and
    /// with Burn ops otherwise.
    #[config(default = "AttnBackend::Unfused")]
    pub attention_backend: AttnBackend,
    /// Query rows per block of [`AttnBackend::Chunked`]: its transient scores are
    /// `[b, heads / tp, attention_query_chunk, s]`.
    #[config(default = 128)]
    pub attention_query_chunk: usize,
}

/// What every layer of one forward shares besides the hidden states: the padding mask and
/// the rotary tables.
#[derive(Debug, Clone, Default)]
pub struct AttentionInputs {
    /// `[b, sk]`, true at padded keys (with a cache, over the cached keys and the new ones;
    /// under context parallelism, over the gathered keys).
    pub padding: Option<Tensor<2, Bool>>,
    /// Rotary cos/sin tables of the new tokens' positions.
    pub rotary: Option<RotaryTables>,
    /// The sequence is split over a context-parallel group.
    pub context_parallel: Option<CpAttention>,
}

/// Attention over a sequence split by context parallelism: keys and values reach every
/// rank as `cp`'s comm type says (all-gather, ring or Ulysses all-to-all); `causal` masks
/// keys after each query's global position.
#[derive(Debug, Clone)]
pub struct CpAttention {
    /// The group and this rank's positions.
    pub cp: ContextParallel,
    /// Causal (GPT) rather than bidirectional (BERT) attention.
    pub causal: bool,
}

impl AttentionInputs {
    /// Only a padding mask.
    pub fn padding(padding: Tensor<2, Bool>) -> Self {
        Self {
            padding: Some(padding),
            ..Self::default()
        }
    }
}

/// One layer's cached keys and values, `[b, groups / tp, tokens so far, head_dim]` each.
#[derive(Debug, Clone, Default)]
pub struct LayerKvCache {
    kv: Option<(Tensor<4>, Tensor<4>)>,
}

impl LayerKvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.kv.is_none()
    }
}

/// Self-attention with a fused QKV projection split by query groups
/// (`ColumnParallelLinear`) and an output projection (`RowParallelLinear`). Activations are
/// `[s, b, h]`.
///
/// The fused QKV output is laid out per query group, as Megatron-Core's `linear_qkv`:
/// `[group][its q heads…, k, v][head_dim]`, so a contiguous column split gives each rank
/// whole groups. With one group per head this is `[head][q, k, v][head_dim]`.
#[derive(Module, Debug)]
pub struct ParallelAttention {
    /// Fused query/key/value projection, `h → (heads + 2·groups)·head_dim`, split by groups.
    pub query_key_value: ColumnParallelLinear,
    /// Output projection, `heads·head_dim → h`, split by input rows.
    pub dense: RowParallelLinear,
    #[module(skip)]
    core: CoreAttention,
    #[module(skip)]
    recompute_core_attn: bool,
}

/// Attention between the QKV and output projections: rotary positions, scores, the masked
/// softmax, dropout and the weighted values. Parameter-free, so that selective
/// recomputation can replay it alone.
#[derive(Debug, Clone, Copy)]
struct CoreAttention {
    groups_per_rank: usize,
    heads_per_group: usize,
    head_dim: usize,
    causal: bool,
    attention_dropout: f64,
    backend: AttnBackend,
    /// Query rows per block of [`AttnBackend::Chunked`].
    query_chunk: usize,
}

impl ParallelAttentionConfig {
    /// The query groups (one per head when not set).
    pub fn query_groups(&self) -> usize {
        self.num_query_groups.unwrap_or(self.num_attention_heads)
    }

    /// Channels per head in a layer of width `hidden_size`.
    pub fn head_dim(&self, hidden_size: usize) -> usize {
        self.kv_channels
            .unwrap_or(hidden_size / self.num_attention_heads.max(1))
    }

    /// Checks that the heads split into groups and over `tp` ranks, and a layer of width
    /// `hidden_size` over the heads, naming the numbers.
    pub fn check(&self, hidden_size: usize, tp: usize) -> Result<(), TpError> {
        let (h, heads, groups) = (hidden_size, self.num_attention_heads, self.query_groups());
        if h == 0 || heads == 0 || groups == 0 || self.kv_channels == Some(0) {
            return Err(TpError::Invalid(format!(
                "hidden size ({h}), attention heads ({heads}), query groups ({groups}) and kv channels must all be at least 1"
            )));
        }
        if !heads.is_multiple_of(groups) {
            return Err(TpError::Indivisible(format!(
                "attention heads ({heads}) are not divisible by the query groups ({groups})"
            )));
        }
        if !heads.is_multiple_of(tp) {
            return Err(TpError::Indivisible(format!(
                "attention heads ({heads}) are not divisible by the tensor-parallel size ({tp})"
            )));
        }
        if !groups.is_multiple_of(tp) {
            return Err(TpError::Indivisible(format!(
                "query groups ({groups}) are not divisible by the tensor-parallel size ({tp}): each rank keeps whole key/value heads"
            )));
        }
        if self.attention_query_chunk == 0 {
            return Err(TpError::Invalid(
                "attention_query_chunk must be at least 1 query row".into(),
            ));
        }
        let head_dim = self.head_dim(h);
        if self.attention_backend == AttnBackend::Flash && head_dim > FLASH_MAX_HEAD_DIM {
            return Err(TpError::Invalid(format!(
                "the flash attention backend takes head dimensions up to {FLASH_MAX_HEAD_DIM}, this model's is {head_dim}"
            )));
        }
        if self.kv_channels.is_none() && !h.is_multiple_of(heads) {
            return Err(TpError::Indivisible(format!(
                "hidden size ({h}) is not divisible by the attention heads ({heads})"
            )));
        }
        Ok(())
    }

    /// Initialises this rank's query groups of `layer`'s attention (this config is
    /// `layer.attention`). Fails when the heads do not split into the groups, the groups over
    /// the TP group, or the hidden size over the heads.
    pub(crate) fn init(
        &self,
        layer: &TransformerLayerConfig,
        tp: &Comm,
        device: &Device,
    ) -> Result<ParallelAttention, TpError> {
        super::check_dropout(&[("attention_dropout", self.attention_dropout)])?;
        let size = tp.group().size();
        let h = layer.hidden_size;
        self.check(h, size)?;
        let hn = self.head_dim(h);
        let (heads, groups) = (self.num_attention_heads, self.query_groups());
        let seed = derive_seed(layer.seed, "attention");
        let query_key_value = ColumnParallelLinearConfig::new(h, (heads + 2 * groups) * hn)
            .with_bias(layer.add_bias_linear || self.add_qkv_bias)
            .with_sequence_parallel(layer.sequence_parallel)
            .with_gradient_accumulation_fusion(layer.gradient_accumulation_fusion)
            .with_initializer(layer.initializer)
            .with_seed(derive_seed(seed, "query_key_value"))
            .init(tp, device)?;
        let dense = RowParallelLinearConfig::new(heads * hn, h)
            .with_bias(layer.add_bias_linear)
            .with_sequence_parallel(layer.sequence_parallel)
            .with_gradient_accumulation_fusion(layer.gradient_accumulation_fusion)
            .with_initializer(layer.output_initializer.unwrap_or(layer.initializer))
            .with_seed(derive_seed(seed, "dense"))
            .with_skip_bias_add(true)
            .init(tp, device)?;
        Ok(ParallelAttention {
            query_key_value,
            dense,
            core: CoreAttention {
                groups_per_rank: groups / size,
                heads_per_group: heads / groups,
                head_dim: hn,
                causal: self.attn_mask_type == AttnMaskType::Causal,
                attention_dropout: self.attention_dropout,
                backend: self.attention_backend,
                query_chunk: self.attention_query_chunk,
            },
            recompute_core_attn: layer.recompute.selects(RecomputeModule::CoreAttn),
        })
    }
}

impl ParallelAttention {
    /// Attention heads held by this rank.
    pub fn heads_per_rank(&self) -> usize {
        self.core.groups_per_rank * self.core.heads_per_group
    }

    /// Key/value heads (query groups) held by this rank.
    pub fn groups_per_rank(&self) -> usize {
        self.core.groups_per_rank
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.core.head_dim
    }

    /// `[s, b, h]` → `[s, b, h]` (dim 0 split under sequence parallelism). Dropout applies
    /// when `rng` is given.
    pub fn forward(
        &self,
        x: Tensor<3>,
        inputs: &AttentionInputs,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        match self.forward_with_bias(x, inputs, rng, None) {
            (out, Some(bias)) => out + bias.unsqueeze(),
            (out, None) => out,
        }
    }

    /// Like [`forward`](Self::forward), but returns the output projection's bias instead of
    /// adding it (when the projection was built with `skip_bias_add`, as
    /// [`TransformerLayerConfig::init`] does), so the caller fuses it with dropout and the
    /// residual add. With a `cache`, the new keys and values are appended to it and the
    /// queries (the last `s` positions) attend to everything it holds.
    pub fn forward_with_bias(
        &self,
        x: Tensor<3>,
        inputs: &AttentionInputs,
        rng: Option<&RngTracker>,
        cache: Option<&mut LayerKvCache>,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        let qkv = self.query_key_value.forward(x);
        self.forward_with_bias_from_qkv(qkv, inputs, rng, cache)
    }

    /// [`forward_with_bias`](Self::forward_with_bias) from the QKV projection's output (a
    /// caller that forms it itself: `layernorm` recomputation).
    pub(crate) fn forward_with_bias_from_qkv(
        &self,
        qkv: Tensor<3>,
        inputs: &AttentionInputs,
        rng: Option<&RngTracker>,
        cache: Option<&mut LayerKvCache>,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        let core = self.core;
        let context = match cache {
            None if self.recompute_core_attn => {
                let inputs = inputs.clone();
                recompute_fn(qkv, rng, move |qkv, rng| {
                    core.forward(qkv, &inputs, rng, None)
                })
            }
            cache => core.forward(qkv, inputs, rng, cache),
        };
        self.dense.forward_with_bias(context)
    }
}

impl CoreAttention {
    /// `[s, b, groups·(qpg + 2)·hn]` QKV → `[s, b, heads·hn]` context.
    fn forward(
        self,
        qkv: Tensor<3>,
        inputs: &AttentionInputs,
        rng: Option<&RngTracker>,
        cache: Option<&mut LayerKvCache>,
    ) -> Tensor<3> {
        let [s, b, _] = qkv.dims();
        let (ng, qpg, hn) = (self.groups_per_rank, self.heads_per_group, self.head_dim);
        // [s, b, ng, qpg + 2, hn]: each group's queries, then its key and value.
        let qkv = qkv.reshape([s, b, ng, qpg + 2, hn]);
        let part = |start: usize, per_group: usize| {
            qkv.clone()
                .narrow(3, start, per_group)
                .reshape([s, b, ng * per_group, hn])
        };
        let (mut q, mut k, v) = (part(0, qpg), part(qpg, 1), part(qpg + 1, 1));
        if let Some(rotary) = &inputs.rotary {
            q = rotary.apply(q);
            k = rotary.apply(k);
        }
        if let Some(c) = &inputs.context_parallel {
            return self.forward_cp(q, k, v, c, inputs.padding.clone(), rng);
        }
        // [b, heads, s, hn].
        let (mut k, mut v) = (k.permute([1, 2, 0, 3]), v.permute([1, 2, 0, 3]));
        if let Some(cache) = cache {
            if let Some((k0, v0)) = cache.kv.take() {
                k = Tensor::cat(vec![k0, k], 2);
                v = Tensor::cat(vec![v0, v], 2);
            }
            cache.kv = Some((k.clone(), v.clone()));
        }
        self.attend(q, k, v, inputs.padding.clone(), self.causal, rng)
    }

    /// `q` (`[b, heads, s, hn]`) against `k` (`[b, groups, sk, hn]`) → `[b, heads, s, sk]`.
    /// The heads of a group share its key: one `[qpg·s, hn] × [hn, sk]` product per group,
    /// no copy of the key per head.
    fn scores(self, q: Tensor<4>, k: Tensor<4>) -> Tensor<4> {
        let [b, np, s, hn] = q.dims();
        let sk = k.dims()[2];
        let (ng, qpg) = (self.groups_per_rank, self.heads_per_group);
        let q = q.reshape([b, ng, qpg * s, hn]);
        batched_matmul(q, k.swap_dims(2, 3)).reshape([b, np, s, sk])
    }

    /// Attention dropout on `probs` (`[b, heads, s, sk]`) when training, then the weighted
    /// values of `v` (`[b, groups, sk, hn]`) → `[b, heads, s, hn]`.
    fn weighted_values(
        self,
        mut probs: Tensor<4>,
        v: Tensor<4>,
        rng: Option<&RngTracker>,
    ) -> Tensor<4> {
        let [b, np, s, sk] = probs.dims();
        let (ng, qpg, hn) = (self.groups_per_rank, self.heads_per_group, self.head_dim);
        if let Some(rng) = rng {
            // This rank's heads: a mask of its own (the model-parallel stream), drawn from a
            // seed as one kernel, no mask uploaded.
            probs = rng
                .dropout(
                    probs,
                    self.attention_dropout,
                    RngRegion::TensorModelParallel,
                )
                .expect("attention_dropout is checked to lie in [0, 1) at init");
        }
        batched_matmul(probs.reshape([b, ng, qpg * s, sk]), v).reshape([b, np, s, hn])
    }

    /// `q` (`[s, b, heads, hn]`) over `k`, `v` (`[b, groups, sk, hn]`): scores, the fused
    /// masked softmax (causal: bottom-right aligned, so queries are the last `s` of `sk`
    /// positions), dropout, weighted values → `[s, b, heads·hn]`.
    fn attend(
        self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        padding: Option<Tensor<2, Bool>>,
        causal: bool,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        let [s, b, np, hn] = q.dims();
        let scale = 1.0 / (hn as f32).sqrt();
        if self.backend != AttnBackend::Unfused {
            // The seed the unfused path's `RngTracker::dropout` would draw, where it would.
            let seed = rng.and_then(|rng| {
                rng.dropout_seed(&q, self.attention_dropout, RngRegion::TensorModelParallel)
            });
            let dropout = seed.map_or(0.0, |_| self.attention_dropout as f32);
            let params = AttentionParams {
                scale,
                causal,
                dropout,
                seed: seed.unwrap_or(0),
                query_chunk: self.query_chunk,
            };
            let q = q.permute([1, 2, 0, 3]);
            let out = match self.backend {
                AttnBackend::Flash => flash_attention(q, k, v, padding, params),
                _ => chunked_attention(q, k, v, padding, params),
            };
            return out
                .expect(
                    "shapes, masks, dropout and head dims are checked at init and by construction",
                )
                .permute([2, 0, 1, 3])
                .reshape([s, b, np * hn]);
        }
        let scores = self.scores(q.permute([1, 2, 0, 3]), k);
        // Scaled, masked keys filled with Megatron's -10000 (fully masked rows stay finite),
        // softmax: one fused kernel on GPUs.
        let probs = scaled_masked_softmax(scores, padding, scale, causal)
            .expect("scores are [b, heads, s, sk] and the padding [b, sk] by construction");
        self.weighted_values(probs, v, rng)
            .permute([2, 0, 1, 3])
            .reshape([s, b, np * hn])
    }
}
