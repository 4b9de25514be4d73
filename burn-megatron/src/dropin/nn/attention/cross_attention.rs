//! Burn's `nn::attention::CrossAttention`: queries of width `d_model` attending over a
//! context of another width `d_context`, with grouped-query heads. Split by an `encoder` rule,
//! each rank keeps `n_heads / tp` query heads and the `n_heads_kv / tp` key/value heads they
//! share (the query, key and value column-parallel, the output row-parallel), so the
//! key/value heads are never repeated across ranks.

use super::super::super::slot::TpSlot;
use super::super::cache::TensorCache;
use super::super::transformer::drop;
use super::super::{Linear, LinearConfig};
use super::{attention_probs, to_heads};
use crate::tensor_parallel::RngRegion;
use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer};
use burn::tensor::{Bool, Device, Tensor};

/// Burn's `CrossAttentionConfig`, field for field.
#[derive(Config, Debug)]
pub struct CrossAttentionConfig {
    /// The width of the queries (and of the output).
    pub d_model: usize,
    /// The width of the context the queries attend over.
    pub d_context: usize,
    /// The query heads.
    pub n_heads: usize,
    /// The key/value heads (as many as `n_heads` for multi-head attention, 1 for multi-query
    /// attention); they must divide `n_heads`.
    pub n_heads_kv: usize,
    /// Channels per head.
    pub d_head: usize,
    /// The attention probabilities' dropout rate.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The score masked positions get.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Softmax with an extra zero logit (a head may attend to nothing).
    #[config(default = false)]
    pub quiet_softmax: bool,
}

impl CrossAttentionConfig {
    /// The layer on `device`, drawn lazily as Burn draws it (Kaiming-uniform with gain
    /// `1/√d_head`). Burn's `init` panics when `n_heads_kv` does not divide `n_heads`; this
    /// one builds the layer, a plan refuses to split it, and its forward panics, naming both.
    pub fn init(&self, device: &Device) -> CrossAttention {
        let initializer = Initializer::KaimingUniform {
            gain: 1.0 / (self.d_head as f64).sqrt(),
            fan_out_only: false,
        };
        let linear = |d_input, d_output| {
            LinearConfig::new(d_input, d_output)
                .with_initializer(initializer.clone())
                .init(device)
        };
        CrossAttention {
            query: linear(self.d_model, self.n_heads * self.d_head),
            key: linear(self.d_context, self.n_heads_kv * self.d_head),
            value: linear(self.d_context, self.n_heads_kv * self.d_head),
            output: linear(self.n_heads * self.d_head, self.d_model),
            dropout: DropoutConfig::new(self.dropout).init(),
            n_heads: self.n_heads,
            n_heads_kv: self.n_heads_kv,
            d_head: self.d_head,
            scale: (self.d_head as f64).sqrt().recip(),
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
            tp: TpSlot::grouped_attention(self.n_heads, self.n_heads_kv),
        }
    }
}

/// Burn's `CrossAttention`, its fields private as Burn's are; split, each rank holds
/// `n_heads / tp` query heads and `n_heads_kv / tp` key/value heads.
///
/// A layer Burn built has no public fields to convert from; its record loads into this one,
/// whose module paths are Burn's:
///
/// ```
/// use burn::module::Module;
/// use burn::tensor::Device;
/// use burn_megatron::dropin::nn::attention::CrossAttentionConfig;
/// let device = Device::flex();
/// let burns = burn::nn::attention::CrossAttentionConfig::new(8, 6, 4, 2, 2).init(&device);
/// let ours = CrossAttentionConfig::new(8, 6, 4, 2, 2).init(&device).load_record(burns.into_record());
/// # drop(ours);
/// ```
#[derive(Module, Debug)]
pub struct CrossAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    output: Linear,
    dropout: Dropout,
    n_heads: usize,
    n_heads_kv: usize,
    d_head: usize,
    scale: f64,
    min_float: f64,
    quiet_softmax: bool,
    tp: TpSlot,
}

/// Burn's `CrossAttentionCache`: the context's keys and values, projected once for every
/// step of decoding.
#[derive(Debug, Clone)]
pub struct CrossAttentionCache {
    /// This rank's key heads, `[b, n_heads_kv / tp, s_context, d_head]`.
    pub k: TensorCache<4>,
    /// This rank's value heads, as `k`.
    pub v: TensorCache<4>,
}

impl CrossAttentionCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self {
            k: TensorCache::empty(),
            v: TensorCache::empty(),
        }
    }
}

impl Default for CrossAttentionCache {
    fn default() -> Self {
        Self::new()
    }
}

impl CrossAttention {
    /// Burn's forward: `query` `[b, s_q, d_model]` attends over `context` `[b, s_c,
    /// d_context]`, `mask` `[b, s_c]` (true: padding) keeping it from the context's padding;
    /// the result is `[b, s_q, d_model]`, whole on every rank.
    ///
    /// # Panics
    ///
    /// When the key/value heads do not divide the query heads, or when the heads do not
    /// split over the ranks the layers were split over (Burn's forward has no room for an
    /// error; a plan refuses both), or on inputs of other widths or batches (as Burn's).
    pub fn forward(
        &self,
        query: Tensor<3>,
        context: Tensor<3>,
        mask: Option<Tensor<2, Bool>>,
    ) -> Tensor<3> {
        self.attend(query, context, mask, None)
    }

    /// Burn's `forward_cache`: as [`forward`](Self::forward), the context's keys and values
    /// projected on the first call and taken from `cache` after (the context is fixed while
    /// decoding; the query is projected whole each call).
    ///
    /// # Panics
    ///
    /// As [`forward`](Self::forward).
    pub fn forward_cache(
        &self,
        query: Tensor<3>,
        context: Tensor<3>,
        mask: Option<Tensor<2, Bool>>,
        cache: &mut CrossAttentionCache,
    ) -> Tensor<3> {
        self.attend(query, context, mask, Some(cache))
    }

    fn attend(
        &self,
        query: Tensor<3>,
        context: Tensor<3>,
        mask: Option<Tensor<2, Bool>>,
        cache: Option<&mut CrossAttentionCache>,
    ) -> Tensor<3> {
        let (heads, kv_heads) = self.heads();
        let [batch, s_q, _] = query.dims();
        let context_batch = context.dims()[0];
        assert_eq!(
            context_batch, batch,
            "CrossAttention: a context of {context_batch} samples for queries of {batch}"
        );
        let q = to_heads(self.query.forward(query), heads, self.d_head);
        let k_of = |x| to_heads(self.key.forward(x), kv_heads, self.d_head);
        let v_of = |x| to_heads(self.value.forward(x), kv_heads, self.d_head);
        let (k, v) = match cache {
            None => (k_of(context.clone()), v_of(context)),
            Some(c) => (
                c.k.forward_full(context.clone(), k_of),
                c.v.forward_full(context, v_of),
            ),
        };
        // Burn repeats each key/value head for the query heads that share it; a rank's
        // query heads share only its own key/value heads.
        let (k, v) = match heads / kv_heads {
            1 => (k, v),
            n_rep => (repeat_kv(k, n_rep), repeat_kv(v, n_rep)),
        };
        let scores = q.matmul(k.transpose()).mul_scalar(self.scale);
        // The mask is Burn's padding mask, `[b, s_c]`.
        let weights = attention_probs(scores, mask, None, self.min_float, self.quiet_softmax);
        // Each rank holds other heads: their masks differ.
        let weights = drop(
            &self.dropout,
            &self.tp,
            weights,
            RngRegion::TensorModelParallel,
        );
        let context = weights
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([batch, s_q, heads * self.d_head]);
        self.output.forward(context)
    }

    /// This rank's query and key/value heads.
    ///
    /// # Panics
    ///
    /// When they do not divide or split (see [`forward`](Self::forward)).
    fn heads(&self) -> (usize, usize) {
        let (heads, kv_heads) = (self.n_heads, self.n_heads_kv);
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads),
            "CrossAttention: {heads} query heads cannot share {kv_heads} key/value heads evenly"
        );
        let tp = self.query.tp_size();
        assert!(
            kv_heads.is_multiple_of(tp),
            "CrossAttention: {kv_heads} key/value heads do not split over {tp} \
             tensor-parallel ranks"
        );
        (heads / tp, kv_heads / tp)
    }
}

/// `[b, h, s, d]` → `[b, h · n_rep, s, d]`, each head `n_rep` times in a row.
fn repeat_kv(x: Tensor<4>, n_rep: usize) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    x.reshape([b, h, 1, s, d])
        .expand([b, h, n_rep, s, d])
        .reshape([b, h * n_rep, s, d])
}
