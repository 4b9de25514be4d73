//! The name-pattern mapper: which layers of a model are column-, row- or vocabulary-parallel,
//! by module path, applied to the whole module tree in one call.
//!
//! Rust field types are static, so a layer a pattern names must be able to become parallel:
//! the layers of [`nn`](super::nn) (`Linear`, `Embedding`, `SwiGlu`, with Burn's names,
//! fields and builders) carry a slot, [`TpSlot`], that receives the layer's split and group
//! when [`TpPlan::apply`] passes. The slot has no parameters, so records keep Burn's paths.
//!
//! Burn's module traversal gives a mapper parameters, not fields; the plan hands the slot its
//! split through a value this thread holds only while the slot is being mapped (set when the
//! traversal enters the slot, taken by the slot, checked when it leaves).

use super::super::attrs::{LayoutOwner, ParallelAttrs};
use super::super::init::{MasterInit, slice_cols, slice_rows};
use super::super::{RngTracker, TpError, derive_seed, lazy_host_param, shard_param};
use super::master_init;
use crate::comm::Comm;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param,
};
use burn::tensor::{Device, Tensor};
use std::cell::RefCell;

/// How a layer is split over the tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Output features split (Megatron's `ColumnParallelLinear`, no gather): weight `[in,
    /// out / tp]`, bias `[out / tp]`.
    Column,
    /// Output features split, then gathered (`ColumnParallelLinear` with `gather_output`):
    /// every rank gets the whole output, for code that needs it whole (a loss or an argmax
    /// over the vocabulary), at the cost of an all-gather.
    GatheredColumn,
    /// Input features split (`RowParallelLinear`, input already split): weight `[in / tp,
    /// out]`, the bias whole, the outputs summed over the ranks.
    Row,
    /// Vocabulary rows split (`VocabParallelEmbedding`): table `[vocab / tp, d]`.
    Vocab,
    /// [`nn::transformer`](super::nn::transformer)'s encoder split as Megatron splits a
    /// transformer layer: `query`, `key`, `value` and `linear_inner` column-parallel,
    /// `output` and `linear_outer` row-parallel, the norms whole, dropout from a tracker.
    Encoder,
}

/// What a slot holds once a plan assigned its layer.
#[derive(Debug, Clone)]
pub(super) struct Assigned {
    pub(super) split: Split,
    pub(super) tp: Comm,
    pub(super) layout: LayoutOwner,
    /// The plan's dropout streams, for a split encoder's attention, feed-forward and layer.
    pub(super) rng: Option<RngTracker>,
}

/// What the plan's mapper offers the slot it is entering, and what became of it.
#[derive(Debug, Default)]
enum Offer {
    #[default]
    None,
    /// For the slot being mapped now.
    Split(Assigned),
    /// The slot had a split already: a plan applied twice.
    Refused,
}

thread_local! {
    /// The plan's offer to the slot being mapped now (set and cleared by the plan's mapper).
    static PENDING: RefCell<Offer> = const { RefCell::new(Offer::None) };
}

/// A layer's tensor-parallel split, empty until a [`TpPlan`] assigns one. A module with no
/// parameters: records and paths stay those of Burn's layer.
#[derive(Debug, Clone, Default)]
pub struct TpSlot(pub(super) Option<Assigned>);

impl TpSlot {
    /// The split, if a plan assigned one.
    pub fn split(&self) -> Option<Split> {
        self.0.as_ref().map(|a| a.split)
    }

    /// The dropout streams a plan gave a split encoder's part.
    pub(super) fn rng(&self) -> Option<&RngTracker> {
        self.0.as_ref().and_then(|a| a.rng.as_ref())
    }

    /// The group the layer is split over, or a group of one.
    pub(super) fn group(&self) -> Comm {
        match &self.0 {
            Some(a) => a.tp.clone(),
            None => std::sync::Arc::new(
                crate::comm::LocalWorld::new(1)
                    .communicator("tp", vec![0], 0)
                    .expect("a group of one rank always forms"),
            ),
        }
    }
}

impl Module for TpSlot {
    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }
    fn fork(self, _: &Device) -> Self {
        self
    }
    fn to_device(self, _: &Device) -> Self {
        self
    }
    fn train(self) -> Self {
        self
    }
    fn valid(&self) -> Self {
        self.clone()
    }
    fn materialize(self) -> Self {
        self
    }
    fn visit<V: ModuleVisitor>(&self, _: &mut V) {}
    fn map<M: ModuleMapper>(self, _: &mut M) -> Self {
        PENDING.with(|p| {
            let mut offer = p.borrow_mut();
            match (std::mem::take(&mut *offer), &self.0) {
                (Offer::Split(_), Some(_)) => {
                    *offer = Offer::Refused;
                    self
                }
                (Offer::Split(assigned), None) => Self(Some(assigned)),
                (other, _) => {
                    *offer = other;
                    self
                }
            }
        })
    }
}

impl ModuleDisplayDefault for TpSlot {
    fn content(&self, content: Content) -> Option<Content> {
        let split = self
            .split()
            .map_or("none".to_string(), |s| format!("{s:?}"));
        content.add_formatted(&split).optional()
    }
}

impl ModuleDisplay for TpSlot {}

/// Which layers are split how, by module path (glob patterns: `*` matches any run of
/// characters, dots included): Megatron's layout of a Burn model, stated once.
///
/// ```
/// use burn_megatron::tensor_parallel::dropin::TpPlan;
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

    /// Embeddings whose vocabulary rows split.
    pub fn vocab(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::Vocab)
    }

    /// [`nn::transformer::TransformerEncoder`](super::nn::transformer::TransformerEncoder)s
    /// split as Megatron splits a transformer layer ([`Split::Encoder`]); their dropout draws
    /// from streams seeded by [`with_seed`](Self::with_seed).
    pub fn encoder(self, patterns: &[&str]) -> Result<Self, TpError> {
        self.rule(patterns, Split::Encoder)
    }

    /// The seed of the weights a plan draws: a split layer not yet initialised (Burn draws
    /// lazily) draws its shard from Burn's default law for its type, seeded by its path, the
    /// same at every TP size and on every rank (Burn's own draw would differ across ranks
    /// running as threads). Loading a record afterwards replaces them.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
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
        let mut mapper = PlanMapper {
            plan: self,
            tp,
            rng: RngTracker::new(self.seed, tp.group().rank()),
            path: Vec::new(),
            types: Vec::new(),
            active: None,
            owner: None,
            fan_in: None,
            matched: vec![false; self.rules.len()],
            error: None,
        };
        let model = model.map(&mut mapper);
        PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
        if let Some(e) = mapper.error {
            return Err(e);
        }
        let unused: Vec<String> = (self.rules.iter().zip(&mapper.matched))
            .filter(|(_, m)| !**m)
            .map(|((p, s), _)| format!("`{}` ({s:?})", p.as_str()))
            .collect();
        if !unused.is_empty() {
            return Err(TpError::Invalid(format!(
                "layer patterns that match no layer: {}",
                unused.join(", ")
            )));
        }
        Ok(model)
    }
}

/// A layer a rule named, while the traversal is inside it.
struct Active {
    depth: usize,
    path: String,
    split: Split,
    slots: usize,
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
    /// The input width of the linear whose parameters are being mapped.
    fan_in: Option<usize>,
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
                let owner = self.owner.take().unwrap_or_default();
                let rng = (split == Split::Encoder).then(|| self.rng.clone());
                let assigned = Assigned {
                    split,
                    tp: self.tp.clone(),
                    layout: owner,
                    rng,
                };
                PENDING.with(|p| *p.borrow_mut() = Offer::Split(assigned));
            }
            return;
        }
        if self.active.is_some() {
            return;
        }
        if let Some(i) = self.plan.rules.iter().position(|(p, _)| p.matches(&path)) {
            self.matched[i] = true;
            let split = self.plan.rules[i].1;
            self.active = Some(Active {
                depth: self.path.len(),
                path,
                split,
                slots: 0,
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
                Offer::Refused => self.fail(format!(
                    "{path}: the layer is split already (a plan applies once, to a model as \
                     the plain code builds it)"
                )),
            }
        }
        if let Some(active) = &self.active
            && active.depth == self.path.len()
        {
            if active.slots == 0 {
                let msg = format!(
                    "{}: a {:?} rule names it, but it has no tensor-parallel slot: it is one of \
                     burn::nn's types; import Linear, Embedding or SwiGlu from \
                     burn_megatron::tensor_parallel::dropin::nn instead",
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
        let Some(active) = &self.active else {
            return param;
        };
        let layer = self.types.last().cloned().unwrap_or_default();
        let field = self.path.last().cloned().unwrap_or_default();
        let path = self.path.join(".");
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
        let dim = match (layer.as_str(), field.as_str(), split) {
            ("Struct:Linear", "weight", Split::Column | Split::GatheredColumn) => Some(1),
            ("Struct:Linear", "bias", Split::Column | Split::GatheredColumn) => Some(0),
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
        // Burn draws a linear's weight and bias with the weight's input width as fan-in.
        let dims = param.lazy_shape().to_vec();
        if field == "weight" {
            self.fan_in = Some(if layer == "Struct:Linear" {
                dims[0]
            } else {
                dims[D - 1]
            });
        }
        let fan_in = self.fan_in.unwrap_or(dims[D - 1]);
        let owner = self.owner.get_or_insert_with(LayoutOwner::default).clone();
        let at = Placement {
            dim,
            layer: &layer,
            path: &path,
            seed: self.plan.seed,
            fan_in,
        };
        match shard(param, at, self.tp) {
            Ok(p) => {
                let attrs = dim.map_or_else(ParallelAttrs::default, ParallelAttrs::sharded);
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
            | "Struct:PositionWiseFeedForward"
            | "Struct:TransformerEncoderLayer"
    )
}

/// How an encoder splits the linear layer named `name`.
fn encoder_split(name: &str) -> Option<Split> {
    match name {
        "query" | "key" | "value" | "linear_inner" => Some(Split::Column),
        "output" | "linear_outer" => Some(Split::Row),
        _ => None,
    }
}

/// Where a parameter of a split layer goes, and how it is drawn if it has no values yet.
struct Placement<'a> {
    /// The split dimension (`None`: every rank holds it whole).
    dim: Option<usize>,
    layer: &'a str,
    path: &'a str,
    seed: u64,
    fan_in: usize,
}

/// `param`'s part on this rank: its values cut along the split dimension, or, not yet
/// initialised, drawn lazily from the layer's default law seeded by its path (a duplicated
/// one too: Burn's own draw would differ across ranks running as threads).
fn shard<const D: usize>(
    param: Param<Tensor<D>>,
    at: Placement<'_>,
    tp: &Comm,
) -> Result<Param<Tensor<D>>, (Param<Tensor<D>>, String)> {
    let (rank, size) = (tp.group().rank(), tp.group().size());
    let dims: [usize; D] = param.lazy_shape().dims();
    let (dim, part) = match at.dim {
        Some(dim) if !dims[dim].is_multiple_of(size) => {
            let e = format!(
                "{}: {} features along dim {dim} do not split over the tensor-parallel size {size}",
                at.path, dims[dim]
            );
            return Err((param, e));
        }
        Some(dim) => (dim, dims[dim] / size),
        None => (0, dims[0]),
    };
    let start = if at.dim.is_some() { rank * part } else { 0 };
    if param.is_initialized() {
        return Ok(match at.dim {
            Some(_) => shard_param(param.val().narrow(dim, start, part)),
            None => param,
        });
    }
    let law = match default_law(at.layer, at.path) {
        Ok(law) => law,
        Err(e) => return Err((param, e)),
    };
    let mut local = dims;
    local[dim] = part;
    let (seed, device) = (derive_seed(at.seed, at.path), param.lazy_device());
    let (total, width, fan_in) = (dims.iter().product::<usize>(), dims[D - 1], at.fan_in);
    Ok(lazy_host_param(local, &device, move || {
        let full = law.values(total, fan_in, seed);
        match (D, dim) {
            (2, 1) => slice_cols(&full, width, start, part),
            (2, _) => slice_rows(&full, width, start, part),
            _ => full[start..start + part].to_vec(),
        }
    }))
}

/// Burn's default initialiser for a `Linear` or an `Embedding`, as a host law.
fn default_law(layer: &str, path: &str) -> Result<MasterInit, String> {
    let burn_default = match layer {
        "Struct:Linear" => burn::nn::LinearConfig::new(1, 1).initializer,
        "Struct:Embedding" => burn::nn::EmbeddingConfig::new(1, 1).initializer,
        other => return Err(format!("{path}: no default initialiser for {other}")),
    };
    master_init(&burn_default).map_err(|e| format!("{path}: {e}"))
}
