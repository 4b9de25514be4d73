//! `ParallelTransformerEncoder`: Burn's `nn::transformer::TransformerEncoder`, tensor-parallel.

use super::super::{
    ColumnParallelLinear, ColumnParallelLinearConfig, MasterInit, RngRegion, RngTracker,
    RowParallelLinear, RowParallelLinearConfig, TpError, derive_seed,
};
use super::heads::split_features;
use super::init::master_init;
use super::mha::{ParallelMhaInput, ParallelMultiHeadAttention, dropout};
use super::nn::transformer::TransformerEncoderInput;
use crate::comm::Comm;
use burn::module::Module;
use burn::nn::activation::Activation;
use burn::nn::attention::MultiHeadAttentionConfig;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerEncoder, TransformerEncoderConfig, TransformerEncoderLayer,
};
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Device, Tensor};

/// Burn's position-wise feed-forward block with `linear_inner` column-parallel (`d_ff / tp`
/// of the inner width on each rank) and `linear_outer` row-parallel; the activation is Burn's
/// and must act elementwise.
#[derive(Module, Debug)]
pub struct ParallelPositionWiseFeedForward {
    /// `d_model → d_ff / tp`.
    pub linear_inner: ColumnParallelLinear,
    /// `d_ff / tp → d_model`, reduced over the ranks.
    pub linear_outer: RowParallelLinear,
    /// Dropout after the activation (its probability; the mask comes from the tracker).
    pub dropout: Dropout,
    /// The activation, as Burn's block holds it.
    #[module(skip)]
    pub activation: Activation,
    #[module(skip)]
    rng: RngTracker,
}

impl ParallelPositionWiseFeedForward {
    /// This rank's shard of `pwff`; an activation that does not act elementwise (`SwiGlu`,
    /// `PRelu`, which mix or weigh channels the ranks split) is an error naming it.
    pub fn from_pwff(
        pwff: &PositionWiseFeedForward,
        tp: &Comm,
        rng: &RngTracker,
    ) -> Result<Self, TpError> {
        let [_, d_ff] = pwff.linear_inner.weight.dims();
        split_features(
            "PositionWiseFeedForward",
            "inner features",
            d_ff,
            tp.group().size(),
        )?;
        check_activation(&pwff.activation)?;
        Ok(Self {
            linear_inner: ColumnParallelLinear::split(&pwff.linear_inner, tp)?,
            linear_outer: RowParallelLinear::split(&pwff.linear_outer, tp)?,
            dropout: pwff.dropout.clone(),
            activation: pwff.activation.clone(),
            rng: rng.clone(),
        })
    }

    /// The whole block, gathered from the ranks (collective), untracked.
    pub fn to_pwff(&self) -> Result<PositionWiseFeedForward, TpError> {
        Ok(PositionWiseFeedForward {
            linear_inner: self.linear_inner.to_linear()?,
            linear_outer: self.linear_outer.to_linear()?,
            dropout: self.dropout.clone(),
            activation: self.activation.clone(),
        })
    }

    /// `[…, d_model]` → `[…, d_model]`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let x = self.activation.forward(self.linear_inner.forward(input));
        // The inner activations are split: each rank draws its own mask.
        let x = dropout(&self.dropout, &self.rng, x, RngRegion::TensorModelParallel);
        self.linear_outer.forward(x)
    }
}

/// Refuses an activation that does not act elementwise on a split tensor.
fn check_activation(activation: &Activation) -> Result<(), TpError> {
    match activation {
        Activation::SwiGlu(_) | Activation::PRelu(_) => Err(TpError::Invalid(format!(
            "PositionWiseFeedForward: the activation {activation:?} does not act elementwise, \
             so it cannot run on the tensor-parallel ranks' slices of the inner width"
        ))),
        _ => Ok(()),
    }
}

/// Burn's encoder layer, tensor-parallel: [`ParallelMultiHeadAttention`],
/// [`ParallelPositionWiseFeedForward`], and Burn's norms (duplicated) in the same places,
/// pre- or post-norm as `norm_first` says.
#[derive(Module, Debug)]
pub struct ParallelTransformerEncoderLayer {
    /// Self-attention.
    pub mha: ParallelMultiHeadAttention,
    /// Feed-forward block.
    pub pwff: ParallelPositionWiseFeedForward,
    /// The norm around the feed-forward block (after the attention's residual when post-norm).
    pub norm_1: LayerNorm,
    /// The norm around the attention (after the feed-forward's residual when post-norm).
    pub norm_2: LayerNorm,
    /// The residual branches' dropout.
    pub dropout: Dropout,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
    #[module(skip)]
    rng: RngTracker,
}

impl ParallelTransformerEncoderLayer {
    /// This rank's shard of `layer`.
    pub fn from_layer(
        layer: &TransformerEncoderLayer,
        tp: &Comm,
        rng: &RngTracker,
    ) -> Result<Self, TpError> {
        Ok(Self {
            mha: ParallelMultiHeadAttention::from_mha(&layer.mha, tp, rng)?,
            pwff: ParallelPositionWiseFeedForward::from_pwff(&layer.pwff, tp, rng)?,
            norm_1: layer.norm_1.clone(),
            norm_2: layer.norm_2.clone(),
            dropout: layer.dropout.clone(),
            norm_first: layer.norm_first,
            rng: rng.clone(),
        })
    }

    /// The whole layer, gathered from the ranks (collective), untracked.
    pub fn to_layer(&self) -> Result<TransformerEncoderLayer, TpError> {
        Ok(TransformerEncoderLayer {
            mha: self.mha.to_mha()?,
            pwff: self.pwff.to_pwff()?,
            norm_1: self.norm_1.clone(),
            norm_2: self.norm_2.clone(),
            dropout: self.dropout.clone(),
            norm_first: self.norm_first,
        })
    }

    /// Burn's layer's forward, `[b, s, d_model]` → `[b, s, d_model]`.
    pub fn forward(
        &self,
        input: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        // The residual stream is whole on every rank: its dropout masks must agree.
        let residual_dropout = |x| dropout(&self.dropout, &self.rng, x, RngRegion::Default);
        let attention = |x| {
            let mut mha_input = ParallelMhaInput::self_attn(x);
            if let Some(mask) = mask_pad {
                mha_input = mha_input.mask_pad(mask);
            }
            if let Some(mask) = mask_attn {
                mha_input = mha_input.mask_attn(mask);
            }
            self.mha.forward(mha_input).context
        };
        let norms = (&self.norm_1, &self.norm_2, self.norm_first);
        encoder_block(
            input,
            norms,
            attention,
            |x| self.pwff.forward(x),
            residual_dropout,
        )
    }
}

/// Burn's encoder layer around `attention` and `feed_forward`, with its roles of the two
/// norms: pre-norm (`norm_first`) is `x + d(attention(norm_2(x)))`, then
/// `x + d(feed_forward(norm_1(x)))`; post-norm is `norm_1(x + d(attention(x)))`, then
/// `norm_2(x + d(feed_forward(x)))`, `d` being the residual dropout.
pub(super) fn encoder_block(
    x: Tensor<3>,
    (norm_1, norm_2, norm_first): (&LayerNorm, &LayerNorm, bool),
    attention: impl FnOnce(Tensor<3>) -> Tensor<3>,
    feed_forward: impl FnOnce(Tensor<3>) -> Tensor<3>,
    residual_dropout: impl Fn(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    let attn_in = match norm_first {
        true => norm_2.forward(x.clone()),
        false => x.clone(),
    };
    let mut x = x + residual_dropout(attention(attn_in));
    let ffn_in = match norm_first {
        true => norm_1.forward(x.clone()),
        false => {
            x = norm_1.forward(x);
            x.clone()
        }
    };
    let x = x + residual_dropout(feed_forward(ffn_in));
    match norm_first {
        true => x,
        false => norm_2.forward(x),
    }
}

/// Burn's `TransformerEncoder`, tensor-parallel: the same fields and record paths (the
/// weights' shapes are this rank's), built from Burn's own config or from a plain encoder.
///
/// ```
/// use burn::nn::transformer::TransformerEncoderConfig;
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::tensor_parallel::RngTracker;
/// use burn_megatron::tensor_parallel::dropin::ParallelTransformerEncoder;
/// use burn_megatron::tensor_parallel::dropin::nn::transformer::TransformerEncoderInput;
/// use std::sync::Arc;
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let (device, rng) = (Device::flex(), RngTracker::new(7, 0));
/// let config = TransformerEncoderConfig::new(16, 32, 4, 2);
/// let encoder = ParallelTransformerEncoder::new(&config, &tp, 1234, &rng, &device).unwrap();
/// let x = Tensor::<3>::ones([2, 5, 16], &device);
/// let y = encoder.forward(TransformerEncoderInput::new(x));
/// assert_eq!(y.dims(), [2, 5, 16]);
/// ```
#[derive(Module, Debug)]
pub struct ParallelTransformerEncoder {
    /// The layers.
    pub layers: Vec<ParallelTransformerEncoderLayer>,
    /// The width.
    pub d_model: usize,
    /// The feed-forward blocks' inner width (all ranks').
    pub d_ff: usize,
    /// Attention heads (all ranks').
    pub n_heads: usize,
    /// Layers.
    pub n_layers: usize,
    /// Dropout probability.
    pub dropout: f64,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
    /// Quiet softmax in the attention.
    pub quiet_softmax: bool,
}

impl ParallelTransformerEncoder {
    /// This rank's part of the encoder `config` describes, every weight drawn from `seed` as
    /// every TP size draws it (see [`master_init`] for the initialisers that can be); dropout
    /// masks from `rng` (built with this rank's tensor-parallel rank).
    pub fn new(
        config: &TransformerEncoderConfig,
        tp: &Comm,
        seed: u64,
        rng: &RngTracker,
        device: &Device,
    ) -> Result<Self, TpError> {
        let init = master_init(&config.initializer)?;
        let size = tp.group().size();
        split_features(
            "TransformerEncoder",
            "feed-forward features",
            config.d_ff,
            size,
        )?;
        let activation = config.activation.init(device);
        check_activation(&activation)?;
        let layers = (0..config.n_layers)
            .map(|i| {
                let seed = derive_seed(seed, &format!("layers.{i}"));
                let mha = MultiHeadAttentionConfig::new(config.d_model, config.n_heads)
                    .with_initializer(config.initializer.clone())
                    .with_dropout(config.dropout)
                    .with_quiet_softmax(config.quiet_softmax);
                let norm = || {
                    LayerNormConfig::new(config.d_model)
                        .with_epsilon(config.layer_norm_eps)
                        .init(device)
                };
                Ok(ParallelTransformerEncoderLayer {
                    mha: ParallelMultiHeadAttention::new(
                        &mha,
                        tp,
                        derive_seed(seed, "mha"),
                        rng,
                        device,
                    )?,
                    pwff: ParallelPositionWiseFeedForward {
                        linear_inner: feed_forward_column(config, init, seed, tp, device)?,
                        linear_outer: RowParallelLinearConfig::new(config.d_ff, config.d_model)
                            .with_initializer(init)
                            .with_bias_initializer(init)
                            .with_seed(derive_seed(seed, "pwff.linear_outer"))
                            .init(tp, device)?,
                        dropout: DropoutConfig::new(config.dropout).init(),
                        activation: activation.clone(),
                        rng: rng.clone(),
                    },
                    norm_1: norm(),
                    norm_2: norm(),
                    dropout: DropoutConfig::new(config.dropout).init(),
                    norm_first: config.norm_first,
                    rng: rng.clone(),
                })
            })
            .collect::<Result<_, TpError>>()?;
        Ok(Self {
            layers,
            d_model: config.d_model,
            d_ff: config.d_ff,
            n_heads: config.n_heads,
            n_layers: config.n_layers,
            dropout: config.dropout,
            norm_first: config.norm_first,
            quiet_softmax: config.quiet_softmax,
        })
    }

    /// This rank's shard of `encoder` (every layer's heads and feed-forward slice); its
    /// dropout masks from `rng`.
    pub fn from_encoder(
        encoder: &TransformerEncoder,
        tp: &Comm,
        rng: &RngTracker,
    ) -> Result<Self, TpError> {
        let layers = (encoder.layers.iter())
            .map(|layer| ParallelTransformerEncoderLayer::from_layer(layer, tp, rng))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            layers,
            d_model: encoder.d_model,
            d_ff: encoder.d_ff,
            n_heads: encoder.n_heads,
            n_layers: encoder.n_layers,
            dropout: encoder.dropout,
            norm_first: encoder.norm_first,
            quiet_softmax: encoder.quiet_softmax,
        })
    }

    /// The whole encoder, gathered from the ranks (collective: every rank calls it),
    /// untracked.
    pub fn to_encoder(&self) -> Result<TransformerEncoder, TpError> {
        Ok(TransformerEncoder {
            layers: (self.layers.iter())
                .map(ParallelTransformerEncoderLayer::to_layer)
                .collect::<Result<_, _>>()?,
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        })
    }

    /// Burn's encoder's forward: `[b, s, d_model]` → `[b, s, d_model]`, whole on every rank.
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        let mut x = input.tensor;
        for layer in &self.layers {
            x = layer.forward(x, input.mask_pad.clone(), input.mask_attn.clone());
        }
        x
    }
}

/// A layer's first feed-forward projection, `d_model → d_ff / tp`.
fn feed_forward_column(
    config: &TransformerEncoderConfig,
    init: MasterInit,
    seed: u64,
    tp: &Comm,
    device: &Device,
) -> Result<ColumnParallelLinear, TpError> {
    ColumnParallelLinearConfig::new(config.d_model, config.d_ff)
        .with_initializer(init)
        .with_bias_initializer(init)
        .with_seed(derive_seed(seed, "pwff.linear_inner"))
        .init(tp, device)
}
