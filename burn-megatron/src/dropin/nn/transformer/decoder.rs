//! Burn's `nn::transformer::TransformerDecoder`: self-attention, cross-attention over an
//! encoder's memory and the feed-forward network, each split as Megatron splits a layer
//! once an `encoder` rule names the decoder (or a layer of it); the norms stay whole, and
//! the residual stream's dropout draws the same mask on every rank.

use super::super::super::slot::TpSlot;
use super::super::Region;
use super::super::attention::{MhaCache, MhaInput, MultiHeadAttention};
use super::super::cache::{TensorCache, cached};
use super::super::sequence;
use super::super::sequence::Stream;
use super::{
    Parts, PositionWiseFeedForward, check_cache, drop, norm_in, residual_region, self_attention,
};
use crate::comm::Comm;
use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::ActivationConfig;
use burn::nn::{Dropout, Initializer, LayerNorm};
use burn::tensor::{Bool, Device, Tensor};

/// Burn's `TransformerDecoderConfig`, field for field.
#[derive(Config, Debug)]
pub struct TransformerDecoderConfig {
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
    /// Layer norm before each block instead of after.
    #[config(default = false)]
    pub norm_first: bool,
    /// "Quiet softmax" instead of the regular one.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// The initializer of the linear layers (Burn's default).
    #[config(
        default = "burn::nn::transformer::TransformerDecoderConfig::new(1, 1, 1, 1).initializer"
    )]
    pub initializer: Initializer,
    /// The feed-forward network's activation (elementwise ones split).
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The layer norms' epsilon.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

impl TransformerDecoderConfig {
    /// The decoder on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> TransformerDecoder {
        let layer = |_| TransformerDecoderLayer::new(self, device);
        TransformerDecoder {
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

/// Burn's `TransformerDecoder`.
#[derive(Module, Debug)]
pub struct TransformerDecoder {
    /// The layers.
    pub layers: Vec<TransformerDecoderLayer>,
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

impl TransformerDecoder {
    /// The target `[b, s_t, d_model]` after every layer, whole on every rank. Under sequence
    /// parallelism a target the ranks do not split is padded at its end and the padding
    /// masked, then cut off the output.
    pub fn forward(&self, input: TransformerDecoderInput) -> Tensor<3> {
        let sp = self.layers.iter().find_map(|l| l.tp.sequence_parallel());
        let (input, s) = input.padded(sp);
        let mut target = Stream::whole(input.target.clone());
        for layer in &self.layers {
            target = target.to(layer.tp.sequence_parallel(), "TransformerDecoderLayer");
            target = target.map(|t| layer.run(input.with_target(t), None).target);
        }
        sequence::cut(target.into_whole(), s)
    }

    /// Burn's `forward_autoregressive_inference`: one decoding step, each call's target one
    /// position longer than the last (the memory the same), only the new position computed.
    ///
    /// # Panics
    ///
    /// On a cache made for another number of layers.
    pub fn forward_autoregressive_inference(
        &self,
        mut input: TransformerDecoderInput,
        cache: &mut TransformerDecoderAutoregressiveCache,
    ) -> Tensor<3> {
        check_cache(cache.layers.len(), self.layers.len());
        for (layer, cache) in self.layers.iter().zip(&mut cache.layers) {
            input = layer.run(input, Some(cache));
        }
        input.target
    }

    /// An empty cache for [`forward_autoregressive_inference`](Self::forward_autoregressive_inference).
    pub fn new_autoregressive_cache(&self) -> TransformerDecoderAutoregressiveCache {
        TransformerDecoderAutoregressiveCache {
            layers: (self.layers.iter())
                .map(|_| TransformerDecoderLayerAutoregressiveCache::empty())
                .collect(),
        }
    }
}

/// Burn's `TransformerDecoderInput`: the target, the encoder's memory, and their masks.
#[derive(Debug, Clone)]
pub struct TransformerDecoderInput {
    target: Tensor<3>,
    target_mask_pad: Option<Tensor<2, Bool>>,
    target_mask_attn: Option<Tensor<3, Bool>>,
    memory: Tensor<3>,
    memory_mask_pad: Option<Tensor<2, Bool>>,
    memory_mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerDecoderInput {
    /// The target `[b, s_t, d_model]` attending to `memory` `[b, s_m, d_model]`.
    pub fn new(target: Tensor<3>, memory: Tensor<3>) -> Self {
        Self {
            target,
            target_mask_pad: None,
            target_mask_attn: None,
            memory,
            memory_mask_pad: None,
            memory_mask_attn: None,
        }
    }

    /// This input, its target padded at its end to a length `sp`'s group splits
    /// ([`sequence::missing_positions`]; the memory stays as it is), and the target's own
    /// length.
    fn padded(&self, sp: Option<&Comm>) -> (Self, usize) {
        let [b, s, _] = self.target.dims();
        let extra = sequence::missing_positions(s, sp);
        if extra == 0 {
            return (self.clone(), s);
        }
        let device = self.target.device();
        let padded = Self {
            target: sequence::pad_positions(self.target.clone(), extra),
            target_mask_pad: sequence::pad_mask(
                self.target_mask_pad.clone(),
                [b, s],
                extra,
                &device,
            ),
            target_mask_attn: sequence::pad_attn(self.target_mask_attn.clone(), extra, extra),
            memory: self.memory.clone(),
            memory_mask_pad: self.memory_mask_pad.clone(),
            memory_mask_attn: sequence::pad_attn(self.memory_mask_attn.clone(), extra, 0),
        };
        (padded, s)
    }

    /// This input with another target (a layer's output, or a rank's positions of it).
    fn with_target(&self, target: Tensor<3>) -> Self {
        Self {
            target,
            ..self.clone()
        }
    }

    /// Memory positions to ignore, `[b, s_m]` (true: padding).
    pub fn memory_mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask_pad);
        self
    }

    /// Target-memory pairs to ignore, `[b, s_t, s_m]`.
    pub fn memory_mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.memory_mask_attn = Some(mask_attn);
        self
    }

    /// Target positions to ignore, `[b, s_t]`.
    pub fn target_mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.target_mask_pad = Some(mask_pad);
        self
    }

    /// Target pairs to ignore, `[b, s_t, s_t]` (a causal mask).
    pub fn target_mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.target_mask_attn = Some(mask_attn);
        self
    }
}

/// Burn's `TransformerDecoderLayer`.
#[derive(Module, Debug)]
pub struct TransformerDecoderLayer {
    /// The attention over the memory.
    pub cross_attn: MultiHeadAttention,
    /// The self-attention.
    pub self_attn: MultiHeadAttention,
    /// The feed-forward network.
    pub pwff: PositionWiseFeedForward,
    /// The norm around the cross-attention.
    pub norm_1: LayerNorm,
    /// The norm around the feed-forward network.
    pub norm_2: LayerNorm,
    /// The norm before the self-attention (pre-norm) or after the layer (post-norm).
    pub norm_3: LayerNorm,
    /// The residual branches' dropout.
    pub dropout: Dropout,
    /// Pre-norm.
    pub norm_first: bool,
    tp: TpSlot,
}

impl TransformerDecoderLayer {
    /// One layer of `config`'s decoder (its `n_layers` is not read), as Burn's `new`.
    pub fn new(config: &TransformerDecoderConfig, device: &Device) -> Self {
        let parts = Parts {
            d_model: config.d_model,
            d_ff: config.d_ff,
            n_heads: config.n_heads,
            dropout: config.dropout,
            quiet_softmax: config.quiet_softmax,
            initializer: &config.initializer,
            activation: &config.activation,
            layer_norm_eps: config.layer_norm_eps,
            device,
        };
        Self {
            cross_attn: parts.attention(),
            self_attn: parts.attention(),
            pwff: parts.pwff(),
            norm_1: parts.norm(),
            norm_2: parts.norm(),
            norm_3: parts.norm(),
            dropout: parts.dropout(),
            norm_first: config.norm_first,
            tp: TpSlot::default(),
        }
    }

    /// Burn's layer: its norms where Burn puts them (`norm_3` before the self-attention
    /// pre-norm, after the layer post-norm). Under sequence parallelism a target the ranks do
    /// not split is padded as [`TransformerDecoder::forward`] pads it.
    pub fn forward(&self, input: TransformerDecoderInput) -> TransformerDecoderInput {
        let sp = self.tp.sequence_parallel();
        let (padded, s) = input.padded(sp);
        let target = Stream::whole(padded.target.clone()).to(sp, "TransformerDecoderLayer");
        let target = target.map(|t| self.run(padded.with_target(t), None).target);
        input.with_target(sequence::cut(target.into_whole(), s))
    }

    /// Burn's layer one decoding step at a time, through `cache`.
    pub fn forward_autoregressive_inference(
        &self,
        input: TransformerDecoderInput,
        cache: &mut TransformerDecoderLayerAutoregressiveCache,
    ) -> TransformerDecoderInput {
        self.run(input, Some(cache))
    }

    fn run(
        &self,
        mut input: TransformerDecoderInput,
        cache: Option<&mut TransformerDecoderLayerAutoregressiveCache>,
    ) -> TransformerDecoderInput {
        let (c_self, c_cross, c_pwff, c_1, c_2, c_3) = match cache {
            Some(c) => (
                Some(&mut c.self_attn),
                Some(&mut c.cross_attn),
                Some(&mut c.pwff),
                Some(&mut c.norm_1),
                Some(&mut c.norm_2),
                Some(&mut c.norm_3),
            ),
            None => (None, None, None, None, None, None),
        };
        // Decoding with a cache computes one position: it runs whole.
        let sp = if c_self.is_none() {
            self.tp.sequence_parallel()
        } else {
            None
        };
        let n_1 = norm_in(&self.norm_1, sp);
        let (n_2, n_3) = (norm_in(&self.norm_2, sp), norm_in(&self.norm_3, sp));
        let d = |x| drop(&self.dropout, &self.tp, x, residual_region(sp));
        let norm_1 = |x| cached(c_1, x, 1, |x| n_1.forward(x));
        let norm_2 = |x| cached(c_2, x, 1, |x| n_2.forward(x));
        let norm_3 = |x| cached(c_3, x, 1, |x| n_3.forward(x));
        let (target_pad, target_attn) = (&input.target_mask_pad, &input.target_mask_attn);
        let self_attn = |x| {
            let (pad, attn) = (target_pad.clone(), target_attn.clone());
            match sp {
                Some(tp) => self_attention(&self.self_attn, x, tp, pad, attn),
                None => {
                    let h = MhaInput::self_attn(x).masks(pad, attn);
                    self.self_attn.attend(h, c_self).context
                }
            }
        };
        let memory = &input.memory;
        let (memory_pad, memory_attn) = (&input.memory_mask_pad, &input.memory_mask_attn);
        let cross_attn = |x| {
            let (pad, attn) = (memory_pad.clone(), memory_attn.clone());
            match sp {
                // The query from the whole target sequence; the memory is whole on every rank.
                Some(tp) => {
                    let [q] = sequence::column_products(x, tp, [&self.cross_attn.query]);
                    let k = self.cross_attn.key.forward(memory.clone());
                    let v = self.cross_attn.value.forward(memory.clone());
                    let out =
                        self.cross_attn
                            .attend_projected([q, k, v], pad, attn, Region::Sequence);
                    out.context
                }
                None => {
                    let h = MhaInput::new(x, memory.clone(), memory.clone()).masks(pad, attn);
                    self.cross_attn.attend(h, c_cross).context
                }
            }
        };
        let feed_forward = |x| match sp {
            Some(tp) => self.pwff.over_sequence(x, tp),
            None => cached(c_pwff, x, 1, |x| self.pwff.forward(x)),
        };
        let x = input.target.clone();
        let target = match self.norm_first {
            true => {
                let x = x.clone() + d(self_attn(norm_3(x)));
                let x = x.clone() + d(cross_attn(norm_1(x)));
                x.clone() + d(feed_forward(norm_2(x)))
            }
            false => {
                let x = norm_1(x.clone() + d(self_attn(x)));
                let x = norm_2(x.clone() + d(cross_attn(x)));
                norm_3(x.clone() + d(feed_forward(x)))
            }
        };
        input.target = target;
        input
    }
}

/// Burn's cache of a decoder's layers for autoregressive inference.
#[derive(Debug, Clone)]
pub struct TransformerDecoderAutoregressiveCache {
    layers: Vec<TransformerDecoderLayerAutoregressiveCache>,
}

/// Burn's cache of one decoder layer's parts.
#[derive(Debug, Clone)]
pub struct TransformerDecoderLayerAutoregressiveCache {
    /// The cross-attention's (the memory's keys and values projected once).
    pub cross_attn: MhaCache,
    /// The self-attention's.
    pub self_attn: MhaCache,
    /// The feed-forward network's.
    pub pwff: TensorCache<3>,
    /// The first norm's.
    pub norm_1: TensorCache<3>,
    /// The second norm's.
    pub norm_2: TensorCache<3>,
    /// The third norm's.
    pub norm_3: TensorCache<3>,
}

impl TransformerDecoderLayerAutoregressiveCache {
    /// An empty cache.
    pub fn empty() -> Self {
        Self {
            cross_attn: MhaCache::autoregressive_cross_attention(),
            self_attn: MhaCache::autoregressive(),
            pwff: TensorCache::empty(),
            norm_1: TensorCache::empty(),
            norm_2: TensorCache::empty(),
            norm_3: TensorCache::empty(),
        }
    }
}

impl From<burn::nn::transformer::TransformerDecoder> for TransformerDecoder {
    /// Burn's built decoder, its parameters kept.
    fn from(decoder: burn::nn::transformer::TransformerDecoder) -> Self {
        Self {
            layers: decoder.layers.into_iter().map(Into::into).collect(),
            d_model: decoder.d_model,
            d_ff: decoder.d_ff,
            n_heads: decoder.n_heads,
            n_layers: decoder.n_layers,
            dropout: decoder.dropout,
            norm_first: decoder.norm_first,
            quiet_softmax: decoder.quiet_softmax,
        }
    }
}

impl From<burn::nn::transformer::TransformerDecoderLayer> for TransformerDecoderLayer {
    /// Burn's built layer, its parameters kept.
    fn from(layer: burn::nn::transformer::TransformerDecoderLayer) -> Self {
        Self {
            cross_attn: layer.cross_attn.into(),
            self_attn: layer.self_attn.into(),
            pwff: layer.pwff.into(),
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            norm_3: layer.norm_3,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
            tp: TpSlot::default(),
        }
    }
}
