//! `Gpt`: Megatron-Core's `GPTModel`, the causal decoder family (GPT-2 style and Llama
//! style: Llama 2/3, Mistral, Qwen2) as config switches over the shared transformer core —
//! vocab-parallel embeddings (plus learned positions, or rotary ones inside attention), a
//! causal tensor-parallel decoder, the final norm and the output layer (tied to the word
//! embeddings or its own), whole or one pipeline chunk of it.
//!
//! ```
//! use burn_megatron::models::{
//!     ActivationFunc, AttnMaskType, GptConfig, LayerNormPosition, NormKind,
//!     ParallelAttentionConfig, ParallelMlpConfig, PositionEmbeddingType, TransformerLayerConfig,
//! };
//! // A Llama-style shape: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases.
//! let layer = TransformerLayerConfig::new(
//!     64,
//!     ParallelAttentionConfig::new(4)
//!         .with_num_query_groups(Some(2))
//!         .with_attn_mask_type(AttnMaskType::Causal),
//!     ParallelMlpConfig::new(96)
//!         .with_gated_linear_unit(true)
//!         .with_activation_func(ActivationFunc::Silu),
//! )
//! .with_layernorm_position(LayerNormPosition::Pre)
//! .with_normalization(NormKind::RmsNorm)
//! .with_layernorm_epsilon(1e-5)
//! .with_add_bias_linear(false);
//! let llama = GptConfig::new(2, 128, 128, layer)
//!     .with_position_embedding_type(PositionEmbeddingType::Rope)
//!     .with_untie_embeddings_and_output_weights(true);
//! assert!(llama.check(2).is_ok());
//! // Two query groups do not split over four tensor-parallel ranks.
//! assert!(llama.check(4).unwrap_err().to_string().contains("query groups (2)"));
//! ```

mod forward;
mod generate;
mod legacy;

pub use forward::{GptStageOutput, KvCache, Positions};
pub use generate::{GenerateConfig, GenerateError, Generated, generate, generate_stages};

use super::attention::AttnMaskType;
use super::norm::Norm;
use super::rotary::{RopeScaling, RotaryEmbedding, RotaryEmbeddingConfig};
use super::transformer::{LayerNormPosition, TransformerLayer, TransformerLayerConfig};
use crate::comm::Comm;
use crate::moe::{ExpertGroups, MoeLayer, global_expert_name};
use crate::recompute::RecomputeConfig;
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, IdCheck, LayoutOwner, TpError,
    VocabParallelEmbedding, VocabParallelEmbeddingConfig, derive_seed, host_param,
};
use crate::topology::PipelinePosition;
use burn::config::Config;
use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::Device;

/// How positions enter the model (Megatron's `--position-embedding-type`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum PositionEmbeddingType {
    /// A learned table added to the word embeddings (GPT-2).
    LearnedAbsolute,
    /// Rotary embeddings of queries and keys (Llama), rotate-half form.
    Rope,
}

/// The shape of a GPT-family model, named as Megatron's arguments: the model's own fields
/// (layers, vocabulary, positions, the output layer) around one [`TransformerLayerConfig`]
/// for all its layers. A GPT's layers are causal and pre-norm: `transformer` must say so
/// (`attention.attn_mask_type` `Causal`, `layernorm_position` `Pre`; [`GptConfig::check`]
/// refuses anything else), and [`GptConfig::layer_config`] derives each layer's seed from
/// its global index.
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Transformer layers.
    pub num_layers: usize,
    /// Longest sequence: the learned position table's size, and the context generation
    /// refuses to exceed.
    pub max_position_embeddings: usize,
    /// Vocabulary size padded to a multiple of `--make-vocab-size-divisible-by` × TP.
    pub padded_vocab_size: usize,
    /// Every layer's shape and switches (Megatron-Core's `TransformerConfig`). Its
    /// `initializer` draws the embeddings too, its `seed` is the model's, and the layers'
    /// output projections default to `initializer` scaled by `1/√(2·layers)` (Megatron's
    /// `scaled_init_method_normal`).
    pub transformer: TransformerLayerConfig,
    /// The real vocabulary (`None`: all of `padded_vocab_size`). Logits of the padding rows
    /// are masked out (−10⁴), so the loss and sampling are the unpadded model's, and
    /// checkpoints hold only the real rows: a layout that pads the vocabulary to another
    /// size loads them, its padding zeros.
    #[config(default = "None")]
    pub vocab_size: Option<usize>,
    /// Learned absolute positions or rotary embeddings.
    #[config(default = "PositionEmbeddingType::LearnedAbsolute")]
    pub position_embedding_type: PositionEmbeddingType,
    /// `--rotary-base`.
    #[config(default = 10000.0)]
    pub rotary_base: f64,
    /// `--rotary-percent`.
    #[config(default = 1.0)]
    pub rotary_percent: f64,
    /// Rotary frequency scaling (Llama 3's, from a checkpoint's `rope_scaling`).
    #[config(default = "None")]
    pub rope_scaling: Option<RopeScaling>,
    /// An output layer of its own instead of the word embeddings
    /// (`--untie-embeddings-and-output-weights`).
    #[config(default = false)]
    pub untie_embeddings_and_output_weights: bool,
    /// Every `moe_layer_freq`-th layer, from layer 0, is an MoE layer when `transformer`
    /// has `moe` (`--moe-layer-freq N`); the others are dense.
    #[config(default = 1)]
    pub moe_layer_freq: usize,
}

/// The first pipeline stage's part: word embeddings (split by vocabulary rows) and, with
/// learned positions, the position table (duplicated).
#[derive(Module, Debug)]
pub struct GptEmbedding {
    /// Word embeddings; also the output projection when tied and on one stage.
    pub word_embeddings: VocabParallelEmbedding,
    /// Learned absolute positions.
    pub position_embeddings: Option<Embedding>,
}

/// The last pipeline stage's part: the final norm and the output projection.
#[derive(Module, Debug)]
pub struct GptHead {
    /// The norm after the last layer.
    pub final_layernorm: Norm,
    /// The output layer when untied, `h → V` split by vocabulary columns.
    pub output_layer: Option<ColumnParallelLinear>,
    /// Tied and on a pipeline: the last stage's copy of the word embeddings, initialised
    /// like the first stage's, its gradient summed with theirs over the embedding group.
    pub word_embeddings: Option<VocabParallelEmbedding>,
}

/// A GPT-family model: one tensor-parallel rank's part of one pipeline model chunk. Built by
/// [`GptConfig::init`] for the whole model, [`GptConfig::init_stage`] per chunk.
#[derive(Module, Debug)]
pub struct Gpt {
    /// The embeddings, on the first virtual pipeline stage.
    pub embedding: Option<GptEmbedding>,
    /// This chunk's decoder layers.
    pub layers: Vec<TransformerLayer>,
    /// The final norm and output layer, on the last virtual pipeline stage.
    pub head: Option<GptHead>,
    #[module(skip)]
    tp: Comm,
    /// Holds what only the model states (the final norm under SP, the tie).
    #[module(skip)]
    layout: LayoutOwner,
    #[module(skip)]
    rotary: Option<RotaryEmbedding>,
    /// The output layer is the word embeddings (on a pipeline: their last-stage copy).
    #[module(skip)]
    tied: bool,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    hidden_dropout: f64,
    #[module(skip)]
    vocab_size: usize,
    #[module(skip)]
    max_position_embeddings: usize,
    /// The global index of this chunk's first layer.
    #[module(skip)]
    first_layer: usize,
    #[module(skip)]
    recompute: RecomputeConfig,
}

impl GptConfig {
    /// This config with `f` applied to its layers' config, for builder chains:
    /// `config.map_transformer(|t| t.with_sequence_parallel(true))`.
    pub fn map_transformer(
        mut self,
        f: impl FnOnce(TransformerLayerConfig) -> TransformerLayerConfig,
    ) -> Self {
        self.transformer = f(self.transformer);
        self
    }

    /// The query groups (one per head when not set).
    pub fn query_groups(&self) -> usize {
        self.transformer.attention.query_groups()
    }

    /// The real vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size.unwrap_or(self.padded_vocab_size)
    }

    /// The configuration of layer `index` (global), as this model builds it: the scaled
    /// output initialisation, a seed of its own, and experts when `moe_layer_freq` picks it.
    pub fn layer_config(&self, index: usize) -> TransformerLayerConfig {
        let t = &self.transformer;
        let mut layer = t.clone();
        layer.output_initializer = Some(
            (t.output_initializer)
                .unwrap_or_else(|| t.initializer.scaled_for_layers(self.num_layers)),
        );
        layer.seed = derive_seed(t.seed, &format!("layers.{index}"));
        layer.moe = t
            .moe
            .clone()
            .filter(|_| index.is_multiple_of(self.moe_layer_freq.max(1)));
        layer
    }

    /// Whether layer `index` (global) is a mixture-of-experts layer.
    pub fn is_moe_layer(&self, index: usize) -> bool {
        self.layer_config(index).moe.is_some()
    }

    /// Channels per head.
    pub(crate) fn head_dim(&self) -> usize {
        let t = &self.transformer;
        t.attention.head_dim(t.hidden_size)
    }

    /// The rotary embedding this config asks for (`None` with learned positions).
    pub fn rotary(&self) -> Result<Option<RotaryEmbedding>, TpError> {
        (self.position_embedding_type == PositionEmbeddingType::Rope)
            .then(|| {
                RotaryEmbeddingConfig::new(self.head_dim())
                    .with_rotary_base(self.rotary_base)
                    .with_rotary_percent(self.rotary_percent)
                    .with_scaling(self.rope_scaling)
                    .init()
            })
            .transpose()
    }

    /// Everything that can be refused before any weight is drawn, at tensor-parallel size
    /// `tp`, with messages naming the values: the head/group/TP arithmetic, the
    /// vocabulary, the rotary shape and the dropouts.
    pub fn check(&self, tp: usize) -> Result<(), TpError> {
        let bad = |m: String| Err(TpError::Invalid(m));
        let t = &self.transformer;
        let ffn = t.mlp.ffn_hidden_size;
        if self.num_layers == 0 || ffn == 0 || self.max_position_embeddings == 0 {
            return bad(format!(
                "layers ({}), ffn hidden size ({ffn}) and max position embeddings ({}) must all be at least 1",
                self.num_layers, self.max_position_embeddings
            ));
        }
        t.check(tp)?;
        let (mask, position) = (t.attention.attn_mask_type, t.layernorm_position);
        if mask != AttnMaskType::Causal || position != LayerNormPosition::Pre {
            return bad(format!(
                "a GPT's layers are causal and pre-norm: set transformer.attention.attn_mask_type \
                 to Causal (it is {mask:?}) and transformer.layernorm_position to Pre (it is \
                 {position:?})"
            ));
        }
        if self.vocab_size() == 0 || self.vocab_size() > self.padded_vocab_size {
            return bad(format!(
                "vocabulary size {} must be in [1, padded vocabulary size {}]",
                self.vocab_size(),
                self.padded_vocab_size
            ));
        }
        if !self.padded_vocab_size.is_multiple_of(tp) {
            return Err(TpError::Indivisible(format!(
                "padded vocabulary size ({}) is not divisible by the tensor-parallel size ({tp})",
                self.padded_vocab_size
            )));
        }
        self.rotary()?;
        t.initializer.check()?;
        if let Some(moe) = &t.moe {
            if self.moe_layer_freq == 0 {
                return bad("--moe-layer-freq must be at least 1".into());
            }
            moe.validate(1)?;
        }
        t.recompute
            .check(self.num_layers)
            .map_err(|e| TpError::Invalid(e.0))?;
        super::check_dropout(&[
            ("hidden_dropout", t.hidden_dropout),
            ("attention_dropout", t.attention.attention_dropout),
        ])?;
        super::check_epsilon(t.layernorm_epsilon)
    }

    /// Initialises this rank's part of the whole model; identical weights at every TP size
    /// for one seed.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<Gpt, TpError> {
        self.init_stage(tp, PipelinePosition::whole(), device)
    }

    /// Initialises this rank's part of the model chunk at `position`: the layers
    /// [`PipelinePosition::layer_range`], the embeddings on the first virtual stage, the
    /// final norm and output layer on the last. Every weight equals the same weight of the
    /// whole model (seeds follow global layer indices); a tied last stage's copy of the word
    /// embeddings equals the first stage's.
    pub fn init_stage(
        &self,
        tp: &Comm,
        position: PipelinePosition,
        device: &Device,
    ) -> Result<Gpt, TpError> {
        self.init_stage_with_experts(tp, None, position, device)
    }

    /// [`init_stage`](Self::init_stage) with the groups the MoE layers split their experts
    /// over ([`RankGroups::experts`](crate::launch::RankGroups::experts); `None`: every
    /// expert whole on this rank).
    pub fn init_stage_with_experts(
        &self,
        tp: &Comm,
        experts: Option<&ExpertGroups>,
        position: PipelinePosition,
        device: &Device,
    ) -> Result<Gpt, TpError> {
        self.check(tp.group().size())?;
        let t = &self.transformer;
        if let (Some(moe), Some(experts)) = (&t.moe, experts) {
            moe.validate(experts.ep.group().size())?;
        }
        let layer_range = position
            .layer_range(self.num_layers)
            .map_err(|e| TpError::Invalid(e.to_string()))?;
        let (h, seed, normal) = (t.hidden_size, t.seed, t.initializer);
        // Checkpoints hold the real vocabulary, so that a layout padding it otherwise loads
        // them.
        let real = self.vocab_size;
        let word_embeddings = || {
            VocabParallelEmbeddingConfig::new(self.padded_vocab_size, h)
                .with_unpadded_size(real)
                .with_initializer(normal)
                .with_seed(derive_seed(seed, "word_embeddings"))
                .init(tp, device)
        };
        let (first, last) = (position.is_first_stage(), position.is_last_stage());
        let learned = self.position_embedding_type == PositionEmbeddingType::LearnedAbsolute;
        let embedding = first
            .then(|| -> Result<_, TpError> {
                let position_embeddings = learned.then(|| {
                    let rows = self.max_position_embeddings;
                    let values =
                        normal.values(rows * h, h, derive_seed(seed, "position_embeddings"));
                    Embedding {
                        weight: host_param(values, [rows, h], device),
                    }
                });
                Ok(GptEmbedding {
                    word_embeddings: word_embeddings()?,
                    position_embeddings,
                })
            })
            .transpose()?;
        let first_layer = layer_range.start;
        let layers = layer_range
            .map(|i| self.layer_config(i).init_with_experts(tp, experts, device))
            .collect::<Result<Vec<_>, _>>()?;
        let untied = self.untie_embeddings_and_output_weights;
        let head = last
            .then(|| -> Result<_, TpError> {
                let output_layer = untied
                    .then(|| {
                        ColumnParallelLinearConfig::new(h, self.padded_vocab_size)
                            .with_unpadded_size(real)
                            .with_bias(false)
                            .with_sequence_parallel(t.sequence_parallel)
                            .with_gradient_accumulation_fusion(t.gradient_accumulation_fusion)
                            .with_initializer(normal)
                            .with_seed(derive_seed(seed, "output_layer"))
                            .init(tp, device)
                    })
                    .transpose()?;
                Ok(GptHead {
                    final_layernorm: Norm::new(t.normalization, h, t.layernorm_epsilon, device),
                    output_layer,
                    word_embeddings: (!untied && !first).then(word_embeddings).transpose()?,
                })
            })
            .transpose()?;
        let gpt = Gpt {
            embedding,
            layers,
            head,
            tp: tp.clone(),
            layout: LayoutOwner::default(),
            rotary: self.rotary()?,
            tied: !untied,
            sequence_parallel: t.sequence_parallel,
            hidden_dropout: t.hidden_dropout,
            vocab_size: self.vocab_size(),
            max_position_embeddings: self.max_position_embeddings,
            first_layer,
            recompute: t.recompute.clone(),
        };
        gpt.state_attrs();
        Ok(gpt)
    }
}

impl Gpt {
    /// The same model, treating token ids outside the vocabulary as `check` says: by
    /// default [`IdCheck::Refuse`] (one host read per forward of the first stage);
    /// [`IdCheck::Clamp`] when the data loader checked its tokens on the host.
    pub fn with_id_check(mut self, check: IdCheck) -> Self {
        self.embedding = self.embedding.map(|e| GptEmbedding {
            word_embeddings: e.word_embeddings.with_id_check(check),
            ..e
        });
        self
    }

    /// The layout-independent name of the parameter at `path` in a model of `chunks` (as
    /// module paths of a `Vec<Gpt>` read, `"1.layers.0.…"`; or of one `Gpt`): layers by
    /// global index, and a tied last stage's copy of the word embeddings under the first
    /// stage's name. What checkpoints key tensors by.
    ///
    /// ```
    /// use burn_megatron::models::Gpt;
    /// assert_eq!(Gpt::global_param_name_at(&[0, 4], "1.layers.1.mlp.dense_4h_to_h.weight"),
    ///            "layers.5.mlp.dense_4h_to_h.weight");
    /// assert_eq!(Gpt::global_param_name_at(&[2], "head.word_embeddings.weight"),
    ///            "embedding.word_embeddings.weight");
    /// ```
    pub fn global_param_name_at(first_layers: &[usize], path: &str) -> String {
        super::global_param_name(
            first_layers,
            path,
            "head.word_embeddings.",
            "embedding.word_embeddings.",
        )
    }

    /// [`Gpt::global_param_name_at`] with each chunk's first layer read from `chunks`, and
    /// local experts named by their global index ([`global_expert_name`]).
    pub fn global_param_name(chunks: &[Gpt], path: &str) -> String {
        let first: Vec<usize> = chunks.iter().map(Gpt::first_layer).collect();
        let first_expert = chunks.first().map_or(0, Gpt::first_expert);
        global_expert_name(&Self::global_param_name_at(&first, path), first_expert)
    }

    /// The global index of this rank's first expert in every MoE layer (0 without experts
    /// or expert parallelism).
    pub fn first_expert(&self) -> usize {
        self.layers
            .iter()
            .find_map(|l| l.moe.as_ref().map(MoeLayer::first_expert))
            .unwrap_or(0)
    }

    /// The global index of this chunk's first layer.
    pub fn first_layer(&self) -> usize {
        self.first_layer
    }

    /// The real vocabulary size (logits of the padding rows are masked).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The longest context (`max_position_embeddings`).
    pub fn max_position_embeddings(&self) -> usize {
        self.max_position_embeddings
    }

    /// The tensor-parallel group this model is split over.
    pub fn tp(&self) -> &Comm {
        &self.tp
    }

    /// States what only the model knows: the final norm's gradient is partial under
    /// sequence parallelism, and on a pipeline the first stage's word embeddings and the
    /// last stage's copy are one tied weight. At init and at every forward.
    fn state_attrs(&self) {
        if let (Some(e), None, true) = (&self.embedding, &self.head, self.tied) {
            super::tie(&self.layout, &e.word_embeddings, false);
        }
        if let Some(head) = &self.head {
            head.final_layernorm
                .state_attrs(&self.layout, self.sequence_parallel);
            if let Some(copy) = &head.word_embeddings {
                copy.state_attrs();
                super::tie(&self.layout, copy, true);
            }
        }
    }
}
