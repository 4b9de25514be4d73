//! The slot a drop-in layer carries: its split once a plan assigns one, and what the plan
//! must respect: the heads a split must divide, an activation that refuses any split, the
//! initializer of the parameters the plan draws.
//!
//! Burn's module traversal gives a mapper parameters, not fields; the plan hands the slot its
//! split through a value this thread holds only while the slot is being mapped (set when the
//! traversal enters the slot, taken by the slot, checked when it leaves). What the slot knows
//! of its layer goes the other way, in a visit before anything is mapped ([`facts`]): a
//! layer's parameters come before its slot, and the plan draws them, the loader reads them
//! and the writer gathers them.

use super::plan::Split;
use crate::comm::Comm;
use crate::tensor_parallel::RngTracker;
use crate::tensor_parallel::{LayoutOwner, ParallelAttrs};
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::nn::Initializer;
use burn::nn::activation::Activation;
use burn::tensor::Device;
use std::cell::RefCell;
use std::collections::HashMap;

/// What a slot holds once a plan assigned its layer.
#[derive(Clone)]
pub(super) struct Assigned {
    pub(super) split: Split,
    pub(super) tp: Comm,
    pub(super) layout: LayoutOwner,
    /// The plan's dropout streams, for a split encoder's attention, feed-forward and layer.
    pub(super) rng: Option<RngTracker>,
    /// The real vocabulary of a layer split over a padded one.
    pub(super) vocab: Option<usize>,
    /// A transformer layer whose residual stream is split by sequence between its blocks.
    pub(super) sequence_parallel: bool,
}

impl Assigned {
    /// The attributes of a parameter the layer splits along `dim`, its vocabulary's padding
    /// included.
    pub(super) fn sharded(&self, dim: usize) -> ParallelAttrs {
        ParallelAttrs::sharded(dim).padded_from(self.vocab)
    }
}

/// The split and this rank's place in the group: a layer's `Debug` would otherwise print
/// the whole communicator (every group of the world) in each of its slots.
impl std::fmt::Debug for Assigned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = self.tp.group();
        f.debug_struct("Assigned")
            .field("split", &self.split)
            .field("tp_rank", &group.rank())
            .field("tp_size", &group.size())
            .field("vocab", &self.vocab)
            .field("sequence_parallel", &self.sequence_parallel)
            .finish_non_exhaustive()
    }
}

/// What the plan's mapper offers the slot it is entering, and what became of it.
#[derive(Debug, Default)]
pub(super) enum Offer {
    #[default]
    None,
    /// For the slot being mapped now.
    Split(Assigned),
    /// The slot had a split already: a plan applied twice.
    Refused,
    /// The layer's attention heads (or its key/value heads, `kv`) do not split over the group.
    Heads { heads: usize, kv: bool, tp: usize },
    /// The layer cannot be split at all, for this reason.
    Cannot(String),
}

thread_local! {
    /// The plan's offer to the slot being mapped now (set and cleared by the plan's mapper).
    pub(super) static PENDING: RefCell<Offer> = const { RefCell::new(Offer::None) };
    /// What the slot visited last knows (set by the slot while [`facts`] walks, taken by it).
    static SEEN: RefCell<Option<Facts>> = const { RefCell::new(None) };
    /// [`facts`] is walking: other visitors leave nothing behind (a layer's layout owner
    /// would outlive its model).
    static COLLECTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A layer's tensor-parallel split, empty until a [`TpPlan`](super::TpPlan) assigns one,
/// with what the plan must know of the layer. A module with no parameters: records and paths
/// stay those of Burn's layer.
#[derive(Debug, Clone, Default)]
pub struct TpSlot {
    pub(super) assigned: Option<Assigned>,
    /// An attention layer's query and key/value heads, which a split must divide (checked
    /// when the plan assigns it, so that a layout that does not fit fails before any forward).
    heads: Option<(usize, usize)>,
    /// Why the layer cannot be split at all.
    refuses: Option<String>,
    /// The initializer the layer's config named, for the parameters a plan draws (none:
    /// Burn's default for the layer's type).
    init: Option<Initializer>,
    /// A linear in Burn's column layout: Burn's record holds its weight `[out, in]`.
    col: bool,
}

/// Why `activation` cannot run on the ranks' slices of a feed-forward's inner width, if it
/// cannot: it mixes (`SwiGlu`) or weighs (`PRelu`) the channels they split.
pub(super) fn not_elementwise(activation: &Activation) -> Option<String> {
    let name = match activation {
        Activation::SwiGlu(_) => "SwiGlu",
        Activation::PRelu(_) => "PRelu",
        _ => return None,
    };
    Some(format!(
        "the activation {name} does not act elementwise, so it cannot run on the \
         tensor-parallel ranks' slices of the inner width"
    ))
}

/// What a layer's slot knows that its parameters do not say.
#[derive(Debug, Clone, Default)]
pub(super) struct Facts {
    /// The initializer its config named.
    pub(super) init: Option<Initializer>,
    /// A linear in Burn's column layout (its record holds the weight transposed).
    pub(super) col: bool,
    /// A plan split it: how, where its parameters' layout is stated, and whether over a
    /// padded vocabulary.
    pub(super) assigned: Option<(Split, LayoutOwner, bool)>,
}

impl TpSlot {
    /// The slot of an attention layer of `heads` heads.
    pub(super) fn attention(heads: usize) -> Self {
        Self::grouped_attention(heads, heads)
    }

    /// The slot of an attention layer of `heads` query heads sharing `kv_heads` key/value
    /// heads: a split keeps each query head with its key/value head, so both must divide.
    pub(super) fn grouped_attention(heads: usize, kv_heads: usize) -> Self {
        let refuses = (kv_heads == 0 || !heads.is_multiple_of(kv_heads))
            .then(|| format!("{heads} query heads cannot share {kv_heads} key/value heads evenly"));
        Self {
            heads: Some((heads, kv_heads)),
            refuses,
            ..Self::default()
        }
    }

    /// The slot of a layer whose parameters `init` draws.
    pub(super) fn drawn_with(init: Initializer) -> Self {
        Self {
            init: Some(init),
            ..Self::default()
        }
    }

    /// The slot of a linear layer whose parameters `init` draws, in Burn's column layout or
    /// not.
    pub(super) fn linear(init: Initializer, col: bool) -> Self {
        Self {
            col,
            ..Self::drawn_with(init)
        }
    }

    /// The slot of a feed-forward block: an activation that does not act elementwise mixes
    /// or weighs the channels the ranks would split, so the block refuses any split.
    pub(super) fn feed_forward(activation: &Activation) -> Self {
        Self {
            refuses: not_elementwise(activation),
            ..Self::default()
        }
    }

    /// The split, if a plan assigned one.
    pub fn split(&self) -> Option<Split> {
        self.assigned.as_ref().map(|a| a.split)
    }

    /// The dropout streams a plan gave a split encoder's part.
    pub(super) fn rng(&self) -> Option<&RngTracker> {
        self.assigned.as_ref().and_then(|a| a.rng.as_ref())
    }

    /// A linear in Burn's column layout.
    pub(super) fn col(&self) -> bool {
        self.col
    }

    /// The group a transformer layer's residual stream is split over by sequence, if a plan
    /// asked for sequence parallelism.
    pub(super) fn sequence_parallel(&self) -> Option<&Comm> {
        let a = self.assigned.as_ref()?;
        a.sequence_parallel.then_some(&a.tp)
    }

    /// The group the layer is split over, or a group of one.
    pub(super) fn group(&self) -> Comm {
        match &self.assigned {
            Some(a) => a.tp.clone(),
            None => crate::comm::solo_group("tp"),
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
    fn visit<V: ModuleVisitor>(&self, _: &mut V) {
        if !COLLECTING.with(|c| c.get()) {
            return;
        }
        let facts = Facts {
            init: self.init.clone(),
            col: self.col,
            assigned: (self.assigned.as_ref())
                .map(|a| (a.split, a.layout.clone(), a.vocab.is_some())),
        };
        SEEN.with(|s| *s.borrow_mut() = Some(facts));
    }
    fn map<M: ModuleMapper>(self, _: &mut M) -> Self {
        PENDING.with(|p| {
            let mut offer = p.borrow_mut();
            match (std::mem::take(&mut *offer), &self.assigned) {
                (Offer::Split(_), Some(_)) => {
                    *offer = Offer::Refused;
                    self
                }
                (Offer::Split(assigned), None) => {
                    let tp = assigned.tp.group().size();
                    match (&self.refuses, self.heads) {
                        (Some(reason), _) => {
                            *offer = Offer::Cannot(reason.clone());
                            self
                        }
                        (_, Some((heads, _))) if !heads.is_multiple_of(tp) => {
                            *offer = Offer::Heads {
                                heads,
                                kv: false,
                                tp,
                            };
                            self
                        }
                        (_, Some((_, kv))) if !kv.is_multiple_of(tp) => {
                            *offer = Offer::Heads {
                                heads: kv,
                                kv: true,
                                tp,
                            };
                            self
                        }
                        _ => Self {
                            assigned: Some(assigned),
                            ..self
                        },
                    }
                }
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

/// What each slotted layer's slot knows, by the layer's module path.
pub(super) fn facts<M: Module>(model: &M) -> HashMap<String, Facts> {
    struct Reader(Vec<String>, HashMap<String, Facts>);
    impl ModuleVisitor for Reader {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, name: &str, _: &str) {
            self.0.pop();
            if name == "tp"
                && let Some(facts) = SEEN.with(|s| s.borrow_mut().take())
            {
                self.1.insert(self.0.join("."), facts);
            }
        }
    }
    SEEN.with(|s| s.borrow_mut().take());
    /// Ends the collection however the walk ends.
    struct Collecting;
    impl Drop for Collecting {
        fn drop(&mut self) {
            COLLECTING.with(|c| c.set(false));
        }
    }
    COLLECTING.with(|c| c.set(true));
    let _collecting = Collecting;
    let mut reader = Reader(Vec::new(), HashMap::new());
    model.visit(&mut reader);
    reader.1
}

/// Whether the parameter at `path` is the weight of a linear in Burn's column layout, and
/// if so whether a plan split it: Burn's record holds it transposed, through the layer's
/// mapper while whole, and a split one's shards have no mapper.
pub(super) fn col_weight(facts: &HashMap<String, Facts>, path: &str) -> Option<bool> {
    let (layer, field) = path.rsplit_once('.').unwrap_or(("", path));
    let facts = facts.get(layer).filter(|f| f.col && field == "weight")?;
    Some(facts.assigned.is_some())
}
