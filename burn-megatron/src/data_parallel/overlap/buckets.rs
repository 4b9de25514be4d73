//! The reducer's FP32 main-gradient buckets, kept where the gradients are (device memory on
//! a GPU): each parameter's main gradient is a tensor of its own until its bucket is
//! complete, when the bucket is concatenated in its layout (padding as zeros) and handed to
//! the reduction.

use super::super::finalize::bucket_layout;
use super::super::shard_plan::ShardPlan;
use crate::comm::CommError;
use crate::comm::handoff::{Handoff, Reduced};
use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor};
use std::collections::{HashMap, HashSet, VecDeque};
use std::thread::JoinHandle;

#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub(super) bucket: usize,
    pub(super) offset: usize,
    pub(super) numel: usize,
}

#[derive(Debug, Default)]
pub(super) struct Bucket {
    /// Elements, padding included.
    pub(super) len: usize,
    /// The members, by offset.
    pub(super) members: Vec<ParamId>,
    pub(super) pending: usize,
    pub(super) result: Option<Result<Reduced, CommError>>,
}

/// What happened, in order: for tests that check the reduction started inside backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    Hook,
    Ready(usize),
    Launch(usize),
}

#[derive(Default)]
pub(super) struct State {
    pub(super) slots: HashMap<ParamId, Slot>,
    pub(super) buckets: Vec<Bucket>,
    /// This step's FP32 main gradients of the parameters whose bucket is not out yet.
    pub(super) main: HashMap<ParamId, Tensor<1>>,
    /// Whether the buckets were laid out again once the hooked parameters were known.
    pub(super) relaid: bool,
    pub(super) uses: HashMap<ParamId, usize>,
    pub(super) hooked: HashSet<ParamId>,
    /// Parameters a hook delivered a gradient of this step to (any micro-batch), with that
    /// gradient's dtype: Burn's gradients hold no copy of what was delivered, and the
    /// reduced gradient is written back in this dtype.
    pub(super) delivered: HashMap<ParamId, DType>,
    /// Parameters counted into their bucket's readiness this step.
    pub(super) done: HashSet<ParamId>,
    /// Micro-batches activated this step (with `last` or not).
    pub(super) activations: usize,
    /// Gradients of this step that reached no main gradient: computed while the reducer
    /// was inactive (`.0`), or after the parameter's bucket was handed to the reduction
    /// (`.1`). Either would be missing from the reduced gradient.
    pub(super) missed: HashMap<ParamId, (usize, usize)>,
    pub(super) last: bool,
    pub(super) closed: bool,
    /// Complete buckets not yet launched, in the order they completed.
    pub(super) queue: VecDeque<(usize, Handoff)>,
    pub(super) events: Vec<Event>,
    pub(super) worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("buckets", &self.buckets.len())
            .field("queued", &self.queue.len())
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl State {
    /// Forgets the step's gradients and counts (the buckets' results are taken apart).
    pub(super) fn reset_step(&mut self) {
        self.uses.clear();
        self.delivered.clear();
        self.done.clear();
        self.main.clear();
        self.missed.clear();
        self.activations = 0;
        self.last = false;
    }

    /// Adds a gradient contribution (flat, any float dtype) to its main gradient.
    pub(super) fn accumulate(&mut self, id: ParamId, grad: Tensor<1>) {
        let grad = grad.cast(DType::F32);
        let main = match self.main.remove(&id) {
            Some(main) => main + grad,
            None => grad,
        };
        self.main.insert(id, main);
    }

    /// Bucket `b` in its layout: each member's main gradient at its offset (taken out of
    /// `main`), zeros where a member got none and in the padding.
    pub(super) fn flatten(&mut self, b: usize, device: &Device) -> Tensor<1> {
        let zeros = |n: usize| Tensor::<1>::zeros([n], (device, DType::F32));
        let (len, members) = (self.buckets[b].len, self.buckets[b].members.clone());
        let mut pieces = Vec::with_capacity(members.len() + 1);
        let mut at = 0;
        for id in members {
            let slot = self.slots[&id];
            if slot.offset > at {
                pieces.push(zeros(slot.offset - at));
            }
            pieces.push(self.main.remove(&id).unwrap_or_else(|| zeros(slot.numel)));
            at = slot.offset + slot.numel;
        }
        if len > at {
            pieces.push(zeros(len - at));
        }
        Tensor::cat(pieces, 0)
    }
}

/// Appends buckets for `params` ((id, element count) in module order, bucketed in reverse).
pub(super) fn add_buckets(params: &[(ParamId, usize)], bucket_size: usize, state: &mut State) {
    let numels: Vec<usize> = params.iter().map(|p| p.1).collect();
    for members in bucket_layout(&numels, bucket_size) {
        let bucket = state.buckets.len();
        let mut offset = 0;
        let mut ids = Vec::with_capacity(members.len());
        for &i in &members {
            let (id, numel) = params[i];
            let slot = Slot {
                bucket,
                offset,
                numel,
            };
            state.slots.insert(id, slot);
            ids.push(id);
            offset += numel;
        }
        state.buckets.push(Bucket {
            len: offset,
            members: ids,
            ..Bucket::default()
        });
    }
}

/// The buckets of a distributed optimizer's plan, padding included.
pub(super) fn plan_buckets(plan: &ShardPlan, state: &mut State) {
    for (bucket, planned) in plan.buckets().iter().enumerate() {
        let mut members: Vec<(usize, ParamId)> = Vec::with_capacity(planned.params.len());
        for p in &planned.params {
            let slot = Slot {
                bucket,
                offset: p.offset,
                numel: p.numel,
            };
            state.slots.insert(p.id, slot);
            members.push((p.offset, p.id));
        }
        members.sort_by_key(|m| m.0);
        state.buckets.push(Bucket {
            len: planned.len,
            members: members.into_iter().map(|m| m.1).collect(),
            ..Bucket::default()
        });
    }
}
