//! The `mpi` backend: one process per rank, over MPI (the `mpi` crate, rsmpi).
//!
//! Data moves as bytes and reductions run on the host with the local backend's code, in
//! group order: an all-reduce is an all-to-all of chunks, each member folding its chunk over
//! the members in order, then an all-gather of the folded chunks (the bytes a ring moves).
//! So results are bit-identical to a threaded run of the same layout, and the same on every
//! rank, for every dtype (halves folded in f32 and rounded once).
//!
//! MPI calls have no deadline, so every call here is non-blocking and polled against the
//! communicator's timeout. Before each collective the members swap a small header (op, dtype,
//! count, reduction, root, call number) point to point: a mismatch is an error on every
//! member, as in the local backend, and a rank that never arrives is named. A timeout cannot
//! be recovered from (a started MPI collective cannot be cancelled), so it is printed, naming
//! the group, the op and the missing ranks, and the job ends with `MPI_Abort`. A rank that
//! finishes tells every other one (a one-byte notice on a communicator of its own), so a
//! call still waiting for it ends the job within a short grace period instead of at the
//! timeout. `MPI_Comm_create_group` has no deadline either, so the members of a new group
//! first meet point to point, against the timeout: the blocking creation starts only once
//! every member is known to be starting it too.

mod communicator;

pub use communicator::MpiCommunicator;

use super::group::{CommError, ProcessGroup};
use super::{Comm, World, lock};
use mpi::environment::Universe;
use mpi::request::{Request, Scope, scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
/// The exit status of a job this backend aborts.
pub const ABORT_CODE: i32 = 3;

/// MPI handles are raw pointers in Open MPI. SAFETY: MPI is initialised with
/// `MPI_THREAD_MULTIPLE` (checked by [`MpiWorld::init`]), so any thread may call it; calls on
/// one communicator are serialised by its locks, as MPI requires of collectives.
pub(crate) struct Raw<T>(pub(crate) T);
unsafe impl<T> Send for Raw<T> {}
unsafe impl<T> Sync for Raw<T> {}

pub(crate) struct Inner {
    world: Raw<SimpleCommunicator>,
    /// A duplicate of the world for exit notices, so they never meet other traffic. Freed
    /// at drop unless MPI is finalised by then (freeing it after is an error).
    control: std::mem::ManuallyDrop<Raw<SimpleCommunicator>>,
    /// Global ranks whose notice arrived.
    exited: Mutex<Vec<bool>>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Dropping it is MPI_Finalize: at [`MpiWorld::finalize`], or once the world and every
    /// communicator (they hold this) are gone.
    universe: Mutex<Option<Raw<Universe>>>,
}

impl Inner {
    pub(crate) fn fatal(&self, reason: &dyn std::fmt::Display) -> ! {
        crate::comm::last_words(format_args!(
            "burn-megatron: global rank {}: {reason}; aborting the MPI job",
            self.rank
        ));
        self.world.0.abort(ABORT_CODE)
    }

    /// Takes in the exit notices that have arrived.
    fn poll_exits(&self) {
        let any = self.control.0.any_process();
        while let Some((message, status)) = any.immediate_matched_probe_with_tag(EXIT_TAG) {
            let mut byte = [0u8; 1];
            // Matched and one byte long: it is here, the receive completes at once.
            message.matched_receive_into(&mut byte[..]);
            if let Some(e) = lock(&self.exited).get_mut(status.source_rank() as usize) {
                *e = true;
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !mpi::environment::is_finalized() {
            // SAFETY: dropped once, here, before the universe (MPI_Finalize) after it.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.control) };
        }
    }
}

const EXIT_TAG: i32 = 9;

/// How long a call may still wait for a rank that has exited: what it needed may already be
/// on its way (the rank finished its part before it left).
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// What a waiting loop checks on every turn: its deadline, and whether a rank it waits for
/// has exited. Either ends the job, naming the group, the op and the ranks.
pub(crate) struct Watch<'a> {
    inner: &'a Inner,
    group: &'a str,
    op: &'static str,
    seq: u64,
    start: Instant,
    timeout: Duration,
    exit_seen: Option<Instant>,
    backoff: Backoff,
}

impl<'a> Watch<'a> {
    /// A wait bounded by the world's timeout.
    pub(crate) fn new(inner: &'a Inner, group: &'a str, op: &'static str, seq: u64) -> Self {
        Self::within(inner, group, op, seq, inner.timeout)
    }

    /// A wait bounded by `timeout` (a checkpoint barrier's, say).
    pub(crate) fn within(
        inner: &'a Inner,
        group: &'a str,
        op: &'static str,
        seq: u64,
        timeout: Duration,
    ) -> Self {
        Self {
            inner,
            group,
            op,
            seq,
            start: Instant::now(),
            timeout,
            exit_seen: None,
            backoff: Backoff::default(),
        }
    }

    /// Tests `requests` (each with the global ranks it waits for) until every one has
    /// completed, running `between` at each turn that leaves some pending.
    pub(crate) fn complete<'r, D: ?Sized, S: Scope<'r>>(
        &mut self,
        mut requests: Vec<(Vec<usize>, Request<'r, D, S>)>,
        mut between: impl FnMut(),
    ) {
        loop {
            requests = requests
                .into_iter()
                .filter_map(|(who, r)| r.test().err().map(|r| (who, r)))
                .collect();
            if requests.is_empty() {
                return;
            }
            between();
            let mut awaited: Vec<usize> =
                requests.iter().flat_map(|(who, _)| who.clone()).collect();
            awaited.sort_unstable();
            awaited.dedup();
            self.turn(&awaited);
        }
    }

    /// One turn of waiting for the global ranks `awaited`.
    pub(crate) fn turn(&mut self, awaited: &[usize]) {
        if self.start.elapsed() >= self.timeout {
            self.inner.fatal(&CommError::Timeout {
                group: self.group.to_string(),
                op: self.op,
                seq: self.seq,
                waited: self.start.elapsed(),
                missing: awaited.to_vec(),
            });
        }
        self.inner.poll_exits();
        let gone = lock(&self.inner.exited);
        if let Some(&rank) = awaited.iter().find(|&&r| gone.get(r) == Some(&true)) {
            drop(gone);
            let seen = *self.exit_seen.get_or_insert_with(Instant::now);
            if seen.elapsed() >= EXIT_GRACE {
                self.inner.fatal(&CommError::PeerExited {
                    group: self.group.to_string(),
                    op: self.op,
                    rank,
                });
            }
        }
        self.backoff.snooze();
    }
}

/// This process's place in an MPI job: makes one communicator per group.
///
/// ```no_run
/// use burn_megatron::comm::mpi::MpiWorld;
/// use burn_megatron::comm::{CommunicatorExt, ReduceOp, World};
/// // Under `mpirun -np 2`:
/// let world = MpiWorld::init(std::time::Duration::from_secs(60)).unwrap();
/// let all = world.new_group("world", vec![0, 1], world.rank()).unwrap();
/// let mut v = vec![world.rank() as i64];
/// all.all_reduce_vec(&mut v, ReduceOp::Sum).unwrap();
/// assert_eq!(v, vec![1]);
/// ```
#[derive(Clone)]
pub struct MpiWorld {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiWorld")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("timeout", &self.inner.timeout)
            .finish()
    }
}

fn setup_error(reason: impl Into<String>) -> CommError {
    CommError::InvalidArgument {
        group: "MPI_COMM_WORLD".into(),
        op: "init",
        reason: reason.into(),
    }
}

impl MpiWorld {
    /// Initialises MPI for this process, with `MPI_THREAD_MULTIPLE` (overlapped gradient
    /// reductions call it from a worker thread). MPI is finalised when the world and every
    /// communicator made from it are dropped. Once per process.
    pub fn init(timeout: Duration) -> Result<Self, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| setup_error("MPI is already initialised in this process"))?;
        if threading != mpi::Threading::Multiple {
            return Err(setup_error(format!(
                "the MPI library provides {threading:?} threading; burn-megatron needs \
                 MPI_THREAD_MULTIPLE"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let control = world.duplicate();
        Ok(Self {
            inner: Arc::new(Inner {
                world: Raw(world),
                control: std::mem::ManuallyDrop::new(Raw(control)),
                exited: Mutex::new(vec![false; size]),
                rank,
                size,
                timeout,
                universe: Mutex::new(Some(Raw(universe))),
            }),
        })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Ends this process's part in the job: a bounded barrier (so nobody waits in
    /// `MPI_Finalize` for a rank that is still working), then `MPI_Finalize`. Communicators
    /// still alive afterwards (a model kept by the caller) must not be used again; dropping
    /// them is harmless. Called by [`from_env`](crate::launch::from_env) once the closure
    /// returns.
    pub fn finalize(&self) {
        let inner = &self.inner;
        let others: Vec<usize> = (0..inner.size).filter(|&r| r != inner.rank).collect();
        let notice = [1u8];
        scope(|sc| {
            let sends: Vec<_> = others
                .iter()
                .map(|&r| {
                    let to = inner.control.0.process_at_rank(r as i32);
                    to.immediate_send_with_tag(sc, &notice[..], EXIT_TAG)
                })
                .collect();
            self.barrier();
            // Everyone is past the barrier, so every notice is sent; take them all in.
            let mut watch = Watch::new(inner, "world", "finalize", 0);
            loop {
                inner.poll_exits();
                let missing: Vec<usize> = {
                    let gone = lock(&inner.exited);
                    others.iter().copied().filter(|&r| !gone[r]).collect()
                };
                if missing.is_empty() {
                    break;
                }
                watch.turn(&missing);
            }
            for mut send in sends {
                loop {
                    match send.test() {
                        Ok(_) => break,
                        Err(r) => send = r,
                    }
                    watch.turn(&[]);
                }
            }
        });
        drop(lock(&inner.universe).take());
    }

    /// Prints `reason` with this rank and ends the whole job (`MPI_Abort`).
    pub fn abort(&self, reason: &dyn std::fmt::Display) -> ! {
        self.inner.fatal(reason)
    }

    /// Waits, at most the timeout, until every process of the job has called this: after
    /// it, every process takes part in what follows (group creation, which MPI cannot
    /// bound, comes after one). A straggler ends the job.
    pub fn barrier(&self) {
        let label = format!("'world' [0..{}]", self.inner.size);
        let mut watch = Watch::new(&self.inner, &label, "barrier", 0);
        let mut request = self.inner.world.0.immediate_barrier();
        loop {
            match request.test() {
                Ok(_) => return,
                Err(r) => request = r,
            }
            // Who is late is unknown; an exit is not waited for here (finishing ranks meet
            // in this barrier).
            watch.turn(&[]);
        }
    }
}

impl World for MpiWorld {
    fn size(&self) -> usize {
        self.inner.size
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// `MPI_Comm_create_group` over `ranks`, in group order: collective over the members
    /// only, after they have met within the timeout (see the [module docs](self)).
    fn new_group(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<Comm, CommError> {
        let group = ProcessGroup::of_process(
            name,
            ranks,
            global_rank,
            (self.inner.rank, self.inner.size),
            "MPI",
        )?;
        let invalid = |reason: String| CommError::InvalidArgument {
            group: group.to_string(),
            op: "new_group",
            reason,
        };
        let members: Vec<i32> = group.ranks().iter().map(|&r| r as i32).collect();
        let world = &self.inner.world.0;
        let subgroup = world.group().include(&members);
        // The tag only tells apart creations running at once in one process.
        let tag = name
            .bytes()
            .fold(7i32, |h, b| (h * 31 + i32::from(b)) & 0x3fff);
        self.meet(&group, tag)?;
        let comm = world
            .split_by_subgroup_with_tag(&subgroup, tag)
            .ok_or_else(|| invalid("MPI_Comm_create_group gave no communicator".into()))?;
        Ok(Arc::new(MpiCommunicator::new(
            comm,
            group,
            self.inner.clone(),
        )))
    }
}

impl MpiWorld {
    /// Waits, at most the timeout, until every member of `group` is creating it: each sends
    /// every other a digest of the group's name and ranks on the world communicator (tag
    /// `0x4000 | tag`; MPI keeps messages of one sender and tag in order, and members
    /// create their shared groups in the same order), and receives theirs. A member missing
    /// at the deadline ends the job, naming it; one creating another group is a mismatch.
    fn meet(&self, group: &ProcessGroup, tag: i32) -> Result<(), CommError> {
        let inner = &self.inner;
        let me = inner.rank;
        let digest = |name: &str, ranks: &[usize]| -> i64 {
            let mut h = std::hash::DefaultHasher::new();
            std::hash::Hash::hash(&(name, ranks), &mut h);
            std::hash::Hasher::finish(&h) as i64
        };
        let mine = [digest(group.name(), group.ranks())];
        let mut theirs = vec![mine; group.size()];
        let label = group.to_string();
        scope(|sc| {
            let mut requests = Vec::new();
            for (i, slot) in theirs.iter_mut().enumerate() {
                let r = group.global_rank_of(i);
                if r == me {
                    continue;
                }
                let peer = inner.world.0.process_at_rank(r as i32);
                requests.push((
                    vec![r],
                    peer.immediate_receive_into_with_tag(sc, &mut slot[..], 0x4000 | tag),
                ));
                requests.push((
                    vec![r],
                    peer.immediate_send_with_tag(sc, &mine[..], 0x4000 | tag),
                ));
            }
            Watch::new(inner, &label, "new_group", 0).complete(requests, || {});
        });
        match theirs.iter().position(|d| *d != mine) {
            None => Ok(()),
            Some(i) => Err(CommError::Mismatch {
                group: label,
                seq: 0,
                detail: format!(
                    "global rank {} is creating another group than {} at this point (members \
                     must create their shared groups in the same order)",
                    group.global_rank_of(i),
                    group
                ),
            }),
        }
    }
}

/// Polling with backing off: spins briefly, then sleeps up to 1 ms so that oversubscribed
/// ranks (4 processes on 2 cores) leave the cores to the ones with work.
#[derive(Default)]
pub(crate) struct Backoff(u32);

impl Backoff {
    pub(crate) fn snooze(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let us = ((self.0 - 63) / 16).clamp(1, 50);
            std::thread::sleep(Duration::from_micros(u64::from(us)));
        }
    }
}
