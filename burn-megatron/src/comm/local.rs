//! The `local` backend: ranks are threads of this process and exchange data through
//! shared memory. Waiting ranks sleep on a condition variable (no spinning).
//!
//! Every group has a table of in-flight collectives keyed by the call's sequence number on
//! that group; a call is complete once each member has contributed. A rank whose arguments
//! differ from the others poisons the group, so every member reports the mismatch. Reductions
//! are split into one chunk per member, each member reducing its own chunk, so the work of a
//! large all-reduce is spread over the ranks' threads as a ring would spread it over GPUs.

use super::buffer::Buffer;
use super::group::{CommError, OpDesc, ProcessGroup};
use super::reduce::{ReduceOp, chunk_range, reduce_range, reduce_range_into};
use super::{Communicator, DEFAULT_TIMEOUT, lock};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The shared state of all ranks of one world of threads. Cheap to clone; give each rank
/// thread a clone and let it create its [`LocalCommunicator`]s.
///
/// ```
/// use burn_megatron::comm::{Buffer, Communicator, LocalWorld, ReduceOp};
/// let world = LocalWorld::new(2);
/// let handles: Vec<_> = (0..2)
///     .map(|rank| {
///         let world = world.clone();
///         std::thread::spawn(move || {
///             let comm = world.communicator("dp", vec![0, 1], rank).unwrap();
///             let mut buf = Buffer::from(vec![rank as f32 + 1.0]);
///             comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
///             buf
///         })
///     })
///     .collect();
/// for h in handles {
///     assert_eq!(h.join().unwrap(), Buffer::from(vec![3.0f32]));
/// }
/// ```
#[derive(Clone, Debug)]
pub struct LocalWorld {
    inner: Arc<WorldInner>,
}

/// A group is identified by its name and its members in order.
type GroupKey = (String, Vec<usize>);

/// Every member's contribution to one call, in group order.
type Inputs = Vec<Option<Arc<Buffer>>>;

#[derive(Debug)]
struct WorldInner {
    size: usize,
    timeout: Duration,
    groups: Mutex<HashMap<GroupKey, Arc<GroupShared>>>,
    failure: Mutex<Option<(usize, String)>>,
    exited: Mutex<Vec<bool>>,
}

#[derive(Debug)]
struct GroupShared {
    world: Arc<WorldInner>,
    label: String,
    ranks: Vec<usize>,
    state: Mutex<GroupState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GroupState {
    slots: HashMap<u64, Slot>,
    poisoned: Option<CommError>,
    /// Point-to-point messages keyed by (source index, destination index), FIFO per pair.
    mailboxes: HashMap<(usize, usize), VecDeque<Buffer>>,
}

#[derive(Debug)]
struct Slot {
    descs: Vec<Option<OpDesc>>,
    inputs: Vec<Option<Arc<Buffer>>>,
    arrived: usize,
    partials: Vec<Option<Arc<Buffer>>>,
    partials_in: usize,
    finished: usize,
}

impl Slot {
    fn new(n: usize) -> Self {
        Self {
            descs: vec![None; n],
            inputs: vec![None; n],
            arrived: 0,
            partials: vec![None; n],
            partials_in: 0,
            finished: 0,
        }
    }
}

impl LocalWorld {
    /// A world of `size` ranks with the default timeout (300 s).
    pub fn new(size: usize) -> Self {
        Self::with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// A world of `size` ranks whose every call gives up after `timeout`.
    pub fn with_timeout(size: usize, timeout: Duration) -> Self {
        Self {
            inner: Arc::new(WorldInner {
                size,
                timeout,
                groups: Mutex::new(HashMap::new()),
                failure: Mutex::new(None),
                exited: Mutex::new(vec![false; size]),
            }),
        }
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The timeout every call is bounded by.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// This rank's communicator on the group `name` over global `ranks`. Every member must
    /// use the same name and rank order; groups with another name never share traffic.
    pub fn communicator(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<LocalCommunicator, CommError> {
        let group = ProcessGroup::new(name, ranks, global_rank)?;
        if let Some(&bad) = group.ranks().iter().find(|&&r| r >= self.inner.size) {
            return Err(CommError::InvalidArgument {
                group: group.to_string(),
                op: "new_group",
                reason: format!("rank {bad} is outside the world of {}", self.inner.size),
            });
        }
        let key = (name.to_string(), group.ranks().to_vec());
        let shared = lock(&self.inner.groups)
            .entry(key)
            .or_insert_with(|| {
                Arc::new(GroupShared {
                    world: self.inner.clone(),
                    label: group.to_string(),
                    ranks: group.ranks().to_vec(),
                    state: Mutex::new(GroupState::default()),
                    changed: Condvar::new(),
                })
            })
            .clone();
        Ok(LocalCommunicator {
            group,
            shared,
            seq: AtomicU64::new(0),
            spare: Mutex::new(None),
        })
    }

    /// Records that `rank` failed: every pending and later call on any group fails promptly
    /// with [`CommError::PeerFailed`] naming it. The first failure recorded is kept.
    pub fn abort(&self, rank: usize, reason: impl Into<String>) {
        {
            let mut failure = lock(&self.inner.failure);
            if failure.is_none() {
                *failure = Some((rank, reason.into()));
            }
        }
        self.wake_all();
    }

    /// The first failure recorded by [`abort`](Self::abort), if any.
    pub fn failure(&self) -> Option<(usize, String)> {
        lock(&self.inner.failure).clone()
    }

    /// Records that `rank` finished its work: calls still waiting for it fail with
    /// [`CommError::PeerExited`] instead of waiting for the timeout.
    pub fn mark_exited(&self, rank: usize) {
        if let Some(e) = lock(&self.inner.exited).get_mut(rank) {
            *e = true;
        }
        self.wake_all();
    }

    fn wake_all(&self) {
        let groups: Vec<_> = lock(&self.inner.groups).values().cloned().collect();
        for g in groups {
            // Taking the lock orders this wake-up after any waiter's last check.
            let _guard = lock(&g.state);
            g.changed.notify_all();
        }
    }
}

/// One rank's handle on one group of a [`LocalWorld`].
#[derive(Debug)]
pub struct LocalCommunicator {
    group: ProcessGroup,
    shared: Arc<GroupShared>,
    seq: AtomicU64,
    /// The reduced chunk this member published at its last all-reduce. Every member has
    /// copied it once the next collective of the group has gathered them all, so it comes
    /// back unshared then: its pages are reused instead of faulted in afresh.
    spare: Mutex<Option<Arc<Buffer>>>,
}

impl LocalCommunicator {
    /// Waits until `ready` holds, failing on poison, peer failure, peer exit or timeout.
    /// `missing` lists the group indices still awaited (for error messages).
    fn wait<'a>(
        &'a self,
        mut state: MutexGuard<'a, GroupState>,
        op: &'static str,
        seq: u64,
        start: Instant,
        ready: impl Fn(&GroupState) -> bool,
        missing: impl Fn(&GroupState) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, GroupState>, CommError> {
        let world = &self.shared.world;
        let deadline = start + world.timeout;
        loop {
            if let Some(e) = &state.poisoned {
                return Err(e.clone());
            }
            if ready(&state) {
                return Ok(state);
            }
            if let Some((rank, reason)) = lock(&world.failure).clone() {
                return Err(CommError::PeerFailed {
                    group: self.shared.label.clone(),
                    op,
                    rank,
                    reason,
                });
            }
            let missing_global: Vec<usize> = missing(&state)
                .into_iter()
                .map(|i| self.shared.ranks[i])
                .collect();
            let exited = lock(&world.exited);
            if let Some(&rank) = missing_global.iter().find(|&&r| exited[r]) {
                return Err(CommError::PeerExited {
                    group: self.shared.label.clone(),
                    op,
                    rank,
                });
            }
            drop(exited);
            let now = Instant::now();
            if now >= deadline {
                let err = CommError::Timeout {
                    group: self.shared.label.clone(),
                    op,
                    seq,
                    waited: now - start,
                    missing: missing_global,
                };
                state.poisoned = Some(err.clone());
                self.shared.changed.notify_all();
                return Err(err);
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Contributes `desc` and `input` to call `seq` and waits until every member has.
    /// Returns every member's input, in group order.
    fn arrive(&self, desc: OpDesc, input: Option<Buffer>) -> Result<(u64, Inputs), CommError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let me = self.group.rank();
        let n = self.group.size();
        let start = Instant::now();
        let mut state = lock(&self.shared.state);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let slot = state.slots.entry(seq).or_insert_with(|| Slot::new(n));
        if slot.descs.iter().flatten().any(|d| *d != desc) {
            slot.descs[me] = Some(desc);
            let detail = slot
                .descs
                .iter()
                .enumerate()
                .filter_map(|(i, d)| {
                    d.as_ref()
                        .map(|d| format!("global rank {}: {d}", self.shared.ranks[i]))
                })
                .collect::<Vec<_>>()
                .join("; ");
            let err = CommError::Mismatch {
                group: self.shared.label.clone(),
                seq,
                detail,
            };
            state.poisoned = Some(err.clone());
            self.shared.changed.notify_all();
            return Err(err);
        }
        slot.descs[me] = Some(desc.clone());
        slot.inputs[me] = input.map(Arc::new);
        slot.arrived += 1;
        if slot.arrived == n {
            self.shared.changed.notify_all();
        }
        let state = self.wait(
            state,
            desc.op,
            seq,
            start,
            |s| s.slots.get(&seq).is_some_and(|sl| sl.arrived == n),
            |s| missing_members(s.slots.get(&seq).map(|sl| &sl.descs), n),
        )?;
        let inputs = state.slots[&seq].inputs.clone();
        Ok((seq, inputs))
    }

    /// Marks this member done with call `seq`; the last one frees the slot.
    fn finish(&self, seq: u64) {
        let mut state = lock(&self.shared.state);
        let n = self.group.size();
        if let Some(slot) = state.slots.get_mut(&seq) {
            slot.finished += 1;
            if slot.finished == n {
                state.slots.remove(&seq);
            }
        }
    }
}

fn missing_members(descs: Option<&Vec<Option<OpDesc>>>, n: usize) -> Vec<usize> {
    match descs {
        Some(d) => (0..n).filter(|&i| d[i].is_none()).collect(),
        None => (0..n).collect(),
    }
}

fn present(inputs: &[Option<Arc<Buffer>>]) -> Vec<&Buffer> {
    inputs.iter().flatten().map(|b| b.as_ref()).collect()
}

impl Communicator for LocalCommunicator {
    fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn timeout(&self) -> Duration {
        self.shared.world.timeout
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError> {
        let n = self.group.size();
        let me = self.group.rank();
        let dtype = buf.dtype();
        let len = buf.len();
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("all_reduce", buf)
        };
        // The caller's buffer is overwritten anyway: move it in rather than copy it.
        let input = std::mem::replace(buf, Buffer::with_capacity(dtype, 0));
        let (seq, inputs) = self.arrive(desc, Some(input))?;
        let spare = lock(&self.spare).take();
        let mut mine = spare
            .and_then(|b| Arc::try_unwrap(b).ok())
            .unwrap_or_else(|| Buffer::with_capacity(dtype, 0));
        reduce_range_into(&present(&inputs), chunk_range(len, n, me), op, &mut mine);
        drop(inputs);
        let mine = Arc::new(mine);
        *lock(&self.spare) = Some(mine.clone());
        let start = Instant::now();
        let mut state = lock(&self.shared.state);
        if let Some(slot) = state.slots.get_mut(&seq) {
            slot.partials[me] = Some(mine);
            slot.partials_in += 1;
            if slot.partials_in == n {
                self.shared.changed.notify_all();
            }
        }
        let state = self.wait(
            state,
            "all_reduce",
            seq,
            start,
            |s| s.slots.get(&seq).is_some_and(|sl| sl.partials_in == n),
            |s| match s.slots.get(&seq) {
                Some(sl) => (0..n).filter(|&i| sl.partials[i].is_none()).collect(),
                None => Vec::new(),
            },
        )?;
        let mut state = state;
        let slot = state
            .slots
            .get_mut(&seq)
            .expect("slot lives until every member finished");
        let partials: Vec<Arc<Buffer>> = slot.partials.iter().flatten().cloned().collect();
        // Every member has reduced its chunk, so nobody reads the inputs any more: reuse
        // this member's input allocation for the result (no fresh pages to fault in).
        let own = slot.inputs[me].take().and_then(|b| Arc::try_unwrap(b).ok());
        drop(state);
        self.finish(seq);
        *buf = match own {
            Some(mut out) if out.len() == len => {
                let mut at = 0;
                for p in &partials {
                    out.write_at(at, p);
                    at += p.len();
                }
                out
            }
            _ => Buffer::concat(dtype, partials.iter().map(|p| p.as_ref())),
        };
        Ok(())
    }

    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError> {
        let mut out = Buffer::with_capacity(input.dtype(), 0);
        self.all_gather_into(input, &mut out)?;
        Ok(out)
    }

    fn all_gather_into(&self, input: Buffer, out: &mut Buffer) -> Result<(), CommError> {
        let dtype = input.dtype();
        let (seq, inputs) = self.arrive(OpDesc::data("all_gather", &input), Some(input))?;
        self.finish(seq);
        out.assign_concat(dtype, present(&inputs));
        Ok(())
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CommError> {
        let chunk = OpDesc::even_split(&self.group, "reduce_scatter", input.len())?;
        let me = self.group.rank();
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("reduce_scatter", &input)
        };
        let (seq, inputs) = self.arrive(desc, Some(input))?;
        self.finish(seq);
        Ok(reduce_range(
            &present(&inputs),
            me * chunk..(me + 1) * chunk,
            op,
        ))
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError> {
        self.group.check_peer("broadcast", root)?;
        let desc = OpDesc {
            root: Some(root),
            ..OpDesc::data("broadcast", buf)
        };
        let me = self.group.rank();
        let input = (me == root).then(|| buf.clone());
        let (seq, inputs) = self.arrive(desc, input)?;
        self.finish(seq);
        if me != root
            && let Some(data) = &inputs[root]
        {
            *buf = data.as_ref().clone();
        }
        Ok(())
    }

    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError> {
        self.group.check_peer("send", peer)?;
        let mut state = lock(&self.shared.state);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        state
            .mailboxes
            .entry((self.group.rank(), peer))
            .or_default()
            .push_back(buf);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError> {
        self.group.check_peer("recv", peer)?;
        let key = (peer, self.group.rank());
        let state = lock(&self.shared.state);
        let mut state = self.wait(
            state,
            "recv",
            0,
            Instant::now(),
            |s| s.mailboxes.get(&key).is_some_and(|q| !q.is_empty()),
            |_| vec![peer],
        )?;
        let msg = state
            .mailboxes
            .get_mut(&key)
            .and_then(|q| q.pop_front())
            .expect("wait returned with a message queued");
        if msg.dtype() != buf.dtype() || msg.len() != buf.len() {
            let err = CommError::Mismatch {
                group: self.shared.label.clone(),
                seq: 0,
                detail: format!(
                    "global rank {} sent {} × {}, global rank {} expected {} × {}",
                    self.shared.ranks[peer],
                    msg.dtype(),
                    msg.len(),
                    self.group.global_rank(),
                    buf.dtype(),
                    buf.len()
                ),
            };
            state.poisoned = Some(err.clone());
            self.shared.changed.notify_all();
            return Err(err);
        }
        *buf = msg;
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let desc = OpDesc::BARRIER;
        let (seq, _) = self.arrive(desc, None)?;
        self.finish(seq);
        Ok(())
    }
}
