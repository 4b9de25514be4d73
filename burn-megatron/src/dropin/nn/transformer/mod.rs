//! Burn's `nn::transformer::TransformerEncoder`, with its config fields, builders and record
//! paths, built from [`Linear`]s a plan can split. `TpPlan::encoder(&["encoder"])` makes the
//! attention's query, key and value and the first feed-forward layer column-parallel, the
//! attention output and the second feed-forward layer row-parallel (Megatron's split: one
//! all-reduce per block in each direction), keeps the norms whole, and gives dropout a
//! [`RngTracker`](crate::tensor_parallel::RngTracker): the same mask on every rank for the
//! residual stream, which every rank holds whole, and each rank its own for its heads and its
//! slice of the inner width. Unsplit, it computes what Burn's computes, with Burn's dropout.

use super::super::slot::{TpSlot, not_elementwise};
use super::attention::{MhaCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use super::cache::{TensorCache, cached};
use super::sequence::{self, Stream};
use super::{Linear, LinearConfig, Region};
use crate::comm::Comm;
use crate::tensor_parallel::RngRegion;
use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::{Activation, ActivationConfig};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Device, Tensor};

mod decoder;
pub use decoder::{
    TransformerDecoder, TransformerDecoderAutoregressiveCache, TransformerDecoderConfig,
    TransformerDecoderInput, TransformerDecoderLayer, TransformerDecoderLayerAutoregressiveCache,
};

/// Burn's `TransformerEncoderConfig`, field for field (a struct literal of Burn's compiles
/// against this one).
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The size of the model.
    pub d_model: usize,
    /// The size of the position-wise feed-forward network.
    pub d_ff: usize,
    /// The number of attention heads.
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before the attention and the feed-forward network instead of after.
    #[config(default = false)]
    pub norm_first: bool,
    /// "Quiet softmax" instead of the regular one.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers (Burn's default).
    #[config(
        default = "burn::nn::transformer::TransformerEncoderConfig::new(1, 1, 1, 1).initializer"
    )]
    pub initializer: Initializer,
    /// The feed-forward network's activation (elementwise ones split).
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The layer norms' epsilon.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

/// The parts of an encoder's or a decoder's layers, drawn lazily as Burn draws them: the two
/// configs have the same fields.
struct Parts<'a> {
    d_model: usize,
    d_ff: usize,
    n_heads: usize,
    dropout: f64,
    quiet_softmax: bool,
    initializer: &'a Initializer,
    activation: &'a ActivationConfig,
    layer_norm_eps: f64,
    device: &'a Device,
}

impl Parts<'_> {
    fn attention(&self) -> MultiHeadAttention {
        MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_dropout(self.dropout)
            .with_quiet_softmax(self.quiet_softmax)
            .with_initializer(self.initializer.clone())
            .init(self.device)
    }

    fn pwff(&self) -> PositionWiseFeedForward {
        PositionWiseFeedForwardConfig::new(self.d_model, self.d_ff)
            .with_initializer(self.initializer.clone())
            .with_dropout(self.dropout)
            .with_activation(self.activation.clone())
            .init(self.device)
    }

    fn norm(&self) -> LayerNorm {
        LayerNormConfig::new(self.d_model)
            .with_epsilon(self.layer_norm_eps)
            .init(self.device)
    }

    fn dropout(&self) -> Dropout {
        DropoutConfig::new(self.dropout).init()
    }
}

impl TransformerEncoderConfig {
    fn parts<'a>(&'a self, device: &'a Device) -> Parts<'a> {
        Parts {
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            dropout: self.dropout,
            quiet_softmax: self.quiet_softmax,
            initializer: &self.initializer,
            activation: &self.activation,
            layer_norm_eps: self.layer_norm_eps,
            device,
        }
    }

    /// The encoder on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> TransformerEncoder {
        let layer = |_| TransformerEncoderLayer::new(self, device);
        TransformerEncoder {
            layers: (0..self.n_layers).map(layer).collect(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

/// Burn's `TransformerEncoder`.
#[derive(Module, Debug)]
pub struct TransformerEncoder {
    /// The layers.
    pub layers: Vec<TransformerEncoderLayer>,
    /// The size of the model.
    pub d_model: usize,
    /// The size of the feed-forward network.
    pub d_ff: usize,
    /// The attention heads (all ranks').
    pub n_heads: usize,
    /// The number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Pre-norm (`true`) or post-norm.
    pub norm_first: bool,
    /// Quiet softmax.
    pub quiet_softmax: bool,
}

impl TransformerEncoder {
    /// `[b, s, d_model]` → `[b, s, d_model]`, every rank the whole output. Under sequence
    /// parallelism a sequence the ranks do not split is padded at its end and the padding
    /// masked, then cut off the output.
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        let sp = self.layers.iter().find_map(|l| l.tp.sequence_parallel());
        let (input, s) = input.padded(sp);
        let mut x = Stream::whole(input.tensor);
        for layer in &self.layers {
            let (pad, attn) = (input.mask_pad.clone(), input.mask_attn.clone());
            x = x.to(layer.tp.sequence_parallel(), "TransformerEncoderLayer");
            x = x.map(|x| layer.run(x, pad, attn, None));
        }
        sequence::cut(x.into_whole(), s)
    }

    /// Burn's `forward_autoregressive_inference`: one decoding step, each call's input one
    /// position longer than the last, only the new position computed.
    ///
    /// # Panics
    ///
    /// On a cache made for another number of layers.
    pub fn forward_autoregressive_inference(
        &self,
        input: TransformerEncoderInput,
        cache: &mut TransformerEncoderAutoregressiveCache,
    ) -> Tensor<3> {
        check_cache(cache.layers.len(), self.layers.len());
        let mut x = input.tensor;
        for (layer, cache) in self.layers.iter().zip(&mut cache.layers) {
            let (pad, attn) = (input.mask_pad.clone(), input.mask_attn.clone());
            x = layer.run(x, pad, attn, Some(cache));
        }
        x
    }

    /// An empty cache for [`forward_autoregressive_inference`](Self::forward_autoregressive_inference).
    pub fn new_autoregressive_cache(&self) -> TransformerEncoderAutoregressiveCache {
        TransformerEncoderAutoregressiveCache {
            layers: (self.layers.iter())
                .map(|_| TransformerEncoderLayerAutoregressiveCache::empty())
                .collect(),
        }
    }
}

/// A cache made for `cached` layers used with a model of `layers`.
pub(super) fn check_cache(cached: usize, layers: usize) {
    assert_eq!(
        cached, layers,
        "an autoregressive cache for {cached} layers used with {layers} layers"
    );
}

/// Burn's cache of an encoder's layers for autoregressive inference.
#[derive(Debug, Clone)]
pub struct TransformerEncoderAutoregressiveCache {
    layers: Vec<TransformerEncoderLayerAutoregressiveCache>,
}

/// Burn's cache of one encoder layer's parts.
#[derive(Debug, Clone)]
pub struct TransformerEncoderLayerAutoregressiveCache {
    /// The self-attention's.
    pub mha: MhaCache,
    /// The feed-forward network's.
    pub pwff: TensorCache<3>,
    /// The first norm's.
    pub norm_1: TensorCache<3>,
    /// The second norm's.
    pub norm_2: TensorCache<3>,
}

impl TransformerEncoderLayerAutoregressiveCache {
    /// An empty cache.
    pub fn empty() -> Self {
        Self {
            mha: MhaCache::autoregressive(),
            pwff: TensorCache::empty(),
            norm_1: TensorCache::empty(),
            norm_2: TensorCache::empty(),
        }
    }
}

/// Burn's `TransformerEncoderInput`, whose fields Burn keeps private: the same builder.
#[derive(Debug, Clone)]
pub struct TransformerEncoderInput {
    pub(in crate::dropin) tensor: Tensor<3>,
    pub(in crate::dropin) mask_pad: Option<Tensor<2, Bool>>,
    pub(in crate::dropin) mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerEncoderInput {
    /// This input padded at its end to a length `sp`'s group splits
    /// ([`sequence::missing_positions`]), and its own length.
    fn padded(self, sp: Option<&Comm>) -> (Self, usize) {
        let [b, s, _] = self.tensor.dims();
        let extra = sequence::missing_positions(s, sp);
        let device = self.tensor.device();
        let padded = Self {
            tensor: sequence::pad_positions(self.tensor, extra),
            mask_pad: sequence::pad_mask(self.mask_pad, [b, s], extra, &device),
            mask_attn: sequence::pad_attn(self.mask_attn, extra, extra),
        };
        (padded, s)
    }

    /// The input `[b, s, d_model]`.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            tensor,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// Keys to ignore, `[b, s]` (true: padding).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Query-key pairs to ignore, `[b, s, s]`.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }
}

/// Burn's `TransformerEncoderLayer`.
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer {
    /// The self-attention.
    pub mha: MultiHeadAttention,
    /// The feed-forward network.
    pub pwff: PositionWiseFeedForward,
    /// The norm after (or, pre-norm, before) the feed-forward network's residual.
    pub norm_1: LayerNorm,
    /// The norm after (or, pre-norm, before) the attention's residual.
    pub norm_2: LayerNorm,
    /// The residual branches' dropout.
    pub dropout: Dropout,
    /// Pre-norm.
    pub norm_first: bool,
    tp: TpSlot,
}

impl TransformerEncoderLayer {
    /// One layer of `config`'s encoder (its `n_layers` is not read), as Burn's `new`: for a
    /// model that holds its layers itself, or applies one layer several times (ALBERT).
    pub fn new(config: &TransformerEncoderConfig, device: &Device) -> Self {
        let parts = config.parts(device);
        Self {
            mha: parts.attention(),
            pwff: parts.pwff(),
            norm_1: parts.norm(),
            norm_2: parts.norm(),
            dropout: parts.dropout(),
            norm_first: config.norm_first,
            tp: TpSlot::default(),
        }
    }

    /// Burn's layer over `x` `[b, s, d_model]`, with the padding and attention masks (under
    /// sequence parallelism, a sequence the ranks do not split padded as
    /// [`TransformerEncoder::forward`] pads it).
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        let sp = self.tp.sequence_parallel();
        let input = TransformerEncoderInput {
            tensor: x,
            mask_pad,
            mask_attn,
        };
        let (input, s) = input.padded(sp);
        let x = Stream::whole(input.tensor).to(sp, "TransformerEncoderLayer");
        let x = x.map(|x| self.run(x, input.mask_pad, input.mask_attn, None));
        sequence::cut(x.into_whole(), s)
    }

    /// Burn's layer over `x` one decoding step at a time, through `cache`.
    pub fn forward_autoregressive_inference(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
        cache: &mut TransformerEncoderLayerAutoregressiveCache,
    ) -> Tensor<3> {
        self.run(x, mask_pad, mask_attn, Some(cache))
    }

    fn run(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
        cache: Option<&mut TransformerEncoderLayerAutoregressiveCache>,
    ) -> Tensor<3> {
        let (mha, pwff, c_1, c_2) = match cache {
            Some(c) => (
                Some(&mut c.mha),
                Some(&mut c.pwff),
                Some(&mut c.norm_1),
                Some(&mut c.norm_2),
            ),
            None => (None, None, None, None),
        };
        // Decoding with a cache computes one position: it runs whole.
        let sp = if mha.is_none() {
            self.tp.sequence_parallel()
        } else {
            None
        };
        let (n_1, n_2) = (norm_in(&self.norm_1, sp), norm_in(&self.norm_2, sp));
        let residual = |x| drop(&self.dropout, &self.tp, x, residual_region(sp));
        let attention = |x| match sp {
            Some(tp) => self_attention(&self.mha, x, tp, mask_pad, mask_attn),
            None => {
                let input = MhaInput::self_attn(x).masks(mask_pad, mask_attn);
                self.mha.attend(input, mha).context
            }
        };
        let feed_forward = |x| match sp {
            Some(tp) => self.pwff.over_sequence(x, tp),
            None => cached(pwff, x, 1, |x| self.pwff.forward(x)),
        };
        let norm_1 = |x| cached(c_1, x, 1, |x| n_1.forward(x));
        let norm_2 = |x| cached(c_2, x, 1, |x| n_2.forward(x));
        let norms = (norm_1, norm_2, self.norm_first);
        encoder_block(x, norms, attention, feed_forward, residual)
    }
}

/// Burn's `PositionWiseFeedForwardConfig`, field for field.
#[derive(Config, Debug)]
pub struct PositionWiseFeedForwardConfig {
    /// The size of the input and output features.
    pub d_model: usize,
    /// The size of the hidden inner features.
    pub d_ff: usize,
    /// The dropout rate.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The initializer of the linear layers (Burn's default).
    #[config(
        default = "burn::nn::transformer::PositionWiseFeedForwardConfig::new(1, 1).initializer"
    )]
    pub initializer: Initializer,
    /// The activation between the two linear layers (elementwise ones split).
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
}

impl PositionWiseFeedForwardConfig {
    /// The block on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> PositionWiseFeedForward {
        let linear = |i, o| {
            LinearConfig::new(i, o)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        let activation = self.activation.init(device);
        PositionWiseFeedForward {
            linear_inner: linear(self.d_model, self.d_ff),
            linear_outer: linear(self.d_ff, self.d_model),
            dropout: DropoutConfig::new(self.dropout).init(),
            tp: TpSlot::feed_forward(&activation),
            activation,
        }
    }
}

/// Burn's `PositionWiseFeedForward`.
#[derive(Module, Debug)]
pub struct PositionWiseFeedForward {
    /// `d_model` → `d_ff`.
    pub linear_inner: Linear,
    /// `d_ff` → `d_model`.
    pub linear_outer: Linear,
    /// The dropout after the activation.
    pub dropout: Dropout,
    /// The activation (not a module of the record, as in Burn's).
    #[module(skip)]
    pub activation: Activation,
    tp: TpSlot,
}

impl PositionWiseFeedForward {
    /// `linear_outer(dropout(activation(linear_inner(x))))`.
    ///
    /// # Panics
    ///
    /// Split, with an activation that does not act elementwise (SwiGlu, PRelu): it cannot run
    /// on a slice of the inner width.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.check_split();
        let x = self.activation.forward(self.linear_inner.forward(input));
        self.outer(x, Region::Tensor)
    }

    /// The block under sequence parallelism: from this rank's positions `x` to its positions
    /// of the output, through the whole sequence.
    fn over_sequence(&self, x: Tensor<3>, tp: &Comm) -> Tensor<3> {
        self.check_split();
        let [h] = sequence::column_products(x, tp, [&self.linear_inner]);
        self.outer(self.activation.forward(h), Region::Sequence)
    }

    /// The plan refused a split block whose activation does not act elementwise; this is an
    /// activation set on it after the split.
    fn check_split(&self) {
        if self.linear_inner.tp_size() > 1
            && let Some(reason) = not_elementwise(&self.activation)
        {
            panic!("PositionWiseFeedForward: {reason}");
        }
    }

    /// The dropout and the second layer, its output to `region`.
    fn outer<const D: usize>(&self, x: Tensor<D>, region: Region) -> Tensor<D> {
        // The inner activations are split: each rank draws its own mask.
        let x = drop(&self.dropout, &self.tp, x, RngRegion::TensorModelParallel);
        self.linear_outer.run(x, region)
    }
}

/// The residual dropout's stream: under sequence parallelism (`sp`) each rank's positions
/// differ, so their masks do too; whole, every rank holds the same stream, and its masks
/// must agree.
fn residual_region(sp: Option<&Comm>) -> RngRegion {
    match sp {
        Some(_) => RngRegion::TensorModelParallel,
        None => RngRegion::Default,
    }
}

/// Self-attention under sequence parallelism: from this rank's positions `x` to its
/// positions of the output; the query, key and value projected from the whole sequence with
/// one all-gather.
fn self_attention(
    mha: &MultiHeadAttention,
    x: Tensor<3>,
    tp: &Comm,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
) -> Tensor<3> {
    let qkv = sequence::column_products(x, tp, [&mha.query, &mha.key, &mha.value]);
    mha.attend_projected(qkv, mask_pad, mask_attn, Region::Sequence)
        .context
}

/// A layer's norm as it runs: whole, or under sequence parallelism (`sp`) with its
/// parameters' partial gradients summed over the ranks in backward.
fn norm_in(norm: &LayerNorm, sp: Option<&Comm>) -> LayerNorm {
    match sp {
        Some(tp) => sequence::norm_over_sequence(norm, tp),
        None => norm.clone(),
    }
}

/// Burn's dropout, or, once a plan split the layer, a mask from the plan's tracker's `region`.
pub(super) fn drop<const D: usize>(
    dropout: &Dropout,
    slot: &TpSlot,
    x: Tensor<D>,
    region: RngRegion,
) -> Tensor<D> {
    match slot.rng() {
        // Where Burn's layer drops: in training (its flag set, the tensor tracked).
        Some(rng) if dropout.training.is_enabled() => rng
            .dropout(x, dropout.prob, region)
            .expect("Burn's DropoutConfig::init refuses a probability outside [0, 1)"),
        Some(_) => x,
        None => dropout.forward(x),
    }
}

/// Burn's encoder layer around `attention` and `feed_forward`, with its roles of the two
/// norms: pre-norm (`norm_first`) is `x + d(attention(norm_2(x)))`, then
/// `x + d(feed_forward(norm_1(x)))`; post-norm is `norm_1(x + d(attention(x)))`, then
/// `norm_2(x + d(feed_forward(x)))`, `d` being the residual dropout.
fn encoder_block(
    x: Tensor<3>,
    (norm_1, norm_2, norm_first): (
        impl FnOnce(Tensor<3>) -> Tensor<3>,
        impl FnOnce(Tensor<3>) -> Tensor<3>,
        bool,
    ),
    attention: impl FnOnce(Tensor<3>) -> Tensor<3>,
    feed_forward: impl FnOnce(Tensor<3>) -> Tensor<3>,
    d: impl Fn(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    match norm_first {
        true => {
            let x = x.clone() + d(attention(norm_2(x)));
            x.clone() + d(feed_forward(norm_1(x)))
        }
        false => {
            let x = norm_1(x.clone() + d(attention(x)));
            norm_2(x.clone() + d(feed_forward(x)))
        }
    }
}

impl From<burn::nn::transformer::TransformerEncoder> for TransformerEncoder {
    /// Burn's built encoder, its parameters kept.
    fn from(encoder: burn::nn::transformer::TransformerEncoder) -> Self {
        Self {
            layers: encoder.layers.into_iter().map(Into::into).collect(),
            d_model: encoder.d_model,
            d_ff: encoder.d_ff,
            n_heads: encoder.n_heads,
            n_layers: encoder.n_layers,
            dropout: encoder.dropout,
            norm_first: encoder.norm_first,
            quiet_softmax: encoder.quiet_softmax,
        }
    }
}

impl From<burn::nn::transformer::TransformerEncoderLayer> for TransformerEncoderLayer {
    /// Burn's built layer, its parameters kept.
    fn from(layer: burn::nn::transformer::TransformerEncoderLayer) -> Self {
        Self {
            mha: layer.mha.into(),
            pwff: layer.pwff.into(),
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
            tp: TpSlot::default(),
        }
    }
}

impl From<burn::nn::transformer::PositionWiseFeedForward> for PositionWiseFeedForward {
    /// Burn's built block, its parameters kept.
    fn from(pwff: burn::nn::transformer::PositionWiseFeedForward) -> Self {
        Self {
            linear_inner: pwff.linear_inner.into(),
            linear_outer: pwff.linear_outer.into(),
            dropout: pwff.dropout,
            tp: TpSlot::feed_forward(&pwff.activation),
            activation: pwff.activation,
        }
    }
}
