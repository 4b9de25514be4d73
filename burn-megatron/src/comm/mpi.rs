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
//! the group, the op and the missing ranks, and the job ends with `MPI_Abort`.

use super::buffer::{Buffer, CommDType};
use super::group::{CommError, OpDesc, ProcessGroup};
use super::reduce::{ReduceOp, chunk_range, reduce_range};
use super::{Comm, Communicator, World};
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::request::{Request, Scope, scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const HEADER_TAG: i32 = 1;
const P2P_TAG: i32 = 2;
/// op, dtype, count, reduction, root, call number.
const HEADER: usize = 6;
/// The exit status of a job this backend aborts.
pub const ABORT_CODE: i32 = 3;

/// MPI handles are raw pointers in Open MPI. SAFETY: MPI is initialised with
/// `MPI_THREAD_MULTIPLE` (checked by [`MpiWorld::init`]), so any thread may call it; calls on
/// one communicator are serialised by its locks, as MPI requires of collectives.
struct Raw<T>(T);
unsafe impl<T> Send for Raw<T> {}
unsafe impl<T> Sync for Raw<T> {}

struct Inner {
    world: Raw<SimpleCommunicator>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Dropping it is MPI_Finalize: at [`MpiWorld::finalize`], or once the world and every
    /// communicator (they hold this) are gone.
    universe: Mutex<Option<Raw<Universe>>>,
}

impl Inner {
    fn fatal(&self, reason: &dyn std::fmt::Display) -> ! {
        eprintln!(
            "burn-megatron: global rank {}: {reason}; aborting the MPI job",
            self.rank
        );
        self.world.0.abort(ABORT_CODE)
    }
}

/// This process's place in an MPI job: makes one communicator per group.
///
/// ```no_run
/// use burn_megatron::comm::{CommunicatorExt, MpiWorld, ReduceOp, World};
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
        Ok(Self {
            inner: Arc::new(Inner {
                world: Raw(world),
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
        self.barrier();
        drop(lock(&self.inner.universe).take());
    }

    /// Prints `reason` with this rank and ends the whole job (`MPI_Abort`).
    pub fn abort(&self, reason: &dyn std::fmt::Display) -> ! {
        self.inner.fatal(reason)
    }

    /// Waits, at most the timeout, until every process of the job has called this: after
    /// it, every process takes part in what follows (group creation, which MPI cannot
    /// bound, comes after one). A straggler ends the job.
    pub fn barrier(&self) {
        let start = Instant::now();
        let mut request = self.inner.world.0.immediate_barrier();
        let mut backoff = Backoff::default();
        loop {
            match request.test() {
                Ok(_) => return,
                Err(r) => request = r,
            }
            if start.elapsed() >= self.inner.timeout {
                self.inner.fatal(&CommError::Timeout {
                    group: format!("'world' [0..{}]", self.inner.size),
                    op: "barrier",
                    seq: 0,
                    waited: start.elapsed(),
                    missing: (0..self.inner.size)
                        .filter(|&r| r != self.inner.rank)
                        .collect(),
                });
            }
            backoff.snooze();
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

    /// `MPI_Comm_create_group` over `ranks`, in group order: collective over the members only.
    fn new_group(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<Comm, CommError> {
        let group = ProcessGroup::new(name, ranks, global_rank)?;
        let invalid = |reason: String| CommError::InvalidArgument {
            group: group.to_string(),
            op: "new_group",
            reason,
        };
        if global_rank != self.inner.rank {
            return Err(invalid(format!(
                "this process is MPI rank {}, not {global_rank}",
                self.inner.rank
            )));
        }
        if let Some(&bad) = group.ranks().iter().find(|&&r| r >= self.inner.size) {
            return Err(invalid(format!(
                "rank {bad} is outside the MPI world of {}",
                self.inner.size
            )));
        }
        let members: Vec<i32> = group.ranks().iter().map(|&r| r as i32).collect();
        let world = &self.inner.world.0;
        let subgroup = world.group().include(&members);
        // The tag only tells apart creations running at once in one process.
        let tag = name
            .bytes()
            .fold(7i32, |h, b| (h * 31 + i32::from(b)) & 0x3fff);
        let comm = world
            .split_by_subgroup_with_tag(&subgroup, tag)
            .ok_or_else(|| invalid("MPI_Comm_create_group gave no communicator".into()))?;
        Ok(Arc::new(MpiCommunicator {
            comm: std::mem::ManuallyDrop::new(Raw(comm)),
            label: group.to_string(),
            group,
            ops: Mutex::new(OpState::default()),
            sends: Mutex::new(Vec::new()),
            world: self.inner.clone(),
        }))
    }
}

/// Polling with backing off: spins briefly, then sleeps up to 1 ms so that oversubscribed
/// ranks (4 processes on 2 cores) leave the cores to the ones with work.
#[derive(Default)]
struct Backoff(u32);

impl Backoff {
    fn snooze(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let us = (self.0 - 63).min(1000);
            std::thread::sleep(Duration::from_micros(u64::from(us)));
        }
    }
}

#[derive(Default)]
struct OpState {
    seq: u64,
    poisoned: Option<CommError>,
}

/// A message on its way out: MPI reads `header` and `payload` until the requests complete.
struct PendingSend {
    requests: Raw<[ffi::MPI_Request; 2]>,
    _header: Box<[i64; 2]>,
    _payload: Buffer,
    peer: usize,
}

/// One process's handle on one group of an [`MpiWorld`].
pub struct MpiCommunicator {
    /// Freed at drop unless MPI is finalised by then.
    comm: std::mem::ManuallyDrop<Raw<SimpleCommunicator>>,
    group: ProcessGroup,
    label: String,
    /// Held through each collective and receive.
    ops: Mutex<OpState>,
    sends: Mutex<Vec<PendingSend>>,
    world: Arc<Inner>,
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("group", &self.label)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const OPS: [&str; 5] = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
];
const DTYPES: [CommDType; 5] = [
    CommDType::F32,
    CommDType::F16,
    CommDType::BF16,
    CommDType::I32,
    CommDType::I64,
];
const REDUCTIONS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

fn code<T: PartialEq>(table: &[T], value: Option<&T>) -> i64 {
    value.map_or(-1, |v| {
        table.iter().position(|t| t == v).expect("in the table") as i64
    })
}

fn decode<T: Copy>(table: &[T], code: i64) -> Option<T> {
    usize::try_from(code)
        .ok()
        .and_then(|i| table.get(i).copied())
}

fn encode(desc: &OpDesc, seq: u64) -> [i64; HEADER] {
    [
        code(&OPS, Some(&desc.op)),
        code(&DTYPES, desc.dtype.as_ref()),
        desc.len as i64,
        code(&REDUCTIONS, desc.reduce.as_ref()),
        desc.root.map_or(-1, |r| r as i64),
        seq as i64,
    ]
}

fn describe(h: &[i64; HEADER]) -> String {
    let desc = OpDesc {
        op: decode(&OPS, h[0]).unwrap_or("?"),
        dtype: decode(&DTYPES, h[1]),
        len: h[2].max(0) as usize,
        reduce: decode(&REDUCTIONS, h[3]),
        root: usize::try_from(h[4]).ok(),
    };
    format!("{desc} as call #{}", h[5])
}

fn data_desc(op: &'static str, buf: &Buffer) -> OpDesc {
    OpDesc {
        op,
        dtype: Some(buf.dtype()),
        len: buf.len(),
        reduce: None,
        root: None,
    }
}

impl MpiCommunicator {
    fn invalid(&self, op: &'static str, reason: String) -> CommError {
        CommError::InvalidArgument {
            group: self.label.clone(),
            op,
            reason,
        }
    }

    fn others(&self) -> Vec<usize> {
        let me = self.group.global_rank();
        self.group
            .ranks()
            .iter()
            .copied()
            .filter(|&r| r != me)
            .collect()
    }

    /// MPI counts are `int`s.
    fn count(&self, op: &'static str, bytes: usize) -> Result<i32, CommError> {
        i32::try_from(bytes).map_err(|_| {
            self.invalid(
                op,
                format!("{bytes} bytes exceed MPI's count limit of 2^31 - 1; split the buffer"),
            )
        })
    }

    /// Polls `requests` (each with the global ranks it waits for) until all complete, or
    /// aborts the job at the deadline naming the ranks still awaited.
    fn wait<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        op: &'static str,
        seq: u64,
        start: Instant,
        mut requests: Vec<(Vec<usize>, Request<'a, D, S>)>,
    ) {
        let mut backoff = Backoff::default();
        loop {
            requests = requests
                .into_iter()
                .filter_map(|(who, r)| r.test().err().map(|r| (who, r)))
                .collect();
            if requests.is_empty() {
                return;
            }
            self.progress_sends();
            if start.elapsed() >= self.world.timeout {
                let mut missing: Vec<usize> =
                    requests.iter().flat_map(|(who, _)| who.clone()).collect();
                missing.sort_unstable();
                missing.dedup();
                self.world.fatal(&CommError::Timeout {
                    group: self.label.clone(),
                    op,
                    seq,
                    waited: start.elapsed(),
                    missing,
                });
            }
            backoff.snooze();
        }
    }

    /// Swaps headers with every other member and checks they all describe the same call.
    /// Also a barrier: it returns once every member has sent its header.
    fn agree(&self, state: &mut OpState, desc: OpDesc) -> Result<u64, CommError> {
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let seq = state.seq;
        state.seq += 1;
        let (n, me) = (self.group.size(), self.group.rank());
        if n == 1 {
            return Ok(seq);
        }
        let mine = encode(&desc, seq);
        let mut theirs = vec![[0i64; HEADER]; n];
        let start = Instant::now();
        let bytes_of = |h: &[i64; HEADER]| -> Vec<u8> { bytemuck::cast_slice(h).to_vec() };
        let out = bytes_of(&mine);
        let mut inbox: Vec<Vec<u8>> = vec![vec![0u8; HEADER * 8]; n];
        scope(|sc| {
            let mut requests = Vec::new();
            for (i, slot) in inbox.iter_mut().enumerate().filter(|(i, _)| *i != me) {
                let peer = self.comm.0.process_at_rank(i as i32);
                let who = vec![self.group.global_rank_of(i)];
                requests.push((
                    who.clone(),
                    peer.immediate_receive_into_with_tag(sc, &mut slot[..], HEADER_TAG),
                ));
                let send = self.comm.0.process_at_rank(i as i32);
                requests.push((who, send.immediate_send_with_tag(sc, &out[..], HEADER_TAG)));
            }
            self.wait(desc.op, seq, start, requests);
        });
        for (i, bytes) in inbox.iter().enumerate() {
            theirs[i] = if i == me {
                mine
            } else {
                bytemuck::pod_read_unaligned(bytes)
            };
        }
        if theirs.iter().any(|h| *h != mine) {
            let detail = theirs
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    format!(
                        "global rank {}: {}",
                        self.group.global_rank_of(i),
                        describe(h)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            let err = CommError::Mismatch {
                group: self.label.clone(),
                seq,
                detail,
            };
            state.poisoned = Some(err.clone());
            return Err(err);
        }
        Ok(seq)
    }

    /// Tests the sends still in flight and frees the finished ones.
    fn progress_sends(&self) {
        lock(&self.sends).retain_mut(|s| {
            s.requests.0.iter_mut().any(|r| {
                let mut done = 0;
                // SAFETY: a live request of this process; MPI_Test nulls it once complete
                // and accepts a null request as complete.
                unsafe { ffi::MPI_Test(r, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                done == 0
            })
        });
    }

    /// Ranges of the `n` chunks of `len` elements, in bytes: (counts, displacements).
    fn chunk_bytes(
        &self,
        op: &'static str,
        len: usize,
        size: usize,
    ) -> Result<(Vec<i32>, Vec<i32>), CommError> {
        let n = self.group.size();
        let mut counts = Vec::with_capacity(n);
        let mut displs = Vec::with_capacity(n);
        for j in 0..n {
            let r = chunk_range(len, n, j);
            counts.push(self.count(op, r.len() * size)?);
            displs.push(self.count(op, r.start * size)?);
        }
        Ok((counts, displs))
    }

    /// Member `i` gets chunk `i` of every member's `input`: `n` pieces of `m` elements each.
    fn all_to_all(
        &self,
        op: &'static str,
        seq: u64,
        input: &Buffer,
        m: usize,
    ) -> Result<Buffer, CommError> {
        let (n, size) = (self.group.size(), input.dtype().size());
        let (counts, displs) = self.chunk_bytes(op, input.len(), size)?;
        let mut pieces = Buffer::zeros(input.dtype(), m * n);
        let piece = self.count(op, m * size)?;
        self.count(op, m * n * size)?;
        let rcounts = vec![piece; n];
        let rdispls = (0..n as i32).map(|i| piece * i).collect::<Vec<_>>();
        let start = Instant::now();
        let send = Partition::new(input.bytes(), counts, displs);
        let mut recv = PartitionMut::new(pieces.bytes_mut(), rcounts, rdispls);
        scope(|sc| {
            let r = self
                .comm
                .0
                .immediate_all_to_all_varcount_into(sc, &send, &mut recv);
            self.wait(op, seq, start, vec![(self.others(), r)]);
        });
        Ok(pieces)
    }

    /// Folds member `i`'s piece (elements `[i·m, (i+1)·m)` of `pieces`) in member order.
    fn fold(&self, pieces: &Buffer, m: usize, op: ReduceOp) -> Buffer {
        let parts: Vec<Buffer> = (0..self.group.size())
            .map(|i| pieces.slice(i * m..(i + 1) * m))
            .collect();
        reduce_range(&parts.iter().collect::<Vec<_>>(), 0..m, op)
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), CommError> {
        if peer >= self.group.size() {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} is not a group index (size {})",
                    self.group.size()
                ),
            ));
        }
        Ok(())
    }

    /// Waits for the next message from `peer` on the p2p tag and receives it into `into`
    /// (made from the message's byte count), all within the deadline.
    fn recv_message(
        &self,
        peer: usize,
        seq: u64,
        start: Instant,
        into: impl FnOnce(usize) -> Result<Buffer, CommError>,
    ) -> Result<Buffer, CommError> {
        let source = self.comm.0.process_at_rank(peer as i32);
        let mut backoff = Backoff::default();
        let (message, status) = loop {
            if let Some(found) = source.immediate_matched_probe_with_tag(P2P_TAG) {
                break found;
            }
            self.progress_sends();
            if start.elapsed() >= self.world.timeout {
                self.world.fatal(&CommError::Timeout {
                    group: self.label.clone(),
                    op: "recv",
                    seq,
                    waited: start.elapsed(),
                    missing: vec![self.group.global_rank_of(peer)],
                });
            }
            backoff.snooze();
        };
        let bytes = status.count(u8::equivalent_datatype()).max(0) as usize;
        let mut buf = into(bytes)?;
        scope(|sc| {
            let r = message.immediate_matched_receive_into(sc, buf.bytes_mut());
            self.wait(
                "recv",
                seq,
                start,
                vec![(vec![self.group.global_rank_of(peer)], r)],
            );
        });
        Ok(buf)
    }
}

impl Drop for MpiCommunicator {
    /// Sends still in flight must complete before their buffers go (bounded, like any wait).
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            // Nothing may call MPI any more; the handle goes with the process.
            return;
        }
        let start = Instant::now();
        let mut backoff = Backoff::default();
        loop {
            self.progress_sends();
            let sends = lock(&self.sends);
            if sends.is_empty() {
                drop(sends);
                // SAFETY: dropped once, here; nothing uses the communicator after drop.
                unsafe { std::mem::ManuallyDrop::drop(&mut self.comm) };
                return;
            }
            if start.elapsed() >= self.world.timeout {
                let missing = sends
                    .iter()
                    .map(|s| self.group.global_rank_of(s.peer))
                    .collect();
                drop(sends);
                self.world.fatal(&CommError::Timeout {
                    group: self.label.clone(),
                    op: "send",
                    seq: 0,
                    waited: start.elapsed(),
                    missing,
                });
            }
            drop(sends);
            backoff.snooze();
        }
    }
}

impl Communicator for MpiCommunicator {
    fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn timeout(&self) -> Duration {
        self.world.timeout
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError> {
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            reduce: Some(op),
            ..data_desc("all_reduce", buf)
        };
        let seq = self.agree(&mut state, desc)?;
        let (n, me, len) = (self.group.size(), self.group.rank(), buf.len());
        let m = chunk_range(len, n, me).len();
        let pieces = self.all_to_all("all_reduce", seq, buf, m)?;
        let mine = self.fold(&pieces, m, op);
        let (counts, displs) = self.chunk_bytes("all_reduce", len, buf.dtype().size())?;
        let start = Instant::now();
        let mut out = PartitionMut::new(buf.bytes_mut(), counts, displs);
        scope(|sc| {
            let r = self
                .comm
                .0
                .immediate_all_gather_varcount_into(sc, mine.bytes(), &mut out);
            self.wait("all_reduce", seq, start, vec![(self.others(), r)]);
        });
        Ok(())
    }

    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError> {
        let mut state = lock(&self.ops);
        let seq = self.agree(&mut state, data_desc("all_gather", &input))?;
        let n = self.group.size();
        self.count("all_gather", input.bytes().len() * n)?;
        let mut out = Buffer::zeros(input.dtype(), input.len() * n);
        let start = Instant::now();
        scope(|sc| {
            let r = self
                .comm
                .0
                .immediate_all_gather_into(sc, input.bytes(), out.bytes_mut());
            self.wait("all_gather", seq, start, vec![(self.others(), r)]);
        });
        Ok(out)
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CommError> {
        let n = self.group.size();
        if !input.len().is_multiple_of(n) {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "{} elements do not split evenly over {n} ranks",
                    input.len()
                ),
            ));
        }
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            reduce: Some(op),
            ..data_desc("reduce_scatter", &input)
        };
        let seq = self.agree(&mut state, desc)?;
        let m = input.len() / n;
        let pieces = self.all_to_all("reduce_scatter", seq, &input, m)?;
        Ok(self.fold(&pieces, m, op))
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError> {
        self.check_peer("broadcast", root)?;
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            root: Some(root),
            ..data_desc("broadcast", buf)
        };
        let seq = self.agree(&mut state, desc)?;
        if self.group.size() == 1 {
            return Ok(());
        }
        self.count("broadcast", buf.bytes().len())?;
        let start = Instant::now();
        scope(|sc| {
            let from = self.comm.0.process_at_rank(root as i32);
            let r = from.immediate_broadcast_into(sc, buf.bytes_mut());
            self.wait("broadcast", seq, start, vec![(self.others(), r)]);
        });
        Ok(())
    }

    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError> {
        self.check_peer("send", peer)?;
        let bytes = self.count("send", buf.bytes().len())?;
        self.progress_sends();
        let header = Box::new([code(&DTYPES, Some(&buf.dtype())), buf.len() as i64]);
        // SAFETY: reading a constant the MPI library exports.
        let mut requests = [unsafe { ffi::RSMPI_REQUEST_NULL }; 2];
        let (comm, dest) = (self.comm.0.as_raw(), peer as i32);
        // SAFETY: the header and payload allocations live in the pending entry until MPI_Test
        // reports both requests complete (or, at drop, until they are waited for).
        unsafe {
            ffi::MPI_Isend(
                header.as_ptr().cast(),
                16,
                ffi::RSMPI_UINT8_T,
                dest,
                P2P_TAG,
                comm,
                &mut requests[0],
            );
            ffi::MPI_Isend(
                buf.bytes().as_ptr().cast(),
                bytes,
                ffi::RSMPI_UINT8_T,
                dest,
                P2P_TAG,
                comm,
                &mut requests[1],
            );
        }
        lock(&self.sends).push(PendingSend {
            requests: Raw(requests),
            _header: header,
            _payload: buf,
            peer,
        });
        Ok(())
    }

    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError> {
        self.check_peer("recv", peer)?;
        let state = lock(&self.ops);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let start = Instant::now();
        let header = self.recv_message(peer, 0, start, |_| Ok(Buffer::zeros(CommDType::I64, 2)))?;
        let Buffer::I64(h) = header else {
            unreachable!("received into an i64 buffer")
        };
        let sent = (decode(&DTYPES, h[0]), h[1].max(0) as usize);
        let payload = self.recv_message(peer, 0, start, |bytes| {
            Ok(match sent.0 {
                Some(dtype) => Buffer::zeros(dtype, bytes / dtype.size()),
                None => Buffer::zeros(CommDType::I64, bytes.div_ceil(8)),
            })
        })?;
        if sent != (Some(buf.dtype()), buf.len()) {
            let err = CommError::Mismatch {
                group: self.label.clone(),
                seq: 0,
                detail: format!(
                    "global rank {} sent {} × {}, global rank {} expected {} × {}",
                    self.group.global_rank_of(peer),
                    sent.0.map_or("?".to_string(), |d| d.to_string()),
                    sent.1,
                    self.group.global_rank(),
                    buf.dtype(),
                    buf.len()
                ),
            };
            drop(state);
            lock(&self.ops).poisoned = Some(err.clone());
            return Err(err);
        }
        *buf = payload;
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            op: "barrier",
            dtype: None,
            len: 0,
            reduce: None,
            root: None,
        };
        self.agree(&mut state, desc).map(|_| ())
    }
}
