//! Parallel attributes of parameters, queryable by [`ParamId`].
//!
//! Parallel layers record, for each parameter they own, whether it is a tensor-parallel
//! shard (and along which dimension), whether its gradient is partial under sequence
//! parallelism, and whether it is a shared embedding. The optimizer reads these to count
//! each gradient once in the global norm, and data-parallel code to finish reductions —
//! without the user annotating anything. A parameter never registered is *duplicated*: every
//! tensor-parallel rank holds the same full copy.
//!
//! The table is keyed by id, and ids change under a module's feet: Burn's record loading
//! (`load_record`, `load_file`) gives each parameter the id it was saved with, which in a new
//! process was never registered. So a layer states its parameters' attributes not only when
//! it is built but again at every forward (a read and a compare when nothing changed): every
//! parameter that has a gradient went through a forward since it got its current id, and the
//! readers all run after backward. A custom layer does the same with
//! [`set_layout_attrs`] in its `forward`, or better with a [`LayoutOwner`] it holds, so that
//! its entries are freed with it. What a save would lose to missing or stale attributes is
//! caught before it writes: the tensor-parallel ranks compare what they are about to save.

use burn::module::ParamId;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock, Weak};

/// How much of the slice `[start, start + len)` of a padded extent lies before the padding,
/// which begins at `real` (`None`: nothing is padding).
pub(crate) fn real_part(real: Option<usize>, start: usize, len: usize) -> usize {
    real.map_or(len, |r| r.saturating_sub(start).min(len))
}

/// How one parameter is laid out across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParallelAttrs {
    /// Each tensor-parallel rank holds a different slice (`true`), or the same copy.
    pub tensor_model_parallel: bool,
    /// The dimension of the full tensor that is split, when `tensor_model_parallel`.
    pub partition_dim: Option<usize>,
    /// The full tensor's real extent along `partition_dim` when the shards pad it to split
    /// evenly (a vocabulary of 50257 rows at TP 2): the full tensor's rows or columns from
    /// there on are zeros the layer keeps out of its output, and no record holds them.
    /// `None`: the shards' sizes add up to the real tensor.
    pub unpadded_size: Option<usize>,
    /// A duplicated parameter used on sequence-parallel activations: each rank's gradient
    /// covers only its part of the sequence and must be all-reduced over the TP group
    /// (LayerNorm weights, row-parallel biases).
    pub sequence_parallel: bool,
    /// A word embedding tied between the first and the last pipeline stage (Megatron's
    /// `shared_embedding`, set on both copies): `finalize_model_grads` sums its gradient
    /// over the embedding group.
    pub shared_embedding: bool,
    /// The last stage's copy of a tied weight (Megatron's `shared`): the first stage's copy
    /// already counts it in the global gradient norm, so this one never does.
    pub shared: bool,
    /// A mixture-of-experts expert's weight (Megatron's `allreduce = False`): each
    /// expert-parallel rank holds different experts (and each expert tensor-parallel rank a
    /// different slice of them), so its gradient is reduced over the
    /// expert data-parallel group, and its share of the gradient norm summed over the
    /// expert model-parallel group, instead of the dense groups.
    pub expert: bool,
}

impl ParallelAttrs {
    /// A tensor-parallel shard split along `dim` of the full tensor.
    pub fn sharded(dim: usize) -> Self {
        Self {
            tensor_model_parallel: true,
            partition_dim: Some(dim),
            ..Self::default()
        }
    }

    /// These attributes for a shard whose full tensor is padded beyond `real` entries along
    /// its split dimension (see [`unpadded_size`](Self::unpadded_size); `None`: not padded).
    ///
    /// ```
    /// use burn_megatron::tensor_parallel::ParallelAttrs;
    /// let attrs = ParallelAttrs::sharded(0).padded_from(33);
    /// // The last of two ranks holds rows 17..34 of a 34-row padded table, row 33 padding.
    /// assert_eq!(attrs.placement(&[17, 8], 1, 2), (vec![34, 8], vec![17, 0]));
    /// assert_eq!(attrs.unpadded_size, Some(33));
    /// assert_eq!(ParallelAttrs::sharded(0).padded_from(None).unpadded_size, None);
    /// ```
    pub fn padded_from(mut self, real: impl Into<Option<usize>>) -> Self {
        self.unpadded_size = real.into();
        self
    }

    /// The split dimension and the full tensor's real extent along it, when the shards pad it
    /// ([`unpadded_size`](Self::unpadded_size)).
    pub fn padding(&self) -> Option<(usize, usize)> {
        self.split_dim().zip(self.unpadded_size)
    }

    /// An expert's weight, split along `split_dim` under expert tensor parallelism (whose
    /// groups are the tensor-parallel groups), whole without it (`None`).
    pub fn expert(split_dim: Option<usize>) -> Self {
        Self {
            expert: true,
            ..split_dim.map_or_else(Self::default, Self::sharded)
        }
    }

    /// Duplicated on every tensor-parallel rank, with a sequence-parallel gradient.
    pub fn sequence_parallel() -> Self {
        Self {
            sequence_parallel: true,
            ..Self::default()
        }
    }

    /// The split dimension of a tensor-parallel shard (`None` for a duplicated parameter).
    pub fn split_dim(&self) -> Option<usize> {
        self.partition_dim.filter(|_| self.tensor_model_parallel)
    }

    /// The global shape and this rank's offset in it of a parameter whose local shard has
    /// `dims`, on tensor-parallel rank `tp_rank` of `tp`: shards are contiguous slices along
    /// their split dim in rank order (the layers slice one full initialisation).
    ///
    /// ```
    /// use burn_megatron::tensor_parallel::ParallelAttrs;
    /// assert_eq!(ParallelAttrs::sharded(1).placement(&[4, 3], 1, 2), (vec![4, 6], vec![0, 3]));
    /// assert_eq!(ParallelAttrs::default().placement(&[4, 3], 1, 2), (vec![4, 3], vec![0, 0]));
    /// ```
    pub fn placement(&self, dims: &[usize], tp_rank: usize, tp: usize) -> (Vec<usize>, Vec<usize>) {
        let mut global = dims.to_vec();
        let mut offset = vec![0; dims.len()];
        if let Some(d) = self.split_dim().filter(|&d| d < dims.len()) {
            global[d] *= tp;
            offset[d] = tp_rank * dims[d];
        }
        (global, offset)
    }

    /// Whether this rank's copy contributes to the global gradient norm on a rank with the
    /// given tensor-parallel rank: shards and experts always, duplicates only on TP rank 0,
    /// the second copy of a tied weight never.
    pub fn counts_in_grad_norm(&self, tp_rank: usize) -> bool {
        !self.shared && (self.tensor_model_parallel || self.expert || tp_rank == 0)
    }

    /// These attributes with the layout (every field but the tie flags: the split, its
    /// padding, `sequence_parallel`, `expert`) of `layout`, keeping the tie flags of `self`.
    pub fn with_layout_of(self, layout: ParallelAttrs) -> Self {
        Self {
            shared_embedding: self.shared_embedding,
            shared: self.shared,
            ..layout
        }
    }

    /// These attributes marked as a tied embedding's copy: on the first stage
    /// (`second_copy` false) or on the last (`true`, left out of the gradient norm).
    pub fn tied_embedding(mut self, second_copy: bool) -> Self {
        self.shared_embedding = true;
        self.shared = second_copy;
        self
    }
}

/// One parameter's attributes, and the layers that stated them: the entry lives as long as
/// some clone of one of them does (`None`: stated by hand, kept for the process). Several
/// layers hold one id when ranks of one process share parameter ids: the data-parallel
/// replicas of a model loaded from one checkpoint take the ids it was saved with.
#[derive(Debug, Clone)]
struct Entry {
    attrs: ParallelAttrs,
    owners: Option<Vec<Weak<()>>>,
}

impl Entry {
    fn alive(&self) -> bool {
        (self.owners.as_ref()).is_none_or(|o| o.iter().any(|w| w.strong_count() > 0))
    }

    /// Whether `owner` is among the layers holding this entry.
    fn held_by(&self, owner: &LayoutOwner) -> bool {
        let me = Arc::downgrade(&owner.0);
        (self.owners.iter().flatten()).any(|w| Weak::ptr_eq(w, &me))
    }

    /// Adds `owners`' live ones to this entry's (an entry stated by hand becomes owned).
    fn add_owners(&mut self, owners: impl IntoIterator<Item = Weak<()>>) {
        let list = self.owners.get_or_insert_with(Vec::new);
        list.retain(|w| w.strong_count() > 0);
        for w in owners {
            if w.strong_count() > 0 && !list.iter().any(|o| Weak::ptr_eq(o, &w)) {
                list.push(w);
            }
        }
    }
}

#[derive(Default)]
struct Registry {
    entries: HashMap<ParamId, Entry>,
    /// The size at which dead entries are swept next.
    sweep_at: usize,
}

/// Entries are swept of dead owners whenever the table has doubled since the last sweep,
/// so its size stays within twice the live entries (and this floor).
const SWEEP_FLOOR: usize = 1024;

impl Registry {
    fn insert(&mut self, id: ParamId, entry: Entry) {
        self.entries.insert(id, entry);
        if self.entries.len() >= self.sweep_at.max(SWEEP_FLOOR) {
            self.entries.retain(|_, e| e.alive());
            self.sweep_at = 2 * self.entries.len();
        }
    }

    fn get(&self, id: ParamId) -> Option<&Entry> {
        self.entries.get(&id).filter(|e| e.alive())
    }
}

fn registry() -> &'static RwLock<Registry> {
    static REGISTRY: OnceLock<RwLock<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

fn read() -> std::sync::RwLockReadGuard<'static, Registry> {
    registry().read().unwrap_or_else(|e| e.into_inner())
}

fn write() -> std::sync::RwLockWriteGuard<'static, Registry> {
    registry().write().unwrap_or_else(|e| e.into_inner())
}

/// Applies `update` to the attributes of `id`; writes only when they change, or when
/// `owner` states them and is not yet among the live layers holding them.
fn update_entry(
    id: ParamId,
    owner: Option<&LayoutOwner>,
    update: impl FnOnce(ParallelAttrs) -> ParallelAttrs,
) {
    // Every layer states its attributes at every forward: the common case, nothing changed,
    // reads without copying the entry.
    let (current, held) = match read().get(id) {
        Some(e) => (e.attrs, owner.is_none_or(|o| e.held_by(o))),
        None => (ParallelAttrs::default(), owner.is_none()),
    };
    let attrs = update(current);
    if attrs == current && held {
        return;
    }
    let old = read().get(id).cloned();
    let mut entry = old.unwrap_or(Entry {
        attrs,
        owners: None,
    });
    entry.attrs = attrs;
    if let Some(o) = owner {
        entry.add_owners([Arc::downgrade(&o.0)]);
    }
    write().insert(id, entry);
}

/// What a parallel layer holds (`#[module(skip)]`) so that the attributes it states live
/// exactly as long as it does: its clones share the owner, and once the last one is dropped
/// the entries are freed: the way a custom layer states its parameters' attributes.
/// Attributes stated without an owner ([`set_layout_attrs`]) are kept for the life of the
/// process.
///
/// ```
/// use burn::module::ParamId;
/// use burn_megatron::tensor_parallel::{LayoutOwner, ParallelAttrs, parallel_attrs};
/// let (owner, id) = (LayoutOwner::default(), ParamId::new());
/// owner.state(id, ParallelAttrs::sharded(0));
/// assert_eq!(parallel_attrs(id), ParallelAttrs::sharded(0));
/// drop(owner);
/// assert_eq!(parallel_attrs(id), ParallelAttrs::default());
/// ```
#[derive(Debug, Clone, Default)]
pub struct LayoutOwner(Arc<()>);

impl LayoutOwner {
    /// [`set_layout_attrs`] for a parameter of the layer holding this owner.
    pub fn state(&self, id: ParamId, layout: ParallelAttrs) {
        self.update(id, |a| a.with_layout_of(layout));
    }

    /// Changes the attributes of a parameter of the layer holding this owner in place (an id
    /// never registered starts as duplicated); an entry another live owner stated keeps that
    /// owner.
    pub fn update(&self, id: ParamId, update: impl FnOnce(ParallelAttrs) -> ParallelAttrs) {
        update_entry(id, Some(self), update);
    }
}

/// Gives parameter `to` the attributes of `from`, and its owners: a parameter whose id
/// changed (a checkpoint restores the saved ids) lives as long as the layer holding it. When
/// another live layer already holds `to` (another rank of this process restored the same
/// id), both hold it.
pub(crate) fn copy_parallel_attrs(from: ParamId, to: ParamId) {
    let mut r = write();
    let Some(source) = r.get(from).cloned() else {
        return;
    };
    let entry = match r.get(to).cloned() {
        Some(mut held) => {
            held.attrs = source.attrs;
            match source.owners {
                Some(owners) => held.add_owners(owners),
                None => held.owners = None,
            }
            held
        }
        None => source,
    };
    r.insert(to, entry);
}

/// How many entries the table holds, dead ones not yet swept included.
#[cfg(test)]
pub(crate) fn parallel_attrs_entries() -> usize {
    read().entries.len()
}

/// Changes the attributes of `id` in place (an id never registered starts as duplicated);
/// takes the write lock only when `update` changed something, so layers can call it at every
/// forward.
pub(crate) fn update_parallel_attrs(
    id: ParamId,
    update: impl FnOnce(ParallelAttrs) -> ParallelAttrs,
) {
    update_entry(id, None, update);
}

/// Records the layout part of `layout` for `id` and keeps its tie flags: what a layer states
/// about the parameters it owns, at init and at every forward (see the module docs), while
/// the model that ties two copies of a weight states the tie.
///
/// ```
/// use burn::module::ParamId;
/// use burn_megatron::tensor_parallel::{ParallelAttrs, parallel_attrs, set_layout_attrs};
/// let id = ParamId::new();
/// set_layout_attrs(id, ParallelAttrs::sharded(0));
/// assert_eq!(parallel_attrs(id), ParallelAttrs::sharded(0));
/// ```
pub fn set_layout_attrs(id: ParamId, layout: ParallelAttrs) {
    update_parallel_attrs(id, |a| a.with_layout_of(layout));
}

/// The attributes of parameter `id`; a parameter never registered is duplicated.
///
/// ```
/// use burn::module::ParamId;
/// use burn_megatron::tensor_parallel::{ParallelAttrs, parallel_attrs, set_layout_attrs};
/// let id = ParamId::new();
/// assert_eq!(parallel_attrs(id), ParallelAttrs::default());
/// set_layout_attrs(id, ParallelAttrs::sharded(1));
/// assert!(parallel_attrs(id).tensor_model_parallel);
/// ```
pub fn parallel_attrs(id: ParamId) -> ParallelAttrs {
    read().get(id).map(|e| e.attrs).unwrap_or_default()
}

#[cfg(test)]
mod tests;
