//! The name-pattern mapper: which layers of a model are column-, row- or vocabulary-parallel,
//! by module path, applied to the whole module tree in one call.
//!
//! Rust field types are static, so a layer a pattern names must be able to become parallel:
//! the layers of [`nn`](super::nn) (`Linear`, `Embedding`, `SwiGlu`, with Burn's names,
//! fields and builders) carry a slot, [`TpSlot`], that receives the layer's split and group
//! when [`TpPlan::apply`] passes. The slot has no parameters, so records keep Burn's paths.

use super::shard::{Placement, held_dims, shard};
use super::slot::{Assigned, Facts, Offer, PENDING, facts};
use super::stage::StageKeys;
use crate::comm::Comm;
use crate::tensor_parallel::{LayoutOwner, ParallelAttrs};
use crate::tensor_parallel::{RngTracker, TpError, padded_vocab_size};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use std::collections::HashMap;

mod adapter;
mod split;

pub use adapter::{apply_lora, apply_qlora};
pub use split::Split;
use split::encoder_split;

/// Which layers are split how, by module path (glob patterns: `*` matches any run of
/// characters, dots included): Megatron's layout of a Burn model, stated once.
///
/// ```
/// use burn_megatron::dropin::TpPlan;
/// let plan = TpPlan::new()
///     .column(&["*.wq", "*.wk", "*.wv", "*.swiglu", "output"]).unwrap()
///     .row(&["*.wo", "*.w2"]).unwrap()
///     .vocab(&["tok_embeddings"]).unwrap();
/// assert!(TpPlan::new().column(&["[unclosed"]).is_err());
/// # drop(plan);
/// ```
#[derive(Debug, Clone, Default)]
pub struct TpPlan {
    rules: Vec<(glob::Pattern, Split)>,
    seed: u64,
    vocab_divisible_by: Option<usize>,
    sequence_parallel: bool,
    stage: Option<PlanStage>,
}

/// The pipeline stage a plan splits a chunk of: its rules match the whole model's paths,
/// its draws are seeded by them, and its dropout streams by the virtual stage (Megatron
/// offsets the seed by 100 a stage), so that stages differ as the layers of one model do.
#[derive(Debug, Clone)]
struct PlanStage {
    keys: StageKeys,
    virtual_stage: usize,
}

impl TpPlan {
    /// A plan with no rules (everything stays duplicated).
    pub fn new() -> Self {
        Self::default()
    }

    /// Layers (and every layer under them) whose output features split.
    pub fn column(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::Column)
    }

    /// Layers whose output features split and are gathered again after the product.
    pub fn gathered_column(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::GatheredColumn)
    }

    /// Layers whose input features split; their input is a column layer's split output.
    pub fn row(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::Row)
    }

    /// Embeddings whose vocabulary rows split, and output linears whose vocabulary columns
    /// split ([`Split::Vocab`]).
    pub fn vocab(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::Vocab)
    }

    /// Output linears split over the vocabulary whose logits are gathered whole again
    /// ([`Split::GatheredVocab`]).
    pub fn gathered_vocab(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::GatheredVocab)
    }

    /// Pads the vocabulary of the layers `vocab` and `gathered_vocab` name to a multiple of
    /// `multiple × tp` (Megatron's `--make-vocab-size-divisible-by`, whose default is 128), so
    /// that a vocabulary of any size splits: the padding rows and columns are zeros, their
    /// logits are masked, and records keep the real size (shard-on-load fills the padding).
    /// Without it, a vocabulary that does not split over the ranks is an error. Fails on 0.
    ///
    /// ```
    /// use burn_megatron::dropin::TpPlan;
    /// use burn_megatron::tensor_parallel::padded_vocab_size;
    /// // GPT-2's 50257 tokens become 50304 rows at TP 1, 50432 at TP 2, 50688 at TP 4.
    /// let padded: Vec<_> = [1, 2, 4].map(|tp| padded_vocab_size(50257, 128, tp)).into();
    /// assert_eq!(padded, [50304, 50432, 50688]);
    /// let plan = TpPlan::new()
    ///     .vocab(&["wte", "lm_head"]).unwrap()
    ///     .make_vocab_size_divisible_by(128).unwrap();
    /// assert!(TpPlan::new().make_vocab_size_divisible_by(0).is_err());
    /// # drop(plan);
    /// ```
    pub fn make_vocab_size_divisible_by(mut self, multiple: usize) -> Result<Self, TpError> {
        if multiple == 0 {
            return Err(TpError::Invalid(
                "make_vocab_size_divisible_by takes a multiple of at least 1".into(),
            ));
        }
        self.vocab_divisible_by = Some(multiple);
        Ok(self)
    }

    /// [`nn::transformer::TransformerEncoder`](super::nn::transformer::TransformerEncoder)s
    /// (or their layers, or [`nn::attention`](super::nn::attention)'s `MultiHeadAttention`s
    /// and `CrossAttention`s) split as Megatron splits a transformer layer ([`Split::Encoder`]); their dropout draws from streams seeded by
    /// [`with_seed`](Self::with_seed).
    pub fn encoder(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::Encoder)
    }

    /// Sequence parallelism in the layers `encoder` names (Megatron's `--sequence-parallel`):
    /// between a transformer layer's blocks each rank holds `s / tp` positions of the
    /// residual stream, so its norms, residual dropout and adds keep a `tp`-th of their
    /// activations, for the same communication volume (each all-reduce becomes an all-gather
    /// before the block and a reduce-scatter after it). The encoder or decoder splits its
    /// input's sequence and gathers its output, so the model's code does not change; a
    /// decoder's memory stays whole. The sequence length must split over the ranks (a panic
    /// naming the layer and the numbers otherwise). The norms' and row-parallel biases'
    /// gradients, partial sums over the ranks' positions, are summed inside backward (six
    /// `d_model` vectors a layer; Megatron sums them in `finalize_model_grads`), so a plain
    /// Burn training loop steps on whole gradients.
    /// Decoding with a cache runs without it. An `encoder` rule that names an attention on
    /// its own (no residual stream to split) is then an error.
    ///
    /// ```
    /// use burn_megatron::dropin::TpPlan;
    /// let plan = TpPlan::new().encoder(&["transformer"]).unwrap().sequence_parallel();
    /// # drop(plan);
    /// ```
    pub fn sequence_parallel(mut self) -> Self {
        self.sequence_parallel = true;
        self
    }

    /// The seed of the weights a plan draws: a split layer not yet initialised (Burn draws
    /// lazily) draws its shard from its config's initializer (Burn's default for its type
    /// when converted from Burn's layer, which does not keep it), seeded by its path, the
    /// same at every TP size and on every rank (Burn's own draw would differ across ranks
    /// running as threads). An initializer with no such law here is an error naming the
    /// layer ([`master_init`](super::master_init) lists those there are). Loading a record
    /// afterwards replaces them.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The plan for one pipeline stage's chunk (what
    /// [`PpStage::tp_plan`](crate::dropin::PpStage::tp_plan) makes): a rule naming only
    /// modules other stages hold matches nothing here, and that is not an error.
    pub(crate) fn at_stage(mut self, keys: StageKeys, virtual_stage: usize) -> Self {
        self.stage = Some(PlanStage {
            keys,
            virtual_stage,
        });
        self
    }

    fn rule(mut self, patterns: &[&str], split: Split) -> Result<Self, TpError> {
        for p in patterns {
            let pattern = glob::Pattern::new(p)
                .map_err(|e| TpError::Invalid(format!("layer pattern `{p}`: {e}")))?;
            self.rules.push((pattern, split));
        }
        Ok(self)
    }

    /// `model` with every layer a pattern names split over `tp`: its parameters cut to this
    /// rank's shard (values kept; lazy ones drawn lazily, see [`with_seed`](Self::with_seed))
    /// and its slot assigned. Errors, naming the path and the numbers: a pattern that
    /// matches no layer, a named layer of Burn's own type (no slot), a size that does not
    /// split, a split the layer cannot take.
    pub fn apply<M: Module>(&self, model: M, tp: &Comm) -> Result<M, TpError> {
        if self.sequence_parallel && !self.rules.iter().any(|(_, s)| *s == Split::Encoder) {
            return Err(TpError::Invalid(
                "sequence parallelism splits the layers an `encoder` rule names, and the plan \
                 has none"
                    .into(),
            ));
        }
        let mut mapper = PlanMapper {
            plan: self,
            tp,
            rng: RngTracker::new(self.dropout_seed(), tp.group().rank()),
            path: Vec::new(),
            types: Vec::new(),
            active: None,
            owner: None,
            vocab: None,
            fans: (None, None),
            facts: facts(&model),
            matched: vec![false; self.rules.len()],
            error: None,
        };
        let model = model.map(&mut mapper);
        PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
        if let Some(e) = mapper.error {
            let note = |m: String| match &self.stage {
                Some(stage) => format!("{m} ({})", stage.keys.paths_note()),
                None => m,
            };
            return Err(match e {
                TpError::Indivisible(m) => TpError::Indivisible(note(m)),
                TpError::Invalid(m) => TpError::Invalid(note(m)),
                other => other,
            });
        }
        let elsewhere =
            |p: &glob::Pattern| (self.stage.as_ref()).is_some_and(|s| s.keys.may_name_elsewhere(p));
        let unused: Vec<String> = (self.rules.iter().zip(&mapper.matched))
            .filter(|((p, _), m)| !**m && !elsewhere(p))
            .map(|((p, s), _)| format!("`{}` ({s:?})", p.as_str()))
            .collect();
        if !unused.is_empty() {
            return Err(TpError::Invalid(format!(
                "layer patterns that match no layer: {}{}",
                unused.join(", "),
                self.stage.as_ref().map_or("", |s| s.keys.hint())
            )));
        }
        Ok(model)
    }

    /// The whole model's path for `path` (itself but on a pipeline stage).
    fn global_name(&self, path: &str) -> String {
        match &self.stage {
            Some(stage) => stage.keys.global_name(path),
            None => path.to_string(),
        }
    }

    fn dropout_seed(&self) -> u64 {
        let stage = self.stage.as_ref().map_or(0, |s| s.virtual_stage as u64);
        self.seed.wrapping_add(100 * stage)
    }
}

/// A layer a rule named, while the traversal is inside it.
struct Active {
    depth: usize,
    path: String,
    split: Split,
    /// The rule that named it.
    rule: usize,
    slots: usize,
    /// The parameters under it so far.
    params: usize,
}

struct PlanMapper<'a> {
    plan: &'a TpPlan,
    tp: &'a Comm,
    /// One set of dropout streams for every encoder part this plan splits on this rank.
    rng: RngTracker,
    path: Vec<String>,
    /// The container type each entered name was entered from (its parent's struct).
    types: Vec<String>,
    active: Option<Active>,
    /// The owner of the attributes stated for the layer whose parameters were just mapped,
    /// handed to its slot.
    owner: Option<LayoutOwner>,
    /// The real vocabulary of the layer whose parameters were just padded, for its slot.
    vocab: Option<usize>,
    /// The fan-in and fan-out of the layer whose parameters are being mapped.
    fans: (Option<usize>, Option<usize>),
    /// What each layer's slot knows, by the layer's path.
    facts: HashMap<String, Facts>,
    matched: Vec<bool>,
    error: Option<TpError>,
}

impl PlanMapper<'_> {
    fn fail(&mut self, e: String) {
        self.error.get_or_insert(TpError::Invalid(e));
    }
}

impl ModuleMapper for PlanMapper<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        self.types.push(container_type.to_string());
        let path = self.path.join(".");
        if name == "tp" && container_type_is_dropin(container_type) {
            if let Some(active) = &mut self.active {
                active.slots += 1;
                let layer = self.path.iter().rev().nth(1).cloned().unwrap_or_default();
                let split = match (active.split, container_type) {
                    (Split::Encoder, "Struct:Linear") => encoder_split(&layer),
                    (Split::Encoder, _) => Some(Split::Encoder),
                    (split, "Struct:Linear" | "Struct:Embedding") => Some(split),
                    _ => None,
                };
                let Some(split) = split else {
                    let e = format!(
                        "{path}: a {:?} rule does not split a {}; an encoder takes `encoder`, \
                         and of an encoder's linears only query, key, value, output, \
                         linear_inner and linear_outer split",
                        active.split,
                        container_type.trim_start_matches("Struct:")
                    );
                    self.fail(e);
                    return;
                };
                // An attention named on its own has no residual stream to split.
                let alone = active.depth + 1 == self.path.len();
                let sequence_parallel = self.plan.sequence_parallel && split == Split::Encoder;
                let attention = matches!(
                    container_type,
                    "Struct:MultiHeadAttention" | "Struct:CrossAttention"
                );
                if sequence_parallel && alone && attention {
                    let hint = match container_type {
                        "Struct:CrossAttention" => {
                            "split it by a plan without sequence parallelism"
                        }
                        _ => "name its layer, encoder or decoder",
                    };
                    let e = format!(
                        "{}: sequence parallelism splits a transformer layer's residual \
                         stream, and an attention on its own has none; {hint}",
                        active.path
                    );
                    self.fail(e);
                    return;
                }
                let owner = self.owner.take().unwrap_or_default();
                let rng = (split == Split::Encoder).then(|| self.rng.clone());
                let assigned = Assigned {
                    split,
                    tp: self.tp.clone(),
                    layout: owner,
                    rng,
                    vocab: self.vocab.take(),
                    sequence_parallel,
                };
                PENDING.with(|p| *p.borrow_mut() = Offer::Split(assigned));
            }
            return;
        }
        if self.active.is_some() {
            return;
        }
        let global = self.plan.global_name(&path);
        if let Some(i) = self.plan.rules.iter().position(|(p, _)| p.matches(&global)) {
            let split = self.plan.rules[i].1;
            // A layer's residual dropout draws from the plan's streams only when the plan
            // assigns the layer itself: a split part alone would leave it on Burn's
            // process-wide generator, and ranks as threads would drop different entries.
            let layer = matches!(
                container_type,
                "Struct:TransformerEncoderLayer" | "Struct:TransformerDecoderLayer"
            );
            if split == Split::Encoder && layer {
                let layer = self.path[..self.path.len() - 1].join(".");
                self.fail(format!(
                    "{path}: an encoder rule names a part of the transformer layer `{layer}`; \
                     name the layer or the whole encoder or decoder"
                ));
            }
            self.active = Some(Active {
                depth: self.path.len(),
                path,
                split,
                rule: i,
                slots: 0,
                params: 0,
            });
        }
    }

    fn exit_module(&mut self, name: &str, _: &str) {
        if name == "tp" {
            let path = self.path.join(".");
            match PENDING.with(|p| std::mem::take(&mut *p.borrow_mut())) {
                Offer::None => {}
                Offer::Split(_) => self.fail(format!(
                    "{path}: a field named `tp` that is not a tensor-parallel slot"
                )),
                Offer::Heads { heads, kv, tp } => self.fail(format!(
                    "{path}: {heads} {} do not split over the tensor-parallel size {tp}",
                    match kv {
                        true => "key/value heads",
                        false => "attention heads",
                    }
                )),
                Offer::Cannot(reason) => self.fail(format!("{path}: {reason}")),
                Offer::Refused => self.fail(format!(
                    "{path}: the layer is split already (a plan applies once, to a model as \
                     the plain code builds it)"
                )),
            }
        }
        if let Some(active) = &self.active
            && active.depth == self.path.len()
        {
            // A layer that holds nothing (an `Option` left `None`, as a pipeline stage
            // leaves the modules other stages hold) is not there to match.
            let empty = active.slots == 0 && active.params == 0;
            if !empty {
                self.matched[active.rule] = true;
            }
            if active.slots == 0 && !empty {
                let msg = format!(
                    "{}: a {:?} rule names it, but it has no tensor-parallel slot: it is one of \
                     burn::nn's types; import Linear, Embedding or SwiGlu from \
                     burn_megatron::dropin::nn instead",
                    active.path, active.split
                );
                self.fail(msg);
            }
            self.active = None;
        }
        self.path.pop();
        self.types.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let param = self.split_param(param);
        if let Some(stage) = &self.plan.stage {
            stage.keys.tie(&self.path.join("."), param.id);
        }
        param
    }
}

impl PlanMapper<'_> {
    /// `param` cut to this rank's shard when a rule named its layer.
    fn split_param<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(active) = &mut self.active else {
            return self.whole_adapter(param);
        };
        active.params += 1;
        let layer = self.types.last().cloned().unwrap_or_default();
        let field = self.path.last().cloned().unwrap_or_default();
        let path = self.path.join(".");
        if layer == "Struct:LoraAdapter" {
            let split = active.split;
            return self.split_adapter(param, split);
        }
        // Another reparameterization's parameters would stay whole beside a split base.
        if self.types.iter().any(|t| t == "Reparameterization") {
            self.fail(format!(
                "{path}: a reparameterization other than Burn's LoRA on a layer the plan splits"
            ));
            return param;
        }
        let split = match active.split {
            // An encoder's norms stay whole; its linears split by their role.
            Split::Encoder if layer != "Struct:Linear" => return param,
            Split::Encoder => {
                let linear = self.path.iter().rev().nth(1).cloned().unwrap_or_default();
                match encoder_split(&linear) {
                    Some(split) => split,
                    None => {
                        self.fail(format!(
                            "{path}: an encoder rule splits only query, key, value, output, \
                             linear_inner and linear_outer"
                        ));
                        return param;
                    }
                }
            }
            split => split,
        };
        let column = matches!(
            split,
            Split::Column | Split::GatheredColumn | Split::Vocab | Split::GatheredVocab
        );
        let dim = match (layer.as_str(), field.as_str(), split) {
            ("Struct:Linear", "weight", _) if column => Some(1),
            ("Struct:Linear", "bias", _) if column => Some(0),
            ("Struct:Linear", "weight", Split::Row) => Some(0),
            ("Struct:Linear", "bias", Split::Row) => None,
            ("Struct:Embedding", "weight", Split::Vocab) => Some(0),
            _ => {
                self.fail(format!(
                    "{path}: a {split:?} split does not apply to {} `{field}`",
                    layer.trim_start_matches("Struct:")
                ));
                return param;
            }
        };
        // Burn draws a linear's weight and bias with the weight's widths as fan-in and
        // fan-out, an embedding with neither.
        let layer_facts = self.facts.get(&self.path[..self.path.len() - 1].join("."));
        let col = field == "weight" && layer_facts.is_some_and(|f| f.col);
        let dims = held_dims(&param, col);
        // Burn's column layout draws `[out, in]` with the fans swapped.
        if field == "weight" {
            self.fans = match (layer.as_str(), col) {
                ("Struct:Linear", false) => (Some(dims[0]), Some(dims[1])),
                ("Struct:Linear", true) => (Some(dims[1]), Some(dims[0])),
                _ => (None, None),
            };
        }
        let owner = self.owner.get_or_insert_with(LayoutOwner::default).clone();
        let tp = self.tp.group().size();
        // Megatron's padding: a multiple of `divisible_by × tp`, with the real size kept.
        let padded = match (dim, split, self.plan.vocab_divisible_by) {
            (Some(d), Split::Vocab | Split::GatheredVocab, Some(m)) => {
                Some(padded_vocab_size(dims[d], m, tp)).filter(|&p| p != dims[d])
            }
            _ => None,
        };
        let real = dim.map(|d| dims[d]);
        if padded.is_some() {
            self.vocab = real;
        }
        let init = layer_facts.and_then(|f| f.init.as_ref());
        let seed_path = self.plan.global_name(&path);
        let at = Placement {
            init,
            col,
            dim,
            padded,
            vocab: matches!(split, Split::Vocab | Split::GatheredVocab),
            layer: &layer,
            path: &path,
            seed_path: &seed_path,
            seed: self.plan.seed,
            fans: self.fans,
        };
        match shard(param, at, self.tp) {
            Ok(p) => {
                let attrs = match (dim, padded, real) {
                    (Some(d), Some(_), Some(real)) => ParallelAttrs::sharded(d).padded_from(real),
                    (Some(d), _, _) => ParallelAttrs::sharded(d),
                    (None, _, _) => ParallelAttrs::default(),
                };
                owner.state(p.id, attrs);
                p
            }
            Err((p, e)) => {
                self.fail(e);
                p
            }
        }
    }
}

fn container_type_is_dropin(container_type: &str) -> bool {
    matches!(
        container_type,
        "Struct:Linear"
            | "Struct:Embedding"
            | "Struct:MultiHeadAttention"
            | "Struct:CrossAttention"
            | "Struct:PositionWiseFeedForward"
            | "Struct:TransformerEncoderLayer"
            | "Struct:TransformerDecoderLayer"
    )
}
