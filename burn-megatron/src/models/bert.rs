//! `Bert`: vocab-parallel embeddings, a tensor-parallel encoder, the MLM head tied to the word
//! embedding, and the pooler with its binary (NSP/SOP) head — whole, or one pipeline chunk
//! of it (embeddings on the first virtual stage, heads on the last).

mod head;
mod legacy;

pub use head::MaskedPositions;

use super::attention::{AttentionInputs, AttnMaskType, CpAttention};
use super::norm::FusedLayerNorm;
use super::transformer::{TransformerLayer, TransformerLayerConfig, forward_layers};
use crate::comm::Comm;
use crate::context_parallel::ContextParallel;
use crate::recompute::RecomputeConfig;
use crate::tensor_parallel::mappings::{
    gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region,
};
use crate::tensor_parallel::{
    IdCheck, LayoutOwner, ParallelAttrs, RngRegion, RngTracker, TpError, VocabParallelEmbedding,
    VocabParallelEmbeddingConfig, checked_index, derive_seed, host_param,
};
use crate::topology::PipelinePosition;
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

/// BERT's shape, named as Megatron's arguments: the model's own fields (layers, vocabulary,
/// positions, token types) around one [`TransformerLayerConfig`] for all its layers, whose
/// `initializer` draws the embeddings and heads too and whose `seed` is the model's. BERT's
/// attention is bidirectional: `transformer.attention.attn_mask_type` must be `Padding` (the
/// default).
///
/// ```
/// use burn_megatron::models::{
///     BertConfig, ParallelAttentionConfig, ParallelMlpConfig, TransformerLayerConfig,
/// };
/// // BERT-base's encoder: 12 layers of width 768, 12 heads, an MLP of 3072, post-norm.
/// let layer = TransformerLayerConfig::new(768, ParallelAttentionConfig::new(12), ParallelMlpConfig::new(3072));
/// let bert = BertConfig::new(12, 512, 30592, layer);
/// assert_eq!(bert.transformer.attention.head_dim(768), 64);
/// ```
#[derive(Config, Debug)]
pub struct BertConfig {
    /// Transformer layers.
    pub num_layers: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Vocabulary size padded to a multiple of 128 × TP.
    pub padded_vocab_size: usize,
    /// Every encoder layer's shape and switches (Megatron-Core's `TransformerConfig`; its
    /// `normalization` applies to the encoder layers, the embedding and MLM-head norms are
    /// LayerNorm with its `layernorm_epsilon`).
    pub transformer: TransformerLayerConfig,
    /// Token types (segments).
    #[config(default = 2)]
    pub num_tokentypes: usize,
}

/// Word, position and token-type embeddings with their LayerNorm: the first pipeline stage's
/// part (Megatron's `pre_process`).
#[derive(Module, Debug)]
pub struct BertEmbeddings {
    /// Word embeddings, split by vocabulary rows; also the MLM output projection when the
    /// whole model is on one stage.
    pub word_embeddings: VocabParallelEmbedding,
    /// Learned positions (duplicated).
    pub position_embeddings: Embedding,
    /// Token types (duplicated).
    pub tokentype_embeddings: Embedding,
    /// LayerNorm after the embedding sum.
    pub embedding_layernorm: FusedLayerNorm,
}

/// The MLM head and the pooler with its binary head: the last pipeline stage's part
/// (Megatron's `post_process`).
#[derive(Module, Debug)]
pub struct BertHead {
    /// MLM head transform.
    pub lm_dense: Linear,
    /// MLM head LayerNorm.
    pub lm_layernorm: FusedLayerNorm,
    /// MLM output bias, split like the vocabulary.
    pub lm_bias: Param<Tensor<1>>,
    /// Pooler on the first token.
    pub pooler: Linear,
    /// Binary (NSP / SOP) classifier.
    pub binary_head: Linear,
    /// With pipeline stages, the last stage's copy of the word embeddings (the tied MLM
    /// output projection): initialised like the first stage's, its gradient summed with
    /// theirs over the embedding group. `None` when the first stage is this model too.
    pub word_embeddings: Option<VocabParallelEmbedding>,
}

/// BERT for pretraining: one tensor-parallel rank's part of one pipeline model chunk.
/// Built by [`BertConfig::init`] for the whole model, [`BertConfig::init_stage`] per chunk.
#[derive(Module, Debug)]
pub struct Bert {
    /// The embeddings, on the first virtual pipeline stage.
    pub embeddings: Option<BertEmbeddings>,
    /// This chunk's encoder layers.
    pub layers: Vec<TransformerLayer>,
    /// The heads, on the last virtual pipeline stage.
    pub head: Option<BertHead>,
    #[module(skip)]
    tp: Comm,
    /// Holds what only the model states (the MLM bias's split, the tie).
    #[module(skip)]
    layout: LayoutOwner,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    hidden_dropout: f64,
    /// The global index of this chunk's first layer.
    #[module(skip)]
    first_layer: usize,
    #[module(skip)]
    recompute: RecomputeConfig,
}

/// What [`Bert::forward`] returns.
#[derive(Debug, Clone)]
pub struct BertOutput {
    /// MLM logits over this rank's vocabulary slice: `[s, b, V / tp]` at every position, or
    /// `[m, 1, V / tp]` at the `m` rows of [`lm_positions`](Self::lm_positions).
    pub lm_logits: Tensor<3>,
    /// `[b, 2]` binary-head logits.
    pub binary_logits: Tensor<2>,
    /// The positions the MLM head ran on, when not all of them.
    pub lm_positions: Option<MaskedPositions>,
}

/// What [`Bert::forward_stage`] returns: the heads' output on the last stage, the hidden
/// states for the next stage elsewhere.
#[derive(Debug, Clone)]
// Made and taken apart once per forward: a box would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum BertStageOutput {
    /// `[s, b, h]` hidden states (`[s / tp, b, h]` under sequence parallelism).
    Hidden(Tensor<3>),
    /// The heads' logits.
    Output(BertOutput),
}

impl BertConfig {
    /// This config with `f` applied to its layers' config, for builder chains:
    /// `config.map_transformer(|t| t.with_sequence_parallel(true))`.
    pub fn map_transformer(
        mut self,
        f: impl FnOnce(TransformerLayerConfig) -> TransformerLayerConfig,
    ) -> Self {
        self.transformer = f(self.transformer);
        self
    }

    /// The configuration of layer `index` (global), as this model builds it: with a seed of
    /// its own.
    pub fn layer_config(&self, index: usize) -> TransformerLayerConfig {
        let mut layer = self.transformer.clone();
        layer.seed = derive_seed(self.transformer.seed, &format!("layers.{index}"));
        layer
    }

    /// Initialises this rank's part of the whole model; identical weights at every TP size
    /// for one seed.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<Bert, TpError> {
        self.init_stage(tp, PipelinePosition::whole(), device)
    }

    /// Initialises this rank's part of the model chunk at `position`: the layers
    /// [`PipelinePosition::layer_range`], the embeddings on the first virtual stage and the
    /// heads on the last. Every weight equals the same weight of the whole model (seeds
    /// follow global layer indices); the last stage's copy of the word embeddings equals the
    /// first stage's.
    pub fn init_stage(
        &self,
        tp: &Comm,
        position: PipelinePosition,
        device: &Device,
    ) -> Result<Bert, TpError> {
        let t = &self.transformer;
        if t.attention.attn_mask_type != AttnMaskType::Padding {
            return Err(TpError::Invalid(
                "BERT's attention is bidirectional: set transformer.attention.attn_mask_type to \
                 Padding"
                    .into(),
            ));
        }
        super::check_dropout(&[
            ("hidden_dropout", t.hidden_dropout),
            ("attention_dropout", t.attention.attention_dropout),
        ])?;
        super::check_epsilon(t.layernorm_epsilon)?;
        t.recompute
            .check(self.num_layers)
            .map_err(|e| TpError::Invalid(e.0))?;
        let layer_range = position
            .layer_range(self.num_layers)
            .map_err(|e| TpError::Invalid(e.to_string()))?;
        let (h, seed) = (t.hidden_size, t.seed);
        let first_layer = layer_range.start;
        let normal = t.initializer;
        normal.check()?;
        let table = |rows: usize, name: &str| Embedding {
            weight: host_param(
                normal.values(rows * h, h, derive_seed(seed, name)),
                [rows, h],
                device,
            ),
        };
        let linear = |d_in: usize, d_out: usize, name: &str| Linear {
            weight: host_param(
                normal.values(d_in * d_out, d_in, derive_seed(seed, name)),
                [d_in, d_out],
                device,
            ),
            bias: Some(host_param(vec![0.0; d_out], [d_out], device)),
        };
        let ln = || FusedLayerNorm::new(h, t.layernorm_epsilon, device);
        let word_embeddings = || {
            VocabParallelEmbeddingConfig::new(self.padded_vocab_size, h)
                .with_initializer(normal)
                .with_seed(derive_seed(seed, "word_embeddings"))
                .init(tp, device)
        };
        let (first, last) = (position.is_first_stage(), position.is_last_stage());
        let embeddings = first
            .then(|| -> Result<_, TpError> {
                Ok(BertEmbeddings {
                    word_embeddings: word_embeddings()?,
                    position_embeddings: table(self.max_position_embeddings, "position_embeddings"),
                    tokentype_embeddings: table(self.num_tokentypes, "tokentype_embeddings"),
                    embedding_layernorm: ln(),
                })
            })
            .transpose()?;
        let layers = layer_range
            .map(|i| self.layer_config(i).init(tp, device))
            .collect::<Result<Vec<_>, _>>()?;
        let head = last
            .then(|| -> Result<_, TpError> {
                let part = self.padded_vocab_size / tp.group().size();
                let lm_bias = host_param(vec![0.0; part], [part], device);
                let word_embeddings = (!first).then(word_embeddings).transpose()?;
                Ok(BertHead {
                    lm_dense: linear(h, h, "lm_head.dense"),
                    lm_layernorm: ln(),
                    lm_bias,
                    pooler: linear(h, h, "pooler"),
                    binary_head: linear(h, 2, "binary_head"),
                    word_embeddings,
                })
            })
            .transpose()?;
        let bert = Bert {
            embeddings,
            layers,
            head,
            tp: tp.clone(),
            layout: LayoutOwner::default(),
            sequence_parallel: t.sequence_parallel,
            hidden_dropout: t.hidden_dropout,
            first_layer,
            recompute: t.recompute.clone(),
        };
        bert.state_attrs();
        Ok(bert)
    }
}

/// Refuses token ids, token types or a sequence length the embedding tables do not cover,
/// the same way at every TP size (a vocabulary-parallel lookup would zero an unknown id).
/// Ids and types outside their tables are refused or clamped as the word embeddings'
/// [`IdCheck`] says.
fn check_inputs(
    e: &BertEmbeddings,
    ids: Tensor<2, Int>,
    types: Tensor<2, Int>,
    cp: Option<&ContextParallel>,
) -> Result<(Tensor<2, Int>, Tensor<2, Int>), TpError> {
    let s = cp.map_or(ids.dims()[1], ContextParallel::seq_length);
    if let Some(cp) = cp.filter(|cp| cp.positions().len() != ids.dims()[1]) {
        return Err(TpError::Invalid(format!(
            "token ids of dims {:?} on a context-parallel rank that holds {} of {} tokens",
            ids.dims(),
            cp.positions().len(),
            cp.seq_length()
        )));
    }
    let max_pos = e.position_embeddings.weight.dims()[0];
    if s > max_pos {
        return Err(TpError::Invalid(format!(
            "sequence length {s} exceeds max_position_embeddings {max_pos}"
        )));
    }
    if types.dims() != ids.dims() {
        return Err(TpError::Invalid(format!(
            "token types of dims {:?} for token ids of dims {:?}",
            types.dims(),
            ids.dims()
        )));
    }
    let tokentypes = e.tokentype_embeddings.weight.dims()[0];
    let check = e.word_embeddings.id_check();
    Ok((
        e.word_embeddings.checked_ids(ids)?,
        checked_index(types, tokentypes, check, "token type", "num_tokentypes")?,
    ))
}

impl Bert {
    /// The same model, treating token ids and token types outside their tables as `check`
    /// says: by default [`IdCheck::Refuse`] (host reads in each forward of the first stage);
    /// [`IdCheck::Clamp`] when the data loader checked them on the host.
    pub fn with_id_check(mut self, check: IdCheck) -> Self {
        self.embeddings = self.embeddings.map(|e| BertEmbeddings {
            word_embeddings: e.word_embeddings.with_id_check(check),
            ..e
        });
        self
    }

    /// The layout-independent name of the parameter at `path` in a model of `chunks` (as
    /// module paths of a `Vec<Bert>` read, `"1.layers.0.…"`; or of one `Bert`): layers by
    /// global index, and the last stage's copy of the tied word embeddings under the first
    /// stage's name. What checkpoints key tensors by.
    ///
    /// ```
    /// use burn_megatron::models::Bert;
    /// assert_eq!(Bert::global_param_name(&[], "head.word_embeddings.weight"),
    ///            "embeddings.word_embeddings.weight");
    /// ```
    pub fn global_param_name(chunks: &[Bert], path: &str) -> String {
        let first: Vec<usize> = chunks.iter().map(Bert::first_layer).collect();
        Self::global_param_name_at(&first, path)
    }

    /// [`Bert::global_param_name`] from each chunk's [`first_layer`](Bert::first_layer).
    pub fn global_param_name_at(first_layers: &[usize], path: &str) -> String {
        super::global_param_name(
            first_layers,
            path,
            "head.word_embeddings.",
            "embeddings.word_embeddings.",
        )
    }

    /// The tensor-parallel group this model is split over.
    pub fn tp(&self) -> &Comm {
        &self.tp
    }

    /// The global index of this chunk's first layer.
    pub fn first_layer(&self) -> usize {
        self.first_layer
    }

    /// States what only the model knows: the MLM bias is split with the vocabulary, and on
    /// a pipeline the first stage's word embeddings and the last stage's copy are one tied
    /// weight. At init and at every forward, like the layers (see
    /// [`set_layout_attrs`](crate::tensor_parallel::set_layout_attrs)).
    fn state_attrs(&self) {
        if let (Some(e), None) = (&self.embeddings, &self.head) {
            super::tie(&self.layout, &e.word_embeddings, false);
        }
        if let Some(head) = &self.head {
            self.layout
                .state(head.lm_bias.id, ParallelAttrs::sharded(0));
            if let Some(copy) = &head.word_embeddings {
                copy.state_attrs();
                super::tie(&self.layout, copy, true);
            }
        }
    }

    /// `ids`, `token_types`: `[b, s]`; `padding`: `[b, s]`, true at padded positions.
    /// Dropout applies when `rng` is given.
    ///
    /// # Panics
    ///
    /// On a pipeline chunk that lacks the embeddings or the heads (built by
    /// [`BertConfig::init_stage`] for P·V > 1): use [`Bert::forward_stage`] there. On inputs
    /// the embeddings do not cover (a token id ≥ the vocabulary, a token type ≥
    /// `num_tokentypes`, more than `max_position_embeddings` tokens), with a message naming
    /// the value and the limit, at every TP size: [`Bert::forward_stage`] returns that as an
    /// error instead.
    pub fn forward(
        &self,
        ids: Tensor<2, Int>,
        token_types: Tensor<2, Int>,
        padding: Tensor<2, Bool>,
        rng: Option<&RngTracker>,
    ) -> BertOutput {
        assert!(
            self.embeddings.is_some() && self.head.is_some(),
            "Bert::forward runs the whole model; this is one pipeline chunk (use forward_stage)"
        );
        match self.forward_stage(Some((ids, token_types)), None, padding, rng) {
            Ok(BertStageOutput::Output(out)) => out,
            Ok(BertStageOutput::Hidden(_)) => unreachable!("the whole model ends in the heads"),
            Err(e) => panic!("Bert::forward: {e}"),
        }
    }

    /// One pipeline chunk's forward: from `tokens` (`ids`, `token_types`, `[b, s]`) on the
    /// first virtual stage, from the previous stage's `hidden` states elsewhere; `padding`
    /// (`[b, s]`, true at padded positions) on every stage.
    pub fn forward_stage(
        &self,
        tokens: Option<(Tensor<2, Int>, Tensor<2, Int>)>,
        hidden: Option<Tensor<3>>,
        padding: Tensor<2, Bool>,
        rng: Option<&RngTracker>,
    ) -> Result<BertStageOutput, TpError> {
        self.forward_stage_with_positions(tokens, hidden, padding, rng, None)
    }

    /// [`Bert::forward_stage`] with the MLM head on `lm_positions` only, when given: the
    /// training loss needs no other rows ([`Bert::loss`] scores them the same).
    pub fn forward_stage_with_positions(
        &self,
        tokens: Option<(Tensor<2, Int>, Tensor<2, Int>)>,
        hidden: Option<Tensor<3>>,
        padding: Tensor<2, Bool>,
        rng: Option<&RngTracker>,
        lm_positions: Option<&MaskedPositions>,
    ) -> Result<BertStageOutput, TpError> {
        self.forward_impl(tokens, hidden, padding, rng, lm_positions, None)
    }

    /// [`Bert::forward_stage_with_positions`] on this rank's share of sequences split over
    /// a context-parallel group: `tokens` (`[b, s / cp]`) are the tokens at
    /// `cp.positions()` (split with [`ContextParallel::split_tensor`]), `padding` covers
    /// the whole sequences (`[b, s]`), and attention sees every token. The `[CLS]` token
    /// (position 0) is CP rank 0's first: the binary head runs on every rank's first token,
    /// and [`Bert::loss_cp`] counts rank 0's only.
    pub fn forward_stage_cp(
        &self,
        tokens: Option<(Tensor<2, Int>, Tensor<2, Int>)>,
        hidden: Option<Tensor<3>>,
        padding: Tensor<2, Bool>,
        rng: Option<&RngTracker>,
        lm_positions: Option<&MaskedPositions>,
        cp: &ContextParallel,
    ) -> Result<BertStageOutput, TpError> {
        if let Some(layer) = self.layers.first() {
            cp.check_heads(layer.attention.heads_per_rank())?;
        }
        self.forward_impl(tokens, hidden, padding, rng, lm_positions, Some(cp))
    }

    fn forward_impl(
        &self,
        tokens: Option<(Tensor<2, Int>, Tensor<2, Int>)>,
        hidden: Option<Tensor<3>>,
        padding: Tensor<2, Bool>,
        rng: Option<&RngTracker>,
        lm_positions: Option<&MaskedPositions>,
        cp: Option<&ContextParallel>,
    ) -> Result<BertStageOutput, TpError> {
        self.state_attrs();
        let mut x = match (&self.embeddings, tokens, hidden) {
            (Some(e), Some((ids, types)), None) => {
                let (ids, types) = check_inputs(e, ids, types, cp)?;
                self.embed(e, ids, types, rng, cp)
            }
            (None, None, Some(x)) => x,
            (e, t, x) => {
                return Err(super::stage_input_error(
                    e.is_some(),
                    t.is_some(),
                    x.is_some(),
                ));
            }
        };
        let inputs = match cp {
            None => AttentionInputs::padding(padding),
            Some(cp) => {
                let [b, s] = padding.dims();
                if s != cp.seq_length() {
                    return Err(TpError::Invalid(format!(
                        "a padding mask of dims [{b}, {s}] for context-parallel sequences of {}",
                        cp.seq_length()
                    )));
                }
                // The keys reach attention in gathered (rank) order; so must their padding.
                let order = cp.gathered_order(&padding.device());
                AttentionInputs {
                    padding: Some(padding.select(1, order)),
                    rotary: None,
                    context_parallel: Some(CpAttention {
                        cp: cp.clone(),
                        causal: false,
                    }),
                }
            }
        };
        x = forward_layers(&self.layers, x, &inputs, rng, &self.recompute);
        let Some(head) = &self.head else {
            return Ok(BertStageOutput::Hidden(x));
        };
        if self.sequence_parallel {
            x = gather_from_sequence_parallel_region(x, &self.tp, false);
        }
        let word_embeddings = match (&head.word_embeddings, &self.embeddings) {
            (Some(w), _)
            | (
                None,
                Some(BertEmbeddings {
                    word_embeddings: w, ..
                }),
            ) => w,
            (None, None) => {
                return Err(TpError::Invalid(
                    "a last-stage chunk without a copy of the word embeddings".into(),
                ));
            }
        };
        Ok(BertStageOutput::Output(self.heads(
            head,
            word_embeddings,
            x,
            lm_positions,
        )))
    }

    fn embed(
        &self,
        e: &BertEmbeddings,
        ids: Tensor<2, Int>,
        token_types: Tensor<2, Int>,
        rng: Option<&RngTracker>,
        cp: Option<&ContextParallel>,
    ) -> Tensor<3> {
        let _span = tracing::debug_span!("bert.embeddings").entered();
        let [b, s] = ids.dims();
        let device = ids.device();
        // Each token at its global position, under context parallelism too.
        let positions = match cp {
            None => Tensor::<1, Int>::arange(0..s as i64, &device),
            Some(cp) => {
                let p: Vec<i64> = cp.positions().iter().map(|&p| p as i64).collect();
                Tensor::from_data(TensorData::new(p, [s]), &device)
            }
        };
        let positions = positions.unsqueeze::<2>().repeat_dim(0, b);
        let x = e.word_embeddings.forward(ids)
            + e.position_embeddings.forward(positions)
            + e.tokentype_embeddings.forward(token_types);
        let mut x = e.embedding_layernorm.forward(x).swap_dims(0, 1); // [s, b, h]
        if let Some(rng) = rng {
            x = rng
                .dropout(x, self.hidden_dropout, RngRegion::Default)
                .expect("hidden_dropout is checked to lie in [0, 1) at init");
        }
        if self.sequence_parallel {
            x = scatter_to_sequence_parallel_region(x, &self.tp);
        }
        x
    }
}
