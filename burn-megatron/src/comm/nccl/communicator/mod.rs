//! One process's NCCL communicator on one group: header-checked collectives on host buffers
//! (copied to the GPU and back) and on device memory, and point-to-point messages on a
//! communicator per direction.

use super::super::group::{CommError, OpDesc, ProcessGroup};
use super::super::header::{HEADER, encode, mismatch};
use super::super::{Buffer, CommDType, Communicator, DeviceCollectives, ReduceOp, lock};
use super::library::NcclResult;
use super::message::Payload;
use super::{Inner, RawComm};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// The `Communicator` impl: each collective through the header check and the host or
// device path.
mod collectives;

/// Host waits for NCCL's streams: in this process, and on this thread.
static HOST_WAITS: AtomicU64 = AtomicU64::new(0);
thread_local! {
    static THREAD_HOST_WAITS: Cell<u64> = const { Cell::new(0) };
}

/// The host waits for NCCL's streams so far: (this process, this thread).
pub(super) fn host_waits() -> (u64, u64) {
    (
        HOST_WAITS.load(Ordering::Relaxed),
        THREAD_HOST_WAITS.with(Cell::get),
    )
}

/// A communicator and the stream its work runs on; the lock serialises its calls.
pub(super) struct Link {
    comm: RawComm,
    pub(super) stream: Arc<CudaStream>,
    pub(super) lock: Mutex<()>,
}

/// The two communicators between this member and one peer: `out` carries our sends (we are
/// its NCCL rank 0), `inn` the peer's (NCCL rank 1 is us).
pub(super) struct Pair {
    out: Link,
    pub(super) inn: Link,
}

impl Pair {
    /// The link our sends to the peer go on.
    pub(super) fn out(&self) -> &Link {
        &self.out
    }
}

/// A send NCCL is still carrying: its header and payload live until the event completes.
pub(super) struct Pending {
    pub(super) pair: Arc<Pair>,
    pub(super) event: CudaEvent,
    pub(super) started: Instant,
    pub(super) _header: CudaSlice<u8>,
    pub(super) _payload: Payload,
}

struct State {
    seq: u64,
    poisoned: Option<CommError>,
}

/// A rank's NCCL communicator on one group (see [`NcclWorld`](super::NcclWorld)).
pub struct NcclCommunicator {
    pub(super) group: ProcessGroup,
    label: String,
    pub(super) world: Arc<Inner>,
    pub(super) link: Link,
    state: Mutex<State>,
    pairs: Mutex<HashMap<usize, Arc<Pair>>>,
    pub(super) pending: Mutex<Vec<Pending>>,
    /// Messages to this member itself, which need no engine.
    to_self: Mutex<std::collections::VecDeque<Buffer>>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("group", &self.label)
            .field("rank", &self.group.rank())
            .finish_non_exhaustive()
    }
}

pub(super) fn nccl_dtype(d: CommDType) -> sys::ncclDataType_t {
    match d {
        CommDType::F32 => sys::ncclDataType_t::ncclFloat32,
        CommDType::F16 => sys::ncclDataType_t::ncclFloat16,
        CommDType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        CommDType::I32 => sys::ncclDataType_t::ncclInt32,
        CommDType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

pub(super) const BYTE: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint8;

pub(super) fn i64s_to_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(super) fn bytes_to_i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

impl NcclCommunicator {
    pub(crate) fn new(group: ProcessGroup, world: Arc<Inner>) -> Result<Self, CommError> {
        let label = group.to_string();
        let comm = world.join(&label, &label, group.ranks(), group.rank())?;
        let link = Self::link(&world, &label, comm)?;
        Ok(Self {
            group,
            label,
            world,
            link,
            state: Mutex::new(State {
                seq: 0,
                poisoned: None,
            }),
            pairs: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
            to_self: Mutex::new(Default::default()),
        })
    }

    fn link(world: &Inner, label: &str, comm: RawComm) -> Result<Link, CommError> {
        let stream = world.ctx.new_stream().map_err(|e| CommError::Engine {
            group: label.to_string(),
            op: "new_group",
            reason: format!("creating a CUDA stream: {e:?}"),
        })?;
        Ok(Link {
            comm,
            stream,
            lock: Mutex::new(()),
        })
    }

    pub(super) fn engine(&self, op: &'static str, e: impl std::fmt::Debug) -> CommError {
        CommError::Engine {
            group: self.label.clone(),
            op,
            reason: format!("{e:?}"),
        }
    }

    pub(super) fn invalid(&self, op: &'static str, reason: String) -> CommError {
        CommError::InvalidArgument {
            group: self.label.clone(),
            op,
            reason,
        }
    }

    /// The live handle of `link`, or the error of a call on an aborted one.
    pub(super) fn handle(
        &self,
        link: &Link,
        op: &'static str,
    ) -> Result<sys::ncclComm_t, CommError> {
        if link.comm.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(self.engine(op, "the communicator was aborted after an earlier failure"));
        }
        self.world
            .ctx
            .bind_to_thread()
            .map_err(|e| self.engine(op, e))?;
        Ok(link.comm.comm)
    }

    /// Runs `call`, which queues NCCL work, under the process's watchdog: NCCL may connect
    /// transports inside it and wait for a peer with no deadline (see
    /// [`super::watchdog`]); past the communicator's timeout the process ends.
    pub(super) fn queue<R>(&self, op: &'static str, call: impl FnOnce() -> R) -> R {
        self.queue_within(op, self.world.timeout, call)
    }

    /// [`Self::queue`] bounded by `timeout` (a checkpoint barrier's, say: a first use that
    /// connects waits there for the slowest member).
    fn queue_within<R>(&self, op: &'static str, timeout: Duration, call: impl FnOnce() -> R) -> R {
        super::watchdog::watchdog().bounded(
            || format!("NCCL {op} on group {}", self.label),
            timeout,
            call,
        )
    }

    /// Waits for the work enqueued on `link` so far, against the timeout. On a timeout or an
    /// NCCL error the communicator is aborted.
    pub(super) fn wait(&self, link: &Link, op: &'static str, seq: u64) -> Result<(), CommError> {
        self.wait_within(link, op, seq, self.world.timeout)
    }

    /// [`Self::wait`] against `timeout` instead of the communicator's.
    fn wait_within(
        &self,
        link: &Link,
        op: &'static str,
        seq: u64,
        timeout: Duration,
    ) -> Result<(), CommError> {
        HOST_WAITS.fetch_add(1, Ordering::Relaxed);
        THREAD_HOST_WAITS.with(|n| n.set(n.get() + 1));
        let event = link
            .stream
            .record_event(None)
            .map_err(|e| self.engine(op, e))?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(2);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.engine(op, e)),
            }
            // SAFETY: a live communicator (aborting happens only below, on this thread).
            if let Err(e) = unsafe { self.world.nccl.comm_get_async_error(link.comm.comm) } {
                link.comm.abort();
                return Err(self.engine(op, e));
            }
            if start.elapsed() >= timeout {
                link.comm.abort();
                return Err(CommError::Stalled {
                    group: self.label.clone(),
                    op,
                    seq,
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Runs one collective: agree on `desc`, then `f` with the call number; a failure
    /// poisons the communicator for every later call.
    pub(super) fn collective<R>(
        &self,
        desc: OpDesc,
        f: impl FnOnce(u64, sys::ncclComm_t) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        self.collective_within(desc, self.world.timeout, f)
    }

    /// [`Self::collective`] whose header exchange is bounded by `timeout` (what `f` waits
    /// for is bounded as `f` decides).
    fn collective_within<R>(
        &self,
        desc: OpDesc,
        timeout: Duration,
        f: impl FnOnce(u64, sys::ncclComm_t) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let mut state = lock(&self.state);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let seq = state.seq;
        state.seq += 1;
        let _serial = lock(&self.link.lock);
        let out = self.agree(&desc, seq, timeout).and_then(|()| {
            let comm = self.handle(&self.link, desc.op)?;
            f(seq, comm)
        });
        if let Err(e) = &out {
            state.poisoned = Some(e.clone());
        }
        out
    }

    /// All-gathers the members' headers and checks they describe the same call (also a
    /// barrier).
    fn agree(&self, desc: &OpDesc, seq: u64, timeout: Duration) -> Result<(), CommError> {
        let n = self.group.size();
        if n == 1 {
            return Ok(());
        }
        let mine = encode(desc, seq);
        let all = self.bytes_op(
            desc.op,
            seq,
            timeout,
            &i64s_to_bytes(&mine),
            n * HEADER * 8,
            |s, r, c, st| {
                // SAFETY: device buffers of the sizes NCCL reads and writes, live until the wait.
                unsafe {
                    self.world
                        .nccl
                        .all_gather(s as _, r as _, HEADER * 8, BYTE, c, st)
                }
            },
        )?;
        let theirs: Vec<[i64; HEADER]> = bytes_to_i64s(&all)
            .chunks_exact(HEADER)
            .map(|h| h.try_into().expect("HEADER values"))
            .collect();
        if theirs.iter().any(|h| *h != mine) {
            return Err(mismatch(&self.label, seq, &self.group, &theirs));
        }
        Ok(())
    }

    /// Copies `input` to the GPU, runs `enqueue(send, recv, comm, stream)` on the group's
    /// communicator, waits, and returns the `out_len` bytes of `recv`.
    #[allow(clippy::too_many_arguments)]
    fn bytes_op(
        &self,
        op: &'static str,
        seq: u64,
        timeout: Duration,
        input: &[u8],
        out_len: usize,
        enqueue: impl FnOnce(u64, u64, sys::ncclComm_t, sys::cudaStream_t) -> NcclResult,
    ) -> Result<Vec<u8>, CommError> {
        let comm = self.handle(&self.link, op)?;
        let stream = &self.link.stream;
        let cuda = |e| self.engine(op, e);
        let send = if input.is_empty() {
            stream.alloc_zeros::<u8>(1)
        } else {
            stream.clone_htod(input)
        }
        .map_err(cuda)?;
        let mut recv = stream.alloc_zeros::<u8>(out_len.max(1)).map_err(cuda)?;
        {
            let (s, _s) = send.device_ptr(stream);
            let (r, _r) = recv.device_ptr_mut(stream);
            self.queue_within(op, timeout, || enqueue(s, r, comm, stream.cu_stream() as _))
                .map_err(|e| self.engine(op, e))?;
        }
        self.wait_within(&self.link, op, seq, timeout)?;
        self.to_host(op, stream, &recv, out_len)
    }

    /// The first `len` bytes of `dev`, once `stream` has written them.
    fn to_host(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        dev: &CudaSlice<u8>,
        len: usize,
    ) -> Result<Vec<u8>, CommError> {
        let mut out = vec![0u8; len];
        if len > 0 {
            let cuda = |e| self.engine(op, e);
            stream
                .memcpy_dtoh(&dev.slice(..len), out.as_mut_slice())
                .map_err(cuda)?;
            stream.synchronize().map_err(cuda)?;
        }
        Ok(out)
    }

    /// One collective on host bytes: agree on `desc`, then [`Self::bytes_op`].
    fn host_op(
        &self,
        desc: OpDesc,
        input: &[u8],
        out_len: usize,
        enqueue: impl FnOnce(u64, u64, sys::ncclComm_t, sys::cudaStream_t) -> NcclResult,
    ) -> Result<Vec<u8>, CommError> {
        let op = desc.op;
        self.collective(desc, |seq, _| {
            self.bytes_op(op, seq, self.world.timeout, input, out_len, enqueue)
        })
    }

    /// The communicators to and from `peer`, made at the pair's first message (both
    /// directions, lower group index's first, so neither side waits for the other's order).
    pub(super) fn pair(&self, op: &'static str, peer: usize) -> Result<Arc<Pair>, CommError> {
        self.group.check_peer(op, peer)?;
        let me = self.group.rank();
        let mut pairs = lock(&self.pairs);
        if let Some(p) = pairs.get(&peer) {
            return Ok(p.clone());
        }
        let (lo, hi) = (me.min(peer), me.max(peer));
        let (glo, ghi) = (self.group.global_rank_of(lo), self.group.global_rank_of(hi));
        let up = self.world.join(
            &self.label,
            &format!("{} p2p {glo}->{ghi}", self.label),
            &[glo, ghi],
            usize::from(me != lo),
        )?;
        let down = self.world.join(
            &self.label,
            &format!("{} p2p {ghi}->{glo}", self.label),
            &[ghi, glo],
            usize::from(me != hi),
        )?;
        let (out, inn) = if me == lo { (up, down) } else { (down, up) };
        let pair = Arc::new(Pair {
            out: Self::link(&self.world, &self.label, out)?,
            inn: Self::link(&self.world, &self.label, inn)?,
        });
        self.warm_up(&pair)?;
        pairs.insert(peer, pair.clone());
        Ok(pair)
    }

    /// One byte each way, grouped, while both members are in [`Self::pair`] (the joins just
    /// met). NCCL connects a communicator's point-to-point transport in the call that queues
    /// its first send or receive, and that call waits on the host until the peer queues the
    /// other half on the same communicator: two members sending first, each on its own `out`,
    /// would wait for each other for ever. Connected here, a later send only queues.
    fn warm_up(&self, pair: &Pair) -> Result<(), CommError> {
        let op = "connect";
        let (out, inn) = (&pair.out, &pair.inn);
        let (to, from) = (self.handle(out, op)?, self.handle(inn, op)?);
        let cuda = |e| self.engine(op, e);
        let send = out.stream.alloc_zeros::<u8>(1).map_err(cuda)?;
        let mut recv = inn.stream.alloc_zeros::<u8>(1).map_err(cuda)?;
        {
            let (s, _s) = send.device_ptr(&out.stream);
            let (r, _r) = recv.device_ptr_mut(&inn.stream);
            let nccl = &self.world.nccl;
            let failed = |e| self.engine(op, e);
            nccl.group_start().map_err(failed)?;
            // SAFETY: one-byte device buffers, live until the waits below; in `out` the peer
            // is NCCL rank 1, in `inn` rank 0.
            let queued = unsafe {
                nccl.send(s as _, 1, BYTE, 1, to, out.stream.cu_stream() as _)
                    .and_then(|_| nccl.recv(r as _, 1, BYTE, 0, from, inn.stream.cu_stream() as _))
            };
            // Here both transports connect: the call waits for the peer's half.
            let ended = self.queue(op, || nccl.group_end());
            queued.and(ended).map_err(failed)?;
        }
        self.wait(out, op, 0)?;
        self.wait(inn, op, 0)
    }

    /// Frees finished sends; a send still unfinished past the timeout stalls its link.
    pub(super) fn reap(&self) -> Result<(), CommError> {
        let mut stalled = None;
        lock(&self.pending).retain(|p| {
            if p.event.is_complete() {
                return false;
            }
            if p.started.elapsed() >= self.world.timeout {
                p.pair.out.comm.abort();
                stalled.get_or_insert(CommError::Stalled {
                    group: self.label.clone(),
                    op: "send",
                    seq: 0,
                    waited: p.started.elapsed(),
                });
                return false;
            }
            true
        });
        stalled.map_or(Ok(()), Err)
    }

    pub(super) fn recv_bytes(&self, link: &Link, len: usize) -> Result<Vec<u8>, CommError> {
        let comm = self.handle(link, "recv")?;
        let cuda = |e| self.engine("recv", e);
        let mut dev = link.stream.alloc_zeros::<u8>(len.max(1)).map_err(cuda)?;
        {
            let (p, _p) = dev.device_ptr_mut(&link.stream);
            // SAFETY: a device buffer of `len` bytes, live until the wait below.
            self.queue("recv", || unsafe {
                self.world
                    .nccl
                    .recv(p as _, len, BYTE, 0, comm, link.stream.cu_stream() as _)
            })
            .map_err(|e| self.engine("recv", e))?;
        }
        self.wait(link, "recv", 0)?;
        self.to_host("recv", &link.stream, &dev, len)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // Sends still in flight must land before their communicators are destroyed.
        let start = Instant::now();
        let pending = std::mem::take(&mut *lock(&self.pending));
        for p in pending {
            while !p.event.is_complete() {
                if start.elapsed() >= self.world.timeout {
                    p.pair.out.comm.abort();
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
