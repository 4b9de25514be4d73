//! Burn's `nn::attention::MultiHeadAttention`, with its config, input and output, built
//! from [`Linear`]s a plan can split: `TpPlan::encoder` on it (or on a
//! [`TransformerEncoder`](super::transformer::TransformerEncoder) holding it) makes the
//! query, key and value column-parallel, each rank computing `n_heads / tp` heads, and the
//! output row-parallel, which sums the heads' contributions over the ranks. Self- and
//! cross-attention alike; the masks apply whole to every rank's heads. Burn's
//! [`CrossAttention`] (a context of another width, grouped-query heads) splits the same way.

use super::super::slot::TpSlot;
use super::cache::{TensorCache, cached};
use super::transformer::drop;
use super::{Linear, LinearConfig, Region};
use crate::tensor_parallel::RngRegion;
use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Gelu, Initializer};
use burn::tensor::activation::{quiet_softmax, softmax};
use burn::tensor::{Bool, Device, Tensor};

/// The rest of Burn's `nn::attention` (the mask builders), so that an import of it swaps
/// whole.
pub use burn::nn::attention::*;
pub use cross_attention::{CrossAttention, CrossAttentionCache, CrossAttentionConfig};

mod cross_attention;

/// Burn's `MultiHeadAttentionConfig`, field for field.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// The size of each linear layer.
    pub d_model: usize,
    /// The number of heads.
    pub n_heads: usize,
    /// The attention probabilities' dropout rate.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The score masked positions get.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Softmax with an extra zero logit (a head may attend to nothing).
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers (Burn's default).
    #[config(default = "burn::nn::attention::MultiHeadAttentionConfig::new(1, 1).initializer")]
    pub initializer: Initializer,
    /// A bias on the key layer.
    #[config(default = true)]
    pub key_bias: bool,
    /// A bias on the value layer.
    #[config(default = true)]
    pub value_bias: bool,
    /// A bias on the query layer.
    #[config(default = true)]
    pub query_bias: bool,
    /// A bias on the output layer.
    #[config(default = true)]
    pub output_bias: bool,
}

impl MultiHeadAttentionConfig {
    /// The layer on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        let linear = |bias| {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(self.initializer.clone())
                .with_bias(bias)
                .init(device)
        };
        MultiHeadAttention {
            query: linear(self.query_bias),
            key: linear(self.key_bias),
            value: linear(self.value_bias),
            output: linear(self.output_bias),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Gelu::new(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads.max(1),
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
            tp: TpSlot::attention(self.n_heads),
        }
    }
}

/// Burn's `MultiHeadAttention`; split, each rank holds `n_heads / tp` heads.
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// Query projection.
    pub query: Linear,
    /// Key projection.
    pub key: Linear,
    /// Value projection.
    pub value: Linear,
    /// Output projection.
    pub output: Linear,
    /// The attention probabilities' dropout.
    pub dropout: Dropout,
    /// Unused in the forward pass, as in Burn's.
    pub activation: Gelu,
    /// The size of the model.
    pub d_model: usize,
    /// The attention heads (all ranks').
    pub n_heads: usize,
    /// Channels per head.
    pub d_k: usize,
    /// The score masked positions get.
    pub min_float: f64,
    /// Quiet softmax.
    pub quiet_softmax: bool,
    pub(super) tp: TpSlot,
}

/// Burn's `MhaInput`: the query, key and value, and the masks.
#[derive(Debug, Clone)]
pub struct MhaInput {
    pub(in crate::dropin) query: Tensor<3>,
    pub(in crate::dropin) key: Tensor<3>,
    pub(in crate::dropin) value: Tensor<3>,
    pub(in crate::dropin) mask_pad: Option<Tensor<2, Bool>>,
    pub(in crate::dropin) mask_attn: Option<Tensor<3, Bool>>,
}

impl MhaInput {
    /// Self-attention over `tensor` (`[b, s, d_model]`).
    pub fn self_attn(tensor: Tensor<3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    /// Attention of `query` (`[b, s_q, d_model]`) over `key` and `value` (`[b, s_k,
    /// d_model]`).
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self {
            query,
            key,
            value,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// Keys to ignore, `[b, s_k]` (true: padding).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Query-key pairs to ignore, `[b, s_q, s_k]`.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// The masks a transformer layer's input carries, each if it has one.
    pub(in crate::dropin) fn masks(
        mut self,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Self {
        (self.mask_pad, self.mask_attn) = (mask_pad, mask_attn);
        self
    }
}

/// Burn's `MhaOutput`.
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// The attention probabilities after dropout, as Burn's, `[b, heads, s_q, s_k]`: this
    /// rank's heads once split.
    pub weights: Tensor<4>,
    /// `[b, s_q, d_model]`, whole on every rank.
    pub context: Tensor<3>,
}

impl MultiHeadAttention {
    /// Burn's forward: the context of every query and the attention probabilities.
    ///
    /// # Panics
    ///
    /// When the heads do not split over the ranks the layers were split over (Burn's forward
    /// has no room for an error; a plan's sizes already split the width), or on inputs of
    /// another width than `d_model` (as Burn's).
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        self.attend(input, None)
    }

    /// Burn's `forward_cache`: one step of autoregressive decoding, each call's query (and,
    /// in self-attention, key and value) one position longer than the last, only the new
    /// position projected; a cross-attention cache projects the memory once.
    ///
    /// # Panics
    ///
    /// As [`forward`](Self::forward).
    pub fn forward_cache(&self, input: MhaInput, cache: &mut MhaCache) -> MhaOutput {
        self.attend(input, Some(cache))
    }

    /// The attention, its projections made here (through `cache` when decoding).
    pub(super) fn attend(&self, input: MhaInput, cache: Option<&mut MhaCache>) -> MhaOutput {
        let project = |l: &Linear, x: Tensor<3>| self.split_heads(l.forward(x));
        let q_of = |x| project(&self.query, x);
        let k_of = |x| project(&self.key, x);
        let v_of = |x| project(&self.value, x);
        let (q, k, v, output) = match cache {
            None => (q_of(input.query), k_of(input.key), v_of(input.value), None),
            Some(c) => {
                let q = c.query.forward_autoregressive(input.query, 2, q_of);
                let (k, v) = match c.fixed_memory {
                    true => (
                        c.key.forward_full(input.key, k_of),
                        c.value.forward_full(input.value, v_of),
                    ),
                    false => (
                        c.key.forward_autoregressive(input.key, 2, k_of),
                        c.value.forward_autoregressive(input.value, 2, v_of),
                    ),
                };
                (q, k, v, Some(&mut c.output))
            }
        };
        let masks = (input.mask_pad, input.mask_attn);
        self.core(q, k, v, masks, output, Region::Tensor)
    }

    /// The attention over projections made by the caller (`[b, s, heads / tp · d_k]`, each
    /// rank's heads), its output in `region`: under sequence parallelism the layer projects
    /// the query (and in self-attention the key and value) from the gathered sequence, and
    /// the output is reduce-scattered to this rank's positions.
    pub(super) fn attend_projected(
        &self,
        [q, k, v]: [Tensor<3>; 3],
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
        region: Region,
    ) -> MhaOutput {
        let [q, k, v] = [q, k, v].map(|x| self.split_heads(x));
        self.core(q, k, v, (mask_pad, mask_attn), None, region)
    }

    /// This rank's heads: the heads split over the ranks.
    ///
    /// # Panics
    ///
    /// When they do not split (see [`forward`](Self::forward)).
    fn heads(&self) -> usize {
        let tp = self.query.tp_size();
        assert!(
            self.n_heads.is_multiple_of(tp),
            "MultiHeadAttention: {} heads do not split over {tp} tensor-parallel ranks",
            self.n_heads
        );
        self.n_heads / tp
    }

    /// `[b, s, heads · d_k]` → `[b, heads, s, d_k]`, this rank's heads.
    fn split_heads(&self, x: Tensor<3>) -> Tensor<4> {
        to_heads(x, self.heads(), self.d_k)
    }

    /// Scores, probabilities, their dropout and the output projection (through `output`'s
    /// cache when decoding) of this rank's heads.
    fn core(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        (mask_pad, mask_attn): (Option<Tensor<2, Bool>>, Option<Tensor<3, Bool>>),
        output: Option<&mut TensorCache<3>>,
        region: Region,
    ) -> MhaOutput {
        let [b, heads, s_q, _] = q.dims();
        let scores = q.matmul(k.transpose()).div_scalar((self.d_k as f32).sqrt());
        let weights = attention_probs(
            scores,
            mask_pad,
            mask_attn,
            self.min_float,
            self.quiet_softmax,
        );
        // Each rank holds other heads: their masks differ.
        let weights = drop(
            &self.dropout,
            &self.tp,
            weights,
            RngRegion::TensorModelParallel,
        );
        let context = weights
            .clone()
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, s_q, heads * self.d_k]);
        MhaOutput {
            weights,
            context: cached(output, context, 1, |x| self.output.run(x, region)),
        }
    }
}

/// Burn's `MhaCache`: the projections of the positions decoded so far.
#[derive(Debug, Clone)]
pub struct MhaCache {
    query: TensorCache<4>,
    key: TensorCache<4>,
    value: TensorCache<4>,
    output: TensorCache<3>,
    /// The keys and values are a fixed memory's (cross-attention), projected once.
    fixed_memory: bool,
}

impl MhaCache {
    /// A cache for self-attention in autoregressive decoding.
    pub fn autoregressive() -> Self {
        Self {
            query: TensorCache::empty(),
            key: TensorCache::empty(),
            value: TensorCache::empty(),
            output: TensorCache::empty(),
            fixed_memory: false,
        }
    }

    /// A cache for cross-attention over a fixed memory in autoregressive decoding.
    pub fn autoregressive_cross_attention() -> Self {
        Self {
            fixed_memory: true,
            ..Self::autoregressive()
        }
    }
}

/// `[b, s, heads · d]` → `[b, heads, s, d]`.
fn to_heads(x: Tensor<3>, heads: usize, d: usize) -> Tensor<4> {
    let [b, s, _] = x.dims();
    x.reshape([b, s, heads, d]).swap_dims(1, 2)
}

/// Burn's attention probabilities: `scores` `[b, heads, s_q, s_k]` filled with `min_float`
/// where `mask_pad` `[b, s_k]` or `mask_attn` `[b, s_q, s_k]` is true, then softmax (or quiet
/// softmax) over the keys. Heads are independent, so a rank's heads take the whole masks.
fn attention_probs(
    mut scores: Tensor<4>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
    min_float: f64,
    quiet: bool,
) -> Tensor<4> {
    if let Some(mask) = mask_pad {
        let [b, s] = mask.dims();
        scores = scores.mask_fill(mask.reshape([b, 1, 1, s]), min_float);
    }
    if let Some(mask) = mask_attn {
        let [b, s_q, s_k] = mask.dims();
        scores = scores.mask_fill(mask.reshape([b, 1, s_q, s_k]), min_float);
    }
    match quiet {
        true => quiet_softmax(scores, 3),
        false => softmax(scores, 3),
    }
}

impl From<burn::nn::attention::MultiHeadAttention> for MultiHeadAttention {
    /// Burn's built layer, its parameters kept.
    fn from(mha: burn::nn::attention::MultiHeadAttention) -> Self {
        Self {
            query: mha.query.into(),
            key: mha.key.into(),
            value: mha.value.into(),
            output: mha.output.into(),
            dropout: mha.dropout,
            activation: mha.activation,
            d_model: mha.d_model,
            n_heads: mha.n_heads,
            d_k: mha.d_k,
            min_float: mha.min_float,
            quiet_softmax: mha.quiet_softmax,
            tp: TpSlot::attention(mha.n_heads),
        }
    }
}
