//! The GPT forward: embeddings, the causal decoder, the final norm and the vocabulary-
//! parallel logits (Megatron's `parallel_lm_logits` when tied), and the causal-LM loss.

use super::{Gpt, GptEmbedding, GptHead};
use crate::context_parallel::ContextParallel;
use crate::models::attention::{AttentionInputs, CpAttention, LayerKvCache};
use crate::models::transformer::forward_layers;
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
};
use crate::tensor_parallel::{
    RngRegion, RngTracker, TpError, mask_vocab_padding, product, vocab_parallel_cross_entropy,
};
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

/// The positions of the tokens of one forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Positions {
    /// Every sample at `offset..offset + s` (training; decoding after `offset` tokens).
    Offset(usize),
    /// `[b][s]`: each token's own position, as a left-padded batch of prompts needs.
    PerSample(Vec<Vec<usize>>),
}

impl Default for Positions {
    fn default() -> Self {
        Self::Offset(0)
    }
}

impl Positions {
    /// The largest position plus one.
    fn end(&self, s: usize) -> usize {
        match self {
            Self::Offset(o) => o + s,
            Self::PerSample(rows) => rows.iter().flatten().map(|p| p + 1).max().unwrap_or(0),
        }
    }
}

/// Every layer's cached keys and values of a whole model (decoding).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerKvCache>,
}

impl KvCache {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKvCache::len)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`Gpt::forward_stage`] returns.
#[derive(Debug, Clone)]
pub enum GptStageOutput {
    /// `[s, b, h]` hidden states for the next stage (`[s / tp, b, h]` under SP).
    Hidden(Tensor<3>),
    /// `[s, b, V / tp]` logits over this rank's vocabulary slice.
    Logits(Tensor<3>),
}

impl Gpt {
    /// The whole model's logits, `[s, b, V / tp]`, for `ids` (`[b, s]`) at positions
    /// `0..s`, no dropout.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, TpError> {
        match self.forward_stage(Some(ids), None, None)? {
            GptStageOutput::Logits(l) => Ok(l),
            GptStageOutput::Hidden(_) => Err(TpError::Invalid(
                "Gpt::forward runs the whole model; this is one pipeline chunk (use forward_stage)"
                    .into(),
            )),
        }
    }

    /// One pipeline chunk's training forward: from token `ids` (`[b, s]`) on the first
    /// virtual stage, from the previous stage's `hidden` states elsewhere, at positions
    /// `0..s`, causal, no padding. Dropout applies when `rng` is given.
    pub fn forward_stage(
        &self,
        ids: Option<Tensor<2, Int>>,
        hidden: Option<Tensor<3>>,
        rng: Option<&RngTracker>,
    ) -> Result<GptStageOutput, TpError> {
        self.forward_with(ids, hidden, &Positions::default(), None, rng, None)
    }

    /// The general forward: tokens at `positions`, keys masked where `padding` (`[b, sk]`,
    /// true at padded keys, cached ones included) is true, and with a `cache` the new keys
    /// and values appended to it (the queries attend to all it holds).
    pub fn forward_with(
        &self,
        ids: Option<Tensor<2, Int>>,
        hidden: Option<Tensor<3>>,
        positions: &Positions,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
        cache: Option<&mut KvCache>,
    ) -> Result<GptStageOutput, TpError> {
        self.forward_impl(ids, hidden, positions, padding, rng, cache, None)
    }

    /// [`forward_stage`](Self::forward_stage) on this rank's share of sequences split over
    /// a context-parallel group: `ids` (`[b, s / cp]`, or the previous stage's hidden
    /// states) are the tokens at `cp.positions()` (split with [`ContextParallel::split`]),
    /// and attention sees every token of the sequence.
    pub fn forward_stage_cp(
        &self,
        ids: Option<Tensor<2, Int>>,
        hidden: Option<Tensor<3>>,
        rng: Option<&RngTracker>,
        cp: &ContextParallel,
    ) -> Result<GptStageOutput, TpError> {
        let b = match (&ids, &hidden) {
            (Some(ids), _) => ids.dims()[0],
            (None, Some(h)) => h.dims()[1],
            (None, None) => 0,
        };
        if let Some(layer) = self.layers.first() {
            cp.check_heads(layer.attention.heads_per_rank())?;
        }
        let positions = Positions::PerSample(vec![cp.positions().to_vec(); b]);
        self.forward_impl(ids, hidden, &positions, None, rng, None, Some(cp))
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_impl(
        &self,
        ids: Option<Tensor<2, Int>>,
        hidden: Option<Tensor<3>>,
        positions: &Positions,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
        mut cache: Option<&mut KvCache>,
        cp: Option<&ContextParallel>,
    ) -> Result<GptStageOutput, TpError> {
        self.state_attrs();
        let mut x = match (&self.embedding, ids, hidden) {
            (Some(e), Some(ids), None) => self.embed(e, ids, positions, rng)?,
            (None, None, Some(x)) => x,
            (e, i, x) => {
                return Err(crate::models::stage_input_error(
                    e.is_some(),
                    i.is_some(),
                    x.is_some(),
                ));
            }
        };
        let s = x.dims()[0]
            * if self.sequence_parallel {
                self.tp.group().size()
            } else {
                1
            };
        let rotary = self.rotary.as_ref().map(|r| match positions {
            Positions::Offset(o) => r.tables(s, *o, &x.device()),
            Positions::PerSample(rows) => r.tables_for(rows, &x.device()),
        });
        let context_parallel = cp.map(|cp| CpAttention {
            cp: cp.clone(),
            causal: true,
        });
        let inputs = AttentionInputs {
            padding,
            rotary,
            context_parallel,
        };
        if let Some(cache) = cache.as_deref_mut() {
            cache
                .layers
                .resize_with(self.layers.len(), LayerKvCache::default);
        }
        match cache {
            Some(cache) => {
                for (layer, layer_cache) in self.layers.iter().zip(&mut cache.layers) {
                    x = layer.forward_with_cache(x, &inputs, rng, Some(layer_cache));
                }
            }
            None => x = forward_layers(&self.layers, x, &inputs, rng, &self.recompute),
        }
        match &self.head {
            None => Ok(GptStageOutput::Hidden(x)),
            Some(head) => self.logits(head, x).map(GptStageOutput::Logits),
        }
    }

    fn embed(
        &self,
        e: &GptEmbedding,
        ids: Tensor<2, Int>,
        positions: &Positions,
        rng: Option<&RngTracker>,
    ) -> Result<Tensor<3>, TpError> {
        let _span = tracing::debug_span!("gpt.embedding").entered();
        let [b, s] = ids.dims();
        if let Positions::PerSample(rows) = positions
            && (rows.len() != b || rows.iter().any(|r| r.len() != s))
        {
            return Err(TpError::Invalid(format!(
                "positions for {} samples of lengths {:?}, for token ids of dims [{b}, {s}]",
                rows.len(),
                rows.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        if let Some(table) = &e.position_embeddings {
            let (end, max) = (positions.end(s), table.weight.dims()[0]);
            if end > max {
                return Err(TpError::Invalid(format!(
                    "position {} is outside the learned position table (max_position_embeddings {max})",
                    end - 1
                )));
            }
        }
        let ids = e.word_embeddings.checked_ids(ids)?;
        let device = ids.device();
        let mut x = e.word_embeddings.forward(ids);
        if let Some(table) = &e.position_embeddings {
            let flat: Vec<i64> = match positions {
                Positions::Offset(o) => {
                    (0..b).flat_map(|_| (*o..o + s).map(|p| p as i64)).collect()
                }
                Positions::PerSample(rows) => rows.iter().flatten().map(|&p| p as i64).collect(),
            };
            let ids = Tensor::<2, Int>::from_data(TensorData::new(flat, [b, s]), &device);
            x = x + table.forward(ids);
        }
        let mut x = x.swap_dims(0, 1); // [s, b, h]
        if let Some(rng) = rng {
            x = rng
                .dropout(x, self.hidden_dropout, RngRegion::Default)
                .expect("hidden_dropout is checked to lie in [0, 1) at init");
        }
        if self.sequence_parallel {
            x = scatter_to_sequence_parallel_region(x, &self.tp);
        }
        Ok(x)
    }

    /// Final norm, then `[s, b, h]` → `[s, b, V / tp]` through the output layer or the
    /// word embeddings (as Megatron's `parallel_lm_logits`: the input copied into the
    /// tensor-parallel region, or all-gathered from the sequence-parallel one).
    fn logits(&self, head: &GptHead, x: Tensor<3>) -> Result<Tensor<3>, TpError> {
        let _span = tracing::debug_span!("gpt.output_layer").entered();
        let x = head.final_layernorm.forward(x);
        let logits = match (&head.output_layer, &head.word_embeddings, &self.embedding) {
            (Some(output), ..) => output.forward(x),
            (None, Some(w), _)
            | (
                None,
                None,
                Some(GptEmbedding {
                    word_embeddings: w, ..
                }),
            ) => {
                let x = if self.sequence_parallel {
                    gather_from_sequence_parallel_region(x, &self.tp, true)
                } else {
                    copy_to_tensor_model_parallel_region(x, &self.tp)
                };
                // A 2-d product over all positions: a broadcast [1, h, V] weight would make
                // backward materialise one [h, V] gradient per position before summing them.
                crate::tensor_parallel::refuse_adapter(&w.weight, "the tied output head");
                product(x, w.weight.val().transpose())
            }
            (None, None, None) => {
                return Err(TpError::Invalid(
                    "a tied last-stage chunk without a copy of the word embeddings".into(),
                ));
            }
        };
        Ok(self.mask_vocab_padding(logits))
    }

    /// Sets the logits of this rank's vocabulary padding rows to −10⁴, if it holds any.
    fn mask_vocab_padding(&self, logits: Tensor<3>) -> Tensor<3> {
        mask_vocab_padding(logits, self.vocab_size, self.tp.group().rank())
    }

    /// The causal-LM loss: cross-entropy of `logits` (`[s, b, V / tp]`) against `labels`
    /// (`[b, s]`, the next token of each position), averaged over the positions where
    /// `loss_mask` (`[b, s]`) is non-zero, in f32 (Megatron's `loss_func`).
    pub fn loss(
        &self,
        logits: Tensor<3>,
        labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
    ) -> Result<Tensor<1>, TpError> {
        let (sum, tokens) = self.masked_loss_sum(logits, labels, loss_mask)?;
        Ok(sum / tokens.clamp_min(1.0))
    }

    /// The vocabulary-parallel cross-entropy summed over the positions `loss_mask` keeps,
    /// and their count.
    fn masked_loss_sum(
        &self,
        logits: Tensor<3>,
        labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
    ) -> Result<(Tensor<1>, Tensor<1>), TpError> {
        let _span = tracing::debug_span!("gpt.loss").entered();
        let [s, b, v] = logits.dims();
        if labels.dims() != [b, s] || loss_mask.dims() != [b, s] {
            return Err(TpError::Invalid(format!(
                "labels of dims {:?} and a loss mask of dims {:?} for logits of dims [{s}, {b}, {v}] (want [{b}, {s}])",
                labels.dims(),
                loss_mask.dims()
            )));
        }
        let labels = labels.swap_dims(0, 1).reshape([s * b]);
        let mask = loss_mask.swap_dims(0, 1).reshape([s * b]).cast(DType::F32);
        let tokens = mask.clone().sum();
        let losses =
            vocab_parallel_cross_entropy(logits.reshape([s * b, v]), labels, 0.0, &self.tp)?;
        Ok(((losses.cast(DType::F32) * mask).sum(), tokens))
    }

    /// [`loss`](Self::loss) of this rank's share of sequences split over `cp`: its tokens'
    /// losses over the token count of the whole sequences, so that the CP ranks' losses
    /// sum to the unsplit loss and their gradients sum to its gradients (reduce them with
    /// a sum over CP; Megatron scales the loss by CP and averages over DP × CP).
    pub fn loss_cp(
        &self,
        logits: Tensor<3>,
        labels: Tensor<2, Int>,
        loss_mask: Tensor<2>,
        cp: &ContextParallel,
    ) -> Result<Tensor<1>, TpError> {
        let (sum, local) = self.masked_loss_sum(logits, labels, loss_mask)?;
        Ok(sum / cp.sum_tensor(local).clamp_min(1.0))
    }
}
