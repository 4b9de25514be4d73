//! Overlapping the data-parallel gradient reduction with backward (Megatron's
//! `overlap_grad_reduce`).
//!
//! An [`OverlapReducer`] keeps FP32 main-gradient buckets (Megatron's grad buffers, reverse
//! parameter order). While it is active on a thread, [`ColumnParallelLinear`] and
//! [`RowParallelLinear`] wrap their weight and bias in a gradient-ready hook: in backward each
//! hooked gradient is added to its bucket, and on the step's last micro-batch a bucket whose
//! gradients are all in is all-reduced by a worker thread while backward goes on. Parameters
//! no layer hooks (norms, embeddings, plain Burn layers) are added at
//! [`OverlapReducer::finish`], which waits for the worker and writes the reduced gradients
//! back. Buckets are launched in the order they complete, which is the same on every rank
//! (the same graph runs backward everywhere), so the collectives match.
//!
//! The main gradients stay where backward leaves the gradients: a hook adds its gradient to
//! the parameter's main gradient with a tensor op and reads nothing back, and a complete
//! bucket is concatenated on the device. The hook keeps the gradient: Burn's gradients get
//! no copy of it (Megatron's `param.grad` stays empty too), so a hooked parameter's gradient
//! is held once, in FP32, until `finish` writes the reduced one back. On CUDA over NCCL the
//! worker reduces it in place in device memory, ordered after backward's kernels on the
//! device (see `comm::handoff`); elsewhere it goes through host memory, one read per bucket.
//!
//! From the last micro-batch's activation until `finish` returns, the worker issues
//! collectives on the reducer's communicator. Give each reducer a channel of its own over
//! the data-parallel ranks ([`RankContext::chunk_data_parallel_groups`], one per model
//! chunk), not [`RankGroups::dp`]: the caller's collectives on that group (averaging the
//! losses, say) then cannot be paired with the worker's, whenever they run.
//!
//! Activate the reducer for every micro-batch of the step: [`OverlapReducer::finish`]
//! counts the gradients that reached it while it was inactive, or after their bucket went
//! out, and refuses a step that has any (they would be missing from the reduction).
//!
//! [`ColumnParallelLinear`]: crate::tensor_parallel::ColumnParallelLinear
//! [`RowParallelLinear`]: crate::tensor_parallel::RowParallelLinear
//! [`RankContext::chunk_data_parallel_groups`]: crate::launch::RankContext::chunk_data_parallel_groups
//! [`RankGroups::dp`]: crate::launch::RankGroups::dp

mod buckets;
#[cfg(test)]
mod tests;

pub(crate) use buckets::Event;

use super::DataParallelConfig;
use super::shard_plan::ShardPlan;
use crate::comm::handoff::{Handoff, Reduced};
use crate::comm::{Comm, CommError, Deadline, ReduceOp};
use crate::grad_hooks::{ActiveGuard, Claim, GradSink, GradSync, activate, claim};
use crate::module_path::{PathVisitor, visit_paths};
use crate::param_grads::{Flat, put_flat, take_flat};
use buckets::{State, add_buckets, plan_buckets};
use burn::module::{Module, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

#[derive(Debug)]
struct Shared {
    comm: Comm,
    op: ReduceOp,
    /// The distributed optimizer's plan: buckets reduce-scattered as it says, and never
    /// laid out again (the optimizer's shards are the plan's).
    plan: Option<ShardPlan>,
    /// The module's device (untracked), for the zeros a bucket is padded with.
    device: Device,
    state: Mutex<State>,
    ready: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One parameter's gradient is final for this step (counted once, however often called).
    fn complete(&self, state: &mut State, id: ParamId) {
        if !state.done.insert(id) {
            return;
        }
        if let Some(slot) = state.slots.get(&id).copied() {
            let b = slot.bucket;
            let bucket = &mut state.buckets[b];
            bucket.pending = bucket.pending.saturating_sub(1);
            if bucket.pending == 0 {
                let flat = state.flatten(b, &self.device);
                state.events.push(Event::Ready(b));
                if self.comm.group().size() == 1 {
                    let len = flat.dims()[0];
                    state.buckets[b].result = Some(Ok(Reduced::Tensor(Box::new(flat), 0..len)));
                } else {
                    // Here, on the thread whose kernels filled the bucket (see the module
                    // documentation).
                    state.queue.push_back((b, Handoff::new(&*self.comm, flat)));
                    self.ready.notify_all();
                }
            }
        }
    }

    /// The worker: reduces each bucket as it becomes complete. Every rank runs the same
    /// graph, so buckets complete — and are launched — in the same order everywhere.
    fn reduce_as_ready(self: Arc<Self>) {
        // (A temporary guard in the `for` header would live for the whole loop.)
        let buckets = self.lock().buckets.len();
        let timeout = self.comm.timeout();
        for _ in 0..buckets {
            let mut state = self.lock();
            // Bounded like every collective: a rank whose backward stalls (or never calls
            // `finish`) ends with an error instead of a worker waiting forever.
            let deadline = Deadline::from_now(timeout);
            while state.queue.is_empty() && !state.closed {
                let now = std::time::Instant::now();
                let left = deadline.left(now);
                if deadline.passed(now) {
                    let err = CommError::InvalidArgument {
                        group: self.comm.group().to_string(),
                        op: "overlapped gradient reduction",
                        reason: format!(
                            "no further bucket of gradients was complete within {timeout:?}"
                        ),
                    };
                    for b in &mut state.buckets {
                        b.result.get_or_insert_with(|| Err(err.clone()));
                    }
                    return;
                }
                state = self
                    .ready
                    .wait_timeout(state, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let Some((b, handoff)) = state.queue.pop_front().filter(|_| !state.closed) else {
                return;
            };
            state.events.push(Event::Launch(b));
            drop(state);
            let result = handoff.reduce(&*self.comm, self.op, self.scattered(b));
            self.lock().buckets[b].result = Some(result);
            self.ready.notify_all();
        }
    }

    /// Whether bucket `b` is reduce-scattered (the distributed optimizer's), not all-reduced.
    fn scattered(&self, b: usize) -> bool {
        self.plan
            .as_ref()
            .is_some_and(|p| !p.buckets()[b].all_reduced)
    }
}

impl GradSink for Shared {
    fn hook(&self, id: ParamId, count: bool) -> bool {
        let mut state = self.lock();
        if !state.slots.contains_key(&id) {
            return false;
        }
        if count {
            *state.uses.entry(id).or_insert(0) += 1;
        }
        if state.last {
            state.hooked.insert(id);
        }
        true
    }

    fn deliver(&self, id: ParamId, grad: Tensor<1>) -> bool {
        let mut state = self.lock();
        state.events.push(Event::Hook);
        if !state.slots.contains_key(&id) {
            return false;
        }
        if state.done.contains(&id) {
            // Its bucket may already be on the wire: this gradient would be lost, and
            // `finish` refuses the step.
            state.missed.entry(id).or_default().1 += 1;
            return true;
        }
        state.delivered.entry(id).or_insert(grad.dtype());
        state.accumulate(id, grad);
        let uses = state.uses.entry(id).or_insert(1);
        *uses = uses.saturating_sub(1);
        if *uses == 0 && state.last {
            self.complete(&mut state, id);
        }
        true
    }

    fn deliver_inactive(&self, id: ParamId) {
        self.lock().missed.entry(id).or_default().0 += 1;
    }
}

/// A reduced gradient to write back at `finish`: where it lies in its bucket, and the
/// parameter's dims and gradient dtype.
struct WriteBack {
    id: ParamId,
    dims: Vec<usize>,
    dtype: DType,
    slot: buckets::Slot,
}

/// Reduces a module's gradients over the data-parallel group while backward runs. See the
/// module documentation.
#[derive(Debug)]
pub struct OverlapReducer {
    shared: Arc<Shared>,
    /// (id, rank) in module order.
    order: Vec<(ParamId, usize)>,
    /// Each parameter's dims: a gradient the hooks kept is written back in them.
    dims: HashMap<ParamId, Vec<usize>>,
    /// Module paths, for errors.
    names: HashMap<ParamId, String>,
    bucket_size: usize,
    /// Gradients of these parameters computed with the reducer inactive reach it too.
    _claim: Claim,
}

impl OverlapReducer {
    /// FP32 main-gradient buckets for every float parameter of `module` (bucket size and
    /// averaging from `config`; the reduction is always in f32).
    pub fn new<M: Module>(module: &M, dp: &Comm, config: &DataParallelConfig) -> Self {
        Self::build(module, dp, config, None)
    }

    /// The reducer of the distributed optimizer: the buckets of `plan` (made for `module`
    /// and `dp`), reduce-scattered as soon as they are complete; each gradient then holds
    /// the reduced values on the elements this rank owns and zeros elsewhere.
    pub fn distributed<M: Module>(
        module: &M,
        dp: &Comm,
        config: &DataParallelConfig,
        plan: &ShardPlan,
    ) -> Self {
        Self::build(module, dp, config, Some(plan.clone()))
    }

    fn build<M: Module>(
        module: &M,
        dp: &Comm,
        config: &DataParallelConfig,
        plan: Option<ShardPlan>,
    ) -> Self {
        let order = crate::data_parallel::dense_params(module);
        let dims = param_dims(module);
        let bucket_size = config.bucket_elements(dp.group().size());
        let mut state = State::default();
        match &plan {
            Some(plan) => plan_buckets(plan, &mut state),
            None => add_buckets(&sized(&order, &dims), bucket_size, &mut state),
        }
        let op = if config.average {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        };
        // Untracked: the main gradients are.
        let device = module.devices().into_iter().next().unwrap_or_default();
        let shared = Arc::new(Shared {
            comm: dp.clone(),
            op,
            plan,
            device: device.inner(),
            state: Mutex::new(state),
            ready: Condvar::new(),
        });
        let sink: Arc<dyn GradSink> = shared.clone();
        let claim = claim(&sink, order.iter().map(|o| o.0).collect());
        Self {
            shared,
            order,
            dims,
            names: param_names(module),
            bucket_size,
            _claim: claim,
        }
    }

    /// Number of buckets.
    pub fn num_buckets(&self) -> usize {
        self.shared.lock().buckets.len()
    }

    /// Activates the reducer on this thread for one micro-batch's forward and backward;
    /// `last` marks the step's last micro-batch, whose backward starts the reduction.
    ///
    /// Activate it for every micro-batch of the step: a gradient of the module computed
    /// while it is inactive (or, with `last` given too early, after its bucket went out)
    /// would be missing from the reduction, and [`Self::finish`] refuses the step.
    pub fn activate(&self, last: bool) -> ActiveGuard {
        let mut state = self.shared.lock();
        state.activations += 1;
        state.last = last;
        if last && state.worker.is_none() {
            for b in &mut state.buckets {
                b.pending = b.members.len();
                b.result = None;
            }
            state.queue.clear();
            state.hooked.clear();
            state.events.clear();
            if self.shared.comm.group().size() > 1 {
                let shared = self.shared.clone();
                state.worker = Some(std::thread::spawn(move || shared.reduce_as_ready()));
            }
        }
        drop(state);
        activate(self.shared.clone())
    }

    /// Adds the gradients no hook delivered, waits for every bucket's reduction and writes
    /// the reduced gradients into `grads` (in each gradient's dtype), those the hooks kept
    /// included. Returns the number of collectives issued. Call once per step, after the
    /// last micro-batch's backward.
    ///
    /// A step in which a gradient of the module missed the reduction (see
    /// [`Self::activate`]) is an error, and so is a failed reduction. The reduction still
    /// runs to its end, so that every rank's collectives stay matched, and the next step
    /// starts afresh. `grads` then holds what it held on entry, without the gradients the
    /// hooks kept during backward: the step cannot be taken.
    pub fn finish(&self, grads: &mut GradientsParams) -> Result<usize, CommError> {
        let mut taken = HashMap::new();
        let mut state = self.shared.lock();
        if state.closed {
            // (Only `join_worker` closes a live reducer.)
            state.reset_step();
            return Err(self.invalid(
                "an earlier step's reduction worker was left behind inside a collective that \
                 never finished; this reducer reduces nothing more (its channel could pair that \
                 collective with a later one): restart the job",
            ));
        }
        if !state.last {
            return Err(self.invalid("no last micro-batch was activated this step"));
        }
        let mut missed = std::mem::take(&mut state.missed);
        let activations = std::mem::take(&mut state.activations);
        for &(id, rank) in &self.order {
            // What no hook kept: the gradients of unhooked parameters, and of uses no hook saw.
            if let Some((flat, dims)) = take_flat(grads, id, rank) {
                if state.done.contains(&id) {
                    // Its bucket is out already: this part would be missing from it.
                    missed.entry(id).or_default().1 += 1;
                } else {
                    state.accumulate(id, flat.clone());
                }
                taken.insert(id, (flat, dims));
            }
            // As Megatron: a parameter that got no gradient in the last micro-batch (its
            // layer unused there) is ready now, with whatever it has.
            self.shared.complete(&mut state, id);
        }
        let worker = state.worker.take();
        drop(state);
        let joined = worker.map_or(Ok(()), |w| self.join_worker(w));
        let mut state = self.shared.lock();
        let writes = self.write_backs(&state, &taken);
        // The step is over, however it ended: the next one starts afresh.
        state.reset_step();
        let results: Vec<_> = state
            .buckets
            .iter_mut()
            .map(|b| (b.len, b.result.take()))
            .collect();
        self.relayout_hooked_first(&mut state);
        drop(state);
        let single = self.shared.comm.group().size() == 1;
        let mut reduced = Vec::with_capacity(results.len());
        let failed = joined.err().or_else(|| {
            for (b, (len, result)) in results.into_iter().enumerate() {
                match result {
                    Some(Ok(r)) => reduced.push(self.full_bucket(b, len, r)),
                    Some(Err(e)) => return Some(e),
                    None => return Some(self.invalid("a bucket was never reduced")),
                }
            }
            let reason = self.missed_reason(&missed, activations)?;
            Some(self.invalid(&reason))
        });
        if let Some(e) = failed {
            for (id, (flat, dims)) in taken {
                put_flat(grads, id, flat, &dims);
            }
            return Err(e);
        }
        let issued = if single { 0 } else { reduced.len() };
        // Bucket by bucket, so that each is freed once its gradients are written (an f32
        // gradient is a view of its bucket, and keeps it).
        for (values, writes) in reduced.into_iter().zip(writes) {
            for w in writes {
                let grad = values.clone().narrow(0, w.slot.offset, w.slot.numel);
                put_flat(grads, w.id, grad.cast(w.dtype), &w.dims);
            }
        }
        Ok(issued)
    }

    /// What to write back, by bucket: each gradient `grads` held (`taken`) or a hook kept.
    fn write_backs(&self, state: &State, taken: &HashMap<ParamId, Flat>) -> Vec<Vec<WriteBack>> {
        let mut writes: Vec<Vec<WriteBack>> =
            (0..state.buckets.len()).map(|_| Vec::new()).collect();
        for &(id, _) in &self.order {
            let written = match (taken.get(&id), state.delivered.get(&id)) {
                (Some((flat, dims)), _) => Some((dims.clone(), flat.dtype())),
                (None, Some(&dtype)) => Some((self.dims[&id].clone(), dtype)),
                (None, None) => None,
            };
            if let Some((dims, dtype)) = written {
                let slot = state.slots[&id];
                writes[slot.bucket].push(WriteBack {
                    id,
                    dims,
                    dtype,
                    slot,
                });
            }
        }
        writes
    }

    /// After the first step, once the hooked parameters are known, lays the buckets out
    /// again with them apart from the others: those only arrive at `finish`, and would hold
    /// back any bucket they shared. (A distributed optimizer's plan fixes its buckets.)
    fn relayout_hooked_first(&self, state: &mut State) {
        if state.relaid || state.hooked.is_empty() || self.shared.plan.is_some() {
            return;
        }
        let (hooked, rest): (Vec<_>, Vec<_>) = sized(&self.order, &self.dims)
            .into_iter()
            .partition(|(id, _)| state.hooked.contains(id));
        let mut relaid = State::default();
        add_buckets(&hooked, self.bucket_size, &mut relaid);
        add_buckets(&rest, self.bucket_size, &mut relaid);
        (state.slots, state.buckets, state.relaid) = (relaid.slots, relaid.buckets, true);
    }

    /// Bucket `b` (of `len` elements) as reduced, whole: a reduce-scattered bucket holds its
    /// owned elements reduced and zeros elsewhere (see `ShardPlan`).
    fn full_bucket(&self, b: usize, len: usize, result: Reduced) -> Tensor<1> {
        let device = &self.shared.device;
        let values = result.into_tensor(device);
        let Some(plan) = self
            .shared
            .plan
            .as_ref()
            .filter(|_| self.shared.scattered(b))
        else {
            return values;
        };
        let range = plan.shard_range(b);
        let zeros = |n: usize| Tensor::<1>::zeros([n], (device, DType::F32));
        let mut pieces = Vec::with_capacity(3);
        if range.start > 0 {
            pieces.push(zeros(range.start));
        }
        pieces.push(values);
        if len > range.end {
            pieces.push(zeros(len - range.end));
        }
        Tensor::cat(pieces, 0)
    }

    /// What went wrong in a step whose gradients missed the reduction, naming the first
    /// such parameter in module order.
    fn missed_reason(
        &self,
        missed: &HashMap<ParamId, (usize, usize)>,
        activations: usize,
    ) -> Option<String> {
        let mut params = self
            .order
            .iter()
            .filter_map(|(id, _)| Some((id, missed.get(id)?)));
        let (id, &(inactive, late)) = params.next()?;
        let others = match params.count() {
            0 => String::new(),
            n => format!(" (and {n} more parameters)"),
        };
        let name = self.names.get(id).map_or("?", String::as_str);
        Some(if inactive > 0 {
            format!(
                "parameter {name} received {inactive} gradient(s) while the reducer was inactive{others}, \
                 which the reduction would have dropped ({activations} micro-batch(es) activated \
                 this step): activate the reducer around every micro-batch's forward and \
                 backward, with `last` only on the step's last"
            )
        } else {
            format!(
                "parameter {name} received {late} gradient(s) after its bucket was handed to the \
                 reduction{others}, which would have dropped them: activate with `last` only \
                 from the step's last micro-batch on"
            )
        })
    }

    fn invalid(&self, reason: &str) -> CommError {
        CommError::InvalidArgument {
            group: self.shared.comm.group().to_string(),
            op: "overlapped gradient reduction",
            reason: reason.into(),
        }
    }

    #[cfg(test)]
    pub(crate) fn events(&self) -> Vec<Event> {
        self.shared.lock().events.clone()
    }

    /// Waits for the worker to end, bounded: an error once it has finished no bucket for
    /// the communicator's timeout (each of its collectives is bounded by that, but a
    /// communicator may not keep its bound). The worker is then closed and left behind.
    fn join_worker(&self, worker: JoinHandle<()>) -> Result<(), CommError> {
        let timeout = self.shared.comm.timeout();
        let reduced = |s: &State| s.buckets.iter().filter(|b| b.result.is_some()).count();
        let mut state = self.shared.lock();
        let mut seen = reduced(&state);
        let mut deadline = Deadline::from_now(timeout);
        while !worker.is_finished() {
            let now = std::time::Instant::now();
            if reduced(&state) > seen {
                seen = reduced(&state);
                deadline = Deadline::from_now(timeout);
            } else if deadline.passed(now) {
                state.closed = true;
                self.shared.ready.notify_all();
                return Err(self.invalid(&format!(
                    "the reduction worker finished no bucket within {timeout:?}; it is left \
                     behind"
                )));
            }
            // Its last notice comes just before it ends, so look again shortly after.
            let nap = deadline.left(now).min(std::time::Duration::from_millis(5));
            state = self
                .shared
                .ready
                .wait_timeout(state, nap)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(state);
        worker
            .join()
            .map_err(|_| self.invalid("the reduction worker panicked"))
    }
}

impl GradSync for OverlapReducer {
    fn enter(&self, last: bool) -> Box<dyn std::any::Any> {
        Box::new(self.activate(last))
    }
}

impl Drop for OverlapReducer {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

/// The module path of each float parameter of `module`.
fn param_names<M: Module>(module: &M) -> HashMap<ParamId, String> {
    struct Names(HashMap<ParamId, String>);
    impl PathVisitor for Names {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            self.0.insert(p.id, path.to_string());
        }
    }
    let mut names = Names(HashMap::new());
    visit_paths(module, &mut names);
    names.0
}

/// `(id, element count)` of each of `order`'s parameters, looked up by id: the dense
/// parameters are not all of the module's (experts are left out).
fn sized(order: &[(ParamId, usize)], dims: &HashMap<ParamId, Vec<usize>>) -> Vec<(ParamId, usize)> {
    order
        .iter()
        .map(|&(id, _)| (id, dims[&id].iter().product()))
        .collect()
}

/// The dims of each float parameter of `module`.
fn param_dims<M: Module>(module: &M) -> HashMap<ParamId, Vec<usize>> {
    struct Dims(HashMap<ParamId, Vec<usize>>);
    impl burn::module::ModuleVisitor for Dims {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.insert(p.id, p.val().dims().to_vec());
        }
    }
    let mut d = Dims(HashMap::new());
    module.visit(&mut d);
    d.0
}
