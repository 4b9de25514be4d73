//! The `local` backend: ranks are threads of this process and exchange data through
//! shared memory. A waiting rank polls for a change for a short while, then sleeps on a
//! condition variable.
//!
//! Every group has a table of in-flight collectives keyed by the call's sequence number on
//! that group; a call is complete once each member has contributed. A rank whose arguments
//! differ from the others poisons the group, so every member reports the mismatch. Large
//! collectives work on buffers the members lend each other for the call (`lend`): an
//! all-reduce is split into one chunk per member, each member folding its chunk of every
//! buffer in place, so the work is spread over the ranks' threads as a ring would spread
//! it over GPUs, and every element is read and written once.
//!
//! The lending protocol relies on each member of a group having one communicator: two
//! communicators for one member would lend into one slot and fold the same chunk. So a
//! member's communicator is claimed while it lives, a second one is refused, and a second
//! arrival of one member at a call poisons the group in case anything gets past the claim.

use super::buffer::Buffer;
use super::group::{CommError, OpDesc, ProcessGroup};
use super::lend::Lent;
use super::{DEFAULT_TIMEOUT, Deadline, lock};
use std::collections::{HashMap, VecDeque};
use std::mem::ManuallyDrop;
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
    /// Counts the changes notified on `changed`, so a waiter can watch for one without the
    /// lock.
    epoch: AtomicU64,
}

impl GroupShared {
    /// Wakes every waiter; called with `state` locked.
    fn notify(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
        self.changed.notify_all();
    }
}

/// How long a waiter polls for a change before it sleeps on the condition variable: a
/// collective's members arrive within microseconds of each other, and a thread put to
/// sleep takes tens of them to wake.
const SPIN: Duration = Duration::from_micros(100);

#[derive(Debug)]
struct GroupState {
    slots: HashMap<u64, Slot>,
    poisoned: Option<CommError>,
    /// Point-to-point messages keyed by (source index, destination index), FIFO per pair.
    mailboxes: HashMap<(usize, usize), VecDeque<Buffer>>,
    /// Per member: whether a live communicator holds it, and the number of its next call,
    /// kept when the communicator is dropped so that a new one carries on in step with the
    /// other members.
    members: Vec<Member>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Member {
    claimed: bool,
    next_seq: u64,
}

impl GroupState {
    fn new(n: usize) -> Self {
        Self {
            slots: HashMap::new(),
            poisoned: None,
            mailboxes: HashMap::new(),
            members: vec![Member::default(); n],
        }
    }
}

#[derive(Debug)]
struct Slot {
    descs: Vec<Option<OpDesc>>,
    inputs: Vec<Option<Arc<Buffer>>>,
    /// The buffers members lent for the call (see [`super::lend`]).
    lent: Vec<Option<Lent>>,
    arrived: usize,
    /// Which members are done with the lent buffers.
    released: Vec<bool>,
    finished: usize,
}

impl Slot {
    fn new(n: usize) -> Self {
        Self {
            descs: vec![None; n],
            inputs: vec![None; n],
            lent: vec![None; n],
            arrived: 0,
            released: vec![false; n],
            finished: 0,
        }
    }
}

impl LocalWorld {
    /// A world of `size` ranks with the default timeout (300 s).
    pub fn new(size: usize) -> Self {
        Self::with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// A world of `size` ranks whose every call gives up after `timeout`. A timeout too
    /// large for a deadline (`Duration::MAX`) means calls wait as long as it takes.
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
    ///
    /// A member has one communicator on a group at a time: while it lives, another for the
    /// same (name, ranks, `global_rank`) is refused with [`CommError::InvalidArgument`].
    /// Once it is dropped the member may create a new one, which carries on with the next
    /// call of the group's sequence (the dropped one's calls count).
    pub fn communicator(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<LocalCommunicator, CommError> {
        let mut comm = self.unclaimed(name, ranks, global_rank)?;
        let shared = comm.shared.clone();
        let mut state = lock(&shared.state);
        let member = &mut state.members[comm.group.rank()];
        if member.claimed {
            return Err(CommError::InvalidArgument {
                group: shared.label.clone(),
                op: "new_group",
                reason: format!(
                    "global rank {global_rank} already has a live communicator on this group; \
                     share it (`Comm` is an `Arc`) or drop it before creating another"
                ),
            });
        }
        member.claimed = true;
        *comm.seq.get_mut() = member.next_seq;
        comm.claimed = true;
        Ok(comm)
    }

    /// A communicator that holds no claim on its member (so dropping it releases none):
    /// [`communicator`](Self::communicator) claims it, tests bypass the claim to check the
    /// slots' own defence.
    fn unclaimed(
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
                    state: Mutex::new(GroupState::new(group.size())),
                    changed: Condvar::new(),
                    epoch: AtomicU64::new(0),
                })
            })
            .clone();
        Ok(LocalCommunicator {
            group,
            shared,
            seq: AtomicU64::new(0),
            claimed: false,
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
            g.notify();
        }
    }
}

/// One rank's handle on one group of a [`LocalWorld`]; its member is claimed until it is
/// dropped (see [`LocalWorld::communicator`]).
#[derive(Debug)]
pub struct LocalCommunicator {
    group: ProcessGroup,
    shared: Arc<GroupShared>,
    seq: AtomicU64,
    /// Whether this communicator holds its member's claim.
    claimed: bool,
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        if self.claimed {
            let mut state = lock(&self.shared.state);
            state.members[self.group.rank()] = Member {
                claimed: false,
                next_seq: *self.seq.get_mut(),
            };
        }
    }
}

/// Poisons the group if dropped, which [`LocalCommunicator::lend`] lets happen only when
/// the work panics with the buffer lent: the peers then fail at once instead of waiting
/// for a release that never comes.
struct PoisonOnUnwind<'a> {
    comm: &'a LocalCommunicator,
    op: &'static str,
}

impl Drop for PoisonOnUnwind<'_> {
    fn drop(&mut self) {
        let comm = self.comm;
        let mut state = lock(&comm.shared.state);
        state.poisoned.get_or_insert_with(|| CommError::PeerFailed {
            group: comm.shared.label.clone(),
            op: self.op,
            rank: comm.group.global_rank(),
            reason: "panicked during the call with its buffer lent to the group (the buffer \
                     is leaked)"
                .into(),
        });
        comm.shared.notify();
    }
}

impl LocalCommunicator {
    /// Waits until `ready` holds, failing on poison, peer failure, peer exit or once
    /// `timeout` has passed since `start`. `missing` lists the group indices still awaited
    /// (for error messages).
    #[allow(clippy::too_many_arguments)]
    fn wait<'a>(
        &'a self,
        mut state: MutexGuard<'a, GroupState>,
        op: &'static str,
        seq: u64,
        start: Instant,
        timeout: Duration,
        ready: impl Fn(&GroupState) -> bool,
        missing: impl Fn(&GroupState) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, GroupState>, CommError> {
        let world = &self.shared.world;
        let deadline = Deadline::after(start, timeout);
        let mut spun = false;
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
            if deadline.passed(now) {
                let err = CommError::Timeout {
                    group: self.shared.label.clone(),
                    op,
                    seq,
                    waited: now - start,
                    missing: missing_global,
                };
                state.poisoned = Some(err.clone());
                self.shared.notify();
                return Err(err);
            }
            if !spun {
                spun = true;
                let seen = self.shared.epoch.load(Ordering::Acquire);
                drop(state);
                let until = now + SPIN.min(deadline.left(now));
                while self.shared.epoch.load(Ordering::Acquire) == seen && Instant::now() < until {
                    std::thread::yield_now();
                }
                state = lock(&self.shared.state);
                // A change notified under the lock since `seen` is seen here; otherwise
                // the wait below is woken by the next one.
                if self.shared.epoch.load(Ordering::Acquire) != seen {
                    continue;
                }
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, deadline.left(Instant::now()))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Contributes `desc` and `input` to call `seq` and waits until every member has.
    /// Returns every member's input, in group order.
    fn arrive(&self, desc: OpDesc, input: Option<Buffer>) -> Result<(u64, Inputs), CommError> {
        self.arrive_with(desc, input, None, self.shared.world.timeout)
            .map(|(seq, inputs, _)| (seq, inputs))
    }

    /// [`Self::arrive`] lending `lent` too, waiting up to `timeout`; returns every member's
    /// lent buffer as well. [`Self::lend`] is the way to lend: it releases the call, and
    /// leaks the buffer if either fails.
    fn arrive_with(
        &self,
        desc: OpDesc,
        input: Option<Buffer>,
        lent: Option<Lent>,
        timeout: Duration,
    ) -> Result<(u64, Inputs, Vec<Lent>), CommError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let me = self.group.rank();
        let n = self.group.size();
        let start = Instant::now();
        let mut state = lock(&self.shared.state);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let slot = state.slots.entry(seq).or_insert_with(|| Slot::new(n));
        if slot.descs[me].is_some() {
            // Only two communicators for one member get here, which the claim prevents;
            // lending twice into one place would let two threads write one chunk.
            let err = CommError::Mismatch {
                group: self.shared.label.clone(),
                seq,
                detail: format!(
                    "global rank {} arrived twice (two communicators for one member)",
                    self.group.global_rank()
                ),
            };
            state.poisoned = Some(err.clone());
            self.shared.notify();
            return Err(err);
        }
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
            self.shared.notify();
            return Err(err);
        }
        slot.descs[me] = Some(desc.clone());
        slot.inputs[me] = input.map(Arc::new);
        slot.lent[me] = lent;
        slot.arrived += 1;
        if slot.arrived == n {
            self.shared.notify();
        }
        let state = self.wait(
            state,
            desc.op,
            seq,
            start,
            timeout,
            |s| s.slots.get(&seq).is_some_and(|sl| sl.arrived == n),
            |s| missing_members(s.slots.get(&seq).map(|sl| &sl.descs), n),
        )?;
        let slot = &state.slots[&seq];
        let lent = slot.lent.iter().flatten().copied().collect();
        Ok((seq, slot.inputs.clone(), lent))
    }

    /// Lends `buf` for the collective `desc`: once every member has arrived, `work` runs
    /// on every member's lent buffer (in group order), then this member waits until all
    /// have released the call and hands `buf` back. After an error the buffer is leaked,
    /// since a peer may still be using it, and `buf` is left empty. If `work` panics the
    /// buffer is leaked too, and the group poisoned so that the peers fail promptly.
    fn lend(
        &self,
        desc: OpDesc,
        buf: &mut Buffer,
        work: impl FnOnce(&[Lent]),
    ) -> Result<(), CommError> {
        let op = desc.op;
        // Never dropped here, on an unwind either: only handed back once every member has
        // released the call.
        let mut owned = ManuallyDrop::new(std::mem::replace(
            buf,
            Buffer::with_capacity(buf.dtype(), 0),
        ));
        let lent = Lent::of(&mut owned);
        let unwinding = PoisonOnUnwind { comm: self, op };
        let done = self
            .arrive_with(desc, None, Some(lent), self.shared.world.timeout)
            .and_then(|(seq, _, lent)| {
                work(&lent);
                self.release(seq, op)
            });
        std::mem::forget(unwinding);
        done.map(|()| *buf = ManuallyDrop::into_inner(owned))
    }

    /// Reports this member done with the buffers lent for call `seq` and waits until every
    /// member is, so that none is still in use when its owner takes it back.
    fn release(&self, seq: u64, op: &'static str) -> Result<(), CommError> {
        let (me, n) = (self.group.rank(), self.group.size());
        let start = Instant::now();
        let mut state = lock(&self.shared.state);
        if let Some(slot) = state.slots.get_mut(&seq) {
            slot.released[me] = true;
            if slot.released.iter().all(|&r| r) {
                self.shared.notify();
            }
        }
        let state = self.wait(
            state,
            op,
            seq,
            start,
            self.shared.world.timeout,
            |s| {
                s.slots
                    .get(&seq)
                    .is_some_and(|sl| sl.released.iter().all(|&r| r))
            },
            |s| match s.slots.get(&seq) {
                Some(sl) => (0..n).filter(|&i| !sl.released[i]).collect(),
                None => Vec::new(),
            },
        )?;
        drop(state);
        self.finish(seq);
        Ok(())
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

mod communicator;
#[cfg(test)]
mod tests;
