//! `ParallelMultiHeadAttention`: Burn's `nn::attention::MultiHeadAttention` with its heads
//! split over the tensor-parallel ranks.

use super::super::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RngRegion, RngTracker, RowParallelLinear,
    RowParallelLinearConfig, TpError, derive_seed,
};
use super::heads::attention_split;
use super::init::master_init;
use crate::comm::Comm;
use burn::module::Module;
use burn::nn::attention::{MultiHeadAttention, MultiHeadAttentionConfig};
use burn::nn::{Dropout, DropoutConfig, Gelu};
use burn::tensor::activation::{quiet_softmax, softmax};
use burn::tensor::{Bool, Device, Tensor};

/// Multi-head attention with `n_heads / tp` heads on each rank: `query`, `key` and `value`
/// column-parallel (this rank's heads), `output` row-parallel (its all-reduce sums the heads'
/// contributions). Field names and record paths are `MultiHeadAttention`'s; `n_heads` and
/// `d_model` are the whole layer's.
///
/// The padding and attention masks apply to every rank's heads as they are: each head sees
/// the whole sequence, so nothing of them is split.
#[derive(Module, Debug)]
pub struct ParallelMultiHeadAttention {
    /// `d_model → d_model / tp`: this rank's heads' queries.
    pub query: ColumnParallelLinear,
    /// `d_model → d_model / tp`: their keys.
    pub key: ColumnParallelLinear,
    /// `d_model → d_model / tp`: their values.
    pub value: ColumnParallelLinear,
    /// `d_model / tp → d_model`, reduced over the ranks.
    pub output: RowParallelLinear,
    /// The attention probabilities' dropout (its probability; the mask comes from `rng`).
    pub dropout: Dropout,
    /// Unused, as in Burn's layer: kept for its record path.
    pub activation: Gelu,
    /// The layer's width.
    pub d_model: usize,
    /// The layer's heads (all ranks').
    pub n_heads: usize,
    /// Channels per head.
    pub d_k: usize,
    /// The score masked positions get.
    pub min_float: f64,
    /// Softmax with an extra zero logit (a head may attend to nothing).
    pub quiet_softmax: bool,
    #[module(skip)]
    rng: RngTracker,
}

/// The input of [`ParallelMultiHeadAttention::forward`]: the drop-in layer's, built as Burn's
/// `MhaInput`.
pub type ParallelMhaInput = super::nn::attention::MhaInput;

/// What [`ParallelMultiHeadAttention::forward`] returns: this rank's heads' attention
/// probabilities and the whole output.
pub type ParallelMhaOutput = super::nn::attention::MhaOutput;

impl ParallelMultiHeadAttention {
    /// This rank's heads of an attention layer `config` describes, drawn from `seed` as every
    /// TP size draws them; dropout masks from `rng`.
    pub fn new(
        config: &MultiHeadAttentionConfig,
        tp: &Comm,
        seed: u64,
        rng: &RngTracker,
        device: &Device,
    ) -> Result<Self, TpError> {
        let d = config.d_model;
        let split = attention_split("MultiHeadAttention", d, config.n_heads, config.n_heads, {
            tp.group().size()
        })?;
        let init = master_init(&config.initializer)?;
        let column = |name: &str, bias: bool| {
            ColumnParallelLinearConfig::new(d, d)
                .with_bias(bias)
                .with_initializer(init)
                .with_bias_initializer(init)
                .with_seed(derive_seed(seed, name))
                .init(tp, device)
        };
        Ok(Self {
            query: column("query", config.query_bias)?,
            key: column("key", config.key_bias)?,
            value: column("value", config.value_bias)?,
            output: RowParallelLinearConfig::new(d, d)
                .with_bias(config.output_bias)
                .with_initializer(init)
                .with_bias_initializer(init)
                .with_seed(derive_seed(seed, "output"))
                .init(tp, device)?,
            dropout: DropoutConfig::new(config.dropout).init(),
            activation: Gelu::new(),
            d_model: d,
            n_heads: config.n_heads,
            d_k: split.head_dim,
            min_float: config.min_float,
            quiet_softmax: config.quiet_softmax,
            rng: rng.clone(),
        })
    }

    /// This rank's heads of `mha`.
    pub fn from_mha(
        mha: &MultiHeadAttention,
        tp: &Comm,
        rng: &RngTracker,
    ) -> Result<Self, TpError> {
        let (d, heads) = (mha.d_model, mha.n_heads);
        let split = attention_split("MultiHeadAttention", d, heads, heads, tp.group().size())?;
        Ok(Self {
            query: ColumnParallelLinear::split(&mha.query, tp)?,
            key: ColumnParallelLinear::split(&mha.key, tp)?,
            value: ColumnParallelLinear::split(&mha.value, tp)?,
            output: RowParallelLinear::split(&mha.output, tp)?,
            dropout: mha.dropout.clone(),
            activation: mha.activation.clone(),
            d_model: d,
            n_heads: heads,
            d_k: split.head_dim,
            min_float: mha.min_float,
            quiet_softmax: mha.quiet_softmax,
            rng: rng.clone(),
        })
    }

    /// The whole `MultiHeadAttention`, gathered from the ranks (collective), untracked.
    pub fn to_mha(&self) -> Result<MultiHeadAttention, TpError> {
        let gathered = |l: &ColumnParallelLinear| l.to_linear();
        Ok(MultiHeadAttention {
            query: gathered(&self.query)?,
            key: gathered(&self.key)?,
            value: gathered(&self.value)?,
            output: self.output.to_linear()?,
            dropout: self.dropout.clone(),
            activation: self.activation.clone(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_k,
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
        })
    }

    /// This rank's heads attend; their outputs are summed over the ranks by `output`. Inputs
    /// that are not `[b, s, d_model]` panic naming the widths, as Burn's layer's shape
    /// assertions do: a forward has no error channel.
    pub fn forward(&self, input: ParallelMhaInput) -> ParallelMhaOutput {
        let [b, s_q, d] = input.query.dims();
        assert_eq!(
            d, self.d_model,
            "ParallelMultiHeadAttention: the input is {d} wide, the layer {}",
            self.d_model
        );
        let heads = self.local_heads();
        let query = self.heads_of(input.query, &self.query, heads);
        let key = self.heads_of(input.key, &self.key, heads);
        let value = self.heads_of(input.value, &self.value, heads);
        let scores = query
            .matmul(key.transpose())
            .div_scalar((self.d_k as f32).sqrt());
        let weights = self.weights(scores, input.mask_pad, input.mask_attn);
        // This rank's heads span d_model / tp of the width, not d_model.
        let context = weights.clone().matmul(value).swap_dims(1, 2);
        let context = context.reshape([b, s_q, heads * self.d_k]);
        ParallelMhaOutput {
            weights,
            context: self.output.forward(context),
        }
    }

    /// The heads this rank holds: its share of the query projection's outputs.
    fn local_heads(&self) -> usize {
        let [_, width] = self.query.weight.dims();
        width / self.d_k
    }

    fn heads_of(&self, x: Tensor<3>, linear: &ColumnParallelLinear, heads: usize) -> Tensor<4> {
        let [b, s, _] = x.dims();
        linear
            .forward(x)
            .reshape([b, s, heads, self.d_k])
            .swap_dims(1, 2)
    }

    fn weights(
        &self,
        scores: Tensor<4>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<4> {
        let weights = attention_probs(
            scores,
            mask_pad,
            mask_attn,
            self.min_float,
            self.quiet_softmax,
        );
        // Each rank holds other heads: their masks differ.
        dropout(
            &self.dropout,
            &self.rng,
            weights,
            RngRegion::TensorModelParallel,
        )
    }
}

/// `dropout`'s probability applied with a mask from `rng`'s `region` stream, when Burn's layer
/// would apply it: in training (its flag set, the tensor tracked).
pub(super) fn dropout<const D: usize>(
    dropout: &Dropout,
    rng: &RngTracker,
    x: Tensor<D>,
    region: RngRegion,
) -> Tensor<D> {
    if !dropout.training.is_enabled() {
        return x;
    }
    rng.dropout(x, dropout.prob, region)
        .expect("Burn's DropoutConfig::init refuses a probability outside [0, 1)")
}

/// Burn's attention probabilities: `scores` `[b, heads, s_q, s_k]` filled with `min_float`
/// where `mask_pad` `[b, s_k]` or `mask_attn` `[b, s_q, s_k]` is true, then softmax (or quiet
/// softmax) over the keys. Heads are independent, so a rank's heads take the whole masks.
pub(super) fn attention_probs(
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
