//! The `nccl` backend: one process per GPU, over NCCL (cudarc's `nccl`, loaded at run time).
//!
//! Each [`ProcessGroup`] is one NCCL communicator with a stream of its own; point-to-point
//! messages between two members run on two more, one per direction, created together at the
//! pair's first message and connected there by one byte each way (NCCL connects a transport
//! at its first send or receive, and that call waits on the host for the peer's half). A
//! send is then only enqueued (it never waits for the receiver, as the trait promises), and
//! two neighbours that both send first cannot deadlock. Making a pair waits for the peer,
//! though: a ring opens its pairs first, in the group's order
//! ([`Communicator::connect`](super::Communicator::connect)), and so do `send_recv` and the
//! all-to-all.
//!
//! The NCCL unique id of a communicator is made by its first member and handed to the others
//! by a [`Bootstrap`]: rank 0's [`TcpStore`] (torchrun, srun with `MASTER_ADDR`), or MPI
//! itself when mpirun started the job and the `mpi` feature is on.
//!
//! NCCL has no deadline and runs on the GPU. Every call here waits for its stream by polling
//! an event against the communicator's timeout; on a timeout the communicator is aborted
//! (`ncclCommAbort`, which frees the stuck kernels) and the call fails with
//! [`CommError::Stalled`]. Queuing work may itself wait on the host, where NCCL connects a
//! transport at its first use and waits for the peer's half; a watchdog bounds those calls
//! and ends the process past the timeout, as NCCL cannot be interrupted there.
//!
//! Before each collective the members all-gather a small header (op, dtype, count,
//! reduction, root, call number), so a mismatched call is an error on every member, as in
//! the other backends; each message carries its dtype and length likewise.
//!
//! Reductions are NCCL's own (f16 and bf16 native): every rank gets the same bits, but not
//! necessarily those of the threaded backend, which folds in group order.

mod communicator;
mod device;
mod library;
mod message;
mod pairs;
mod seats;
mod watchdog;

pub use communicator::NcclCommunicator;

use super::group::{CommError, ProcessGroup};
use super::{Buffer, Comm, StoreError, TcpStore, World, lock};
use cudarc::driver::CudaContext;
use cudarc::nccl::sys;
use library::Nccl;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Host waits for NCCL's streams so far in this process. Every call of this backend but a
/// send returns once its work has run on the GPU (its deadline is how a dead peer becomes an
/// error), so each is the host waiting for one of NCCL's streams (not for the whole device):
/// CubeCL's kernels already queued keep running meanwhile, but none is queued after them
/// until the call returns. Differences between two calls count a step's.
pub fn host_waits() -> u64 {
    communicator::host_waits().0
}

/// [`host_waits`] of this thread only: a rank's own calls, without those of its overlapped
/// gradient reduction's worker thread (which waits off the rank's path).
pub fn thread_host_waits() -> u64 {
    communicator::host_waits().1
}

/// NCCL communicators this process has joined so far: one per group of two or more members
/// and two per point-to-point pair (a group of one has none, see [`NcclWorld`]'s
/// `new_group`).
pub fn communicators() -> u64 {
    COMMUNICATORS.load(std::sync::atomic::Ordering::Relaxed)
}

static COMMUNICATORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The exit status of a process this backend ends after a failure.
pub const ABORT_CODE: i32 = 3;

/// How the members of a new communicator receive its NCCL unique id.
#[derive(Debug)]
pub enum Bootstrap {
    /// Through rank 0's key-value store.
    Store(TcpStore),
    /// Over a host-buffer world with the same ranks (MPI under mpirun): a broadcast on a
    /// group of the new communicator's members.
    World(Arc<dyn World>),
}

/// The NCCL library this backend loads, and its version (`libnccl.so.2, NCCL 2.28.9`); or
/// why none loads, with what was tried (see [`crate::cuda::nccl_library_candidates`]).
///
/// ```no_run
/// match burn_megatron::comm::nccl::loaded_library() {
///     Ok(found) => println!("{found}"),
///     Err(why) => println!("no NCCL: {why}"),
/// }
/// ```
pub fn loaded_library() -> Result<String, String> {
    let nccl = library::nccl()?;
    let v = nccl.version().map_err(|e| e.to_string())?;
    Ok(format!(
        "{}, NCCL {}.{}.{}",
        nccl.name,
        v / 10000,
        v % 10000 / 100,
        v % 100
    ))
}

/// An NCCL communicator handle. Destroyed on drop, or aborted when a call on it stalled.
pub(crate) struct RawComm {
    pub(crate) comm: sys::ncclComm_t,
    nccl: &'static Nccl,
    aborted: std::sync::atomic::AtomicBool,
    /// The device the communicator lives on, made current for its destruction.
    ctx: Arc<CudaContext>,
    /// How long dropping it waits for `ncclCommDestroy`.
    timeout: Duration,
}

// SAFETY: NCCL communicators may be used from any thread; calls on one are serialised by
// the communicator's locks, as NCCL requires.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

impl RawComm {
    /// Frees the kernels stuck on this communicator; later calls fail.
    pub(crate) fn abort(&self) {
        if !self.aborted.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: a live communicator, aborted once.
            let _ = unsafe { self.nccl.comm_abort(self.comm) };
        }
    }
}

impl Drop for RawComm {
    /// `ncclCommDestroy` waits for the communicator's work with no deadline (a kernel stuck
    /// on a dead peer never ends), so it runs aside: past the timeout the communicator is
    /// abandoned, with a warning, and its thread left behind, rather than this drop hanging.
    fn drop(&mut self) {
        if *self.aborted.get_mut() {
            return;
        }
        let comm = Raw(self.comm);
        let (ctx, nccl) = (self.ctx.clone(), self.nccl);
        let (tx, rx) = std::sync::mpsc::channel();
        let destroy = move || {
            let comm = comm.get();
            let _ = ctx.bind_to_thread();
            // SAFETY: a live communicator, destroyed once, here; its streams are idle
            // (every call waits for its work, pending sends are waited for by their owner's
            // drop).
            let _ = unsafe { nccl.comm_destroy(comm) };
            let _ = tx.send(());
        };
        let spawned = std::thread::Builder::new()
            .name("nccl-destroy".into())
            .spawn(destroy);
        let done = match spawned {
            Ok(_) => rx.recv_timeout(self.timeout).is_ok(),
            Err(_) => false,
        };
        if !done {
            eprintln!(
                "burn-megatron: warning: ncclCommDestroy did not complete within {:?}; the \
                 NCCL communicator is abandoned (its memory stays allocated)",
                self.timeout
            );
        }
    }
}

pub(crate) struct Inner {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) nccl: &'static Nccl,
    bootstrap: Bootstrap,
    rank: usize,
    size: usize,
    pub(crate) timeout: Duration,
    /// How many communicators of each key this process has made: members make theirs in the
    /// same order, so the count names the same communicator on every member.
    created: Mutex<HashMap<String, u64>>,
}

/// The ranks of a job of one process per GPU, over NCCL. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct NcclWorld {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclWorld")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.ctx.ordinal())
            .field("bootstrap", &self.bootstrap)
            .finish()
    }
}

impl NcclWorld {
    /// Global rank `rank` of `size`, on CUDA device `ordinal`.
    pub fn new(
        ordinal: usize,
        rank: usize,
        size: usize,
        bootstrap: Bootstrap,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let engine = |reason: String| CommError::Engine {
            group: "world".into(),
            op: "init",
            reason,
        };
        if rank >= size {
            return Err(engine(format!("rank {rank} is outside a world of {size}")));
        }
        // The driver's bindings panic on a library they cannot load: look first.
        let libraries = crate::cuda::cuda_libraries();
        if !libraries.driver {
            return Err(engine(format!(
                "the nccl backend needs libcuda and libnccl: {libraries}"
            )));
        }
        let nccl = library::nccl().map_err(engine)?;
        let version = nccl
            .version()
            .map_err(|e| engine(format!("{} could not be queried: {e}", nccl.name)))?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| engine(format!("CUDA device {ordinal} (NCCL {version}): {e:?}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                ctx,
                nccl,
                bootstrap,
                rank,
                size,
                timeout,
                created: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }
}

impl Inner {
    /// Joins a new NCCL communicator over `group` named `what`, as member `index` of
    /// `ranks.len()`: the id comes from `ranks[0]`, the join is bounded by the timeout.
    pub(crate) fn join(
        &self,
        label: &str,
        what: &str,
        ranks: &[usize],
        index: usize,
    ) -> Result<RawComm, CommError> {
        let key = format!("nccl/{what}");
        let count = {
            let mut created = lock(&self.created);
            let c = created.entry(key.clone()).or_insert(0);
            *c += 1;
            *c
        };
        let key = format!("{key}#{count}");
        let engine = |reason: String| CommError::Engine {
            group: label.to_string(),
            op: "new_group",
            reason,
        };
        let id = if index == 0 {
            Some(self.nccl.unique_id().map_err(|e| engine(e.to_string()))?)
        } else {
            None
        };
        let id = self.share(label, &key, ranks, id)?;
        let (ctx, nccl) = (self.ctx.clone(), self.nccl);
        let (n, me) = (ranks.len() as i32, index as i32);
        // ncclCommInitRank waits for every member with no deadline: run it aside and stop
        // waiting at ours. A join that never completes leaves that thread behind, and the
        // error ends the job.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("nccl-init".into())
            .spawn(move || {
                let joined = ctx
                    .bind_to_thread()
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|_| {
                        // SAFETY: the device's context is current on this thread (above).
                        unsafe { nccl.comm_init_rank(n, id, me) }
                            .map(Raw)
                            .map_err(|e| e.to_string())
                    });
                let _ = tx.send(joined);
            })
            .map_err(|e| engine(format!("spawning the init thread: {e}")))?;
        let start = Instant::now();
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(Raw(comm))) => {
                COMMUNICATORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(RawComm {
                    comm,
                    nccl: self.nccl,
                    aborted: false.into(),
                    ctx: self.ctx.clone(),
                    timeout: self.timeout,
                })
            }
            Ok(Err(reason)) => Err(engine(reason)),
            Err(_) => Err(CommError::Stalled {
                group: label.to_string(),
                op: "new_group",
                seq: 0,
                waited: start.elapsed(),
            }),
        }
    }

    /// Hands the id of `ranks[0]` to every member of `ranks`.
    fn share(
        &self,
        label: &str,
        key: &str,
        ranks: &[usize],
        id: Option<sys::ncclUniqueId>,
    ) -> Result<sys::ncclUniqueId, CommError> {
        let bytes =
            |id: &sys::ncclUniqueId| -> Vec<u8> { id.internal.iter().map(|&c| c as u8).collect() };
        let from_bytes = |b: &[u8]| -> Result<sys::ncclUniqueId, CommError> {
            let internal: [std::ffi::c_char; 128] =
                std::array::from_fn(|i| b.get(i).copied().unwrap_or(0) as std::ffi::c_char);
            if b.len() != 128 {
                return Err(CommError::Engine {
                    group: label.to_string(),
                    op: "new_group",
                    reason: format!("the rendezvous gave a {}-byte NCCL id, not 128", b.len()),
                });
            }
            Ok(sys::ncclUniqueId { internal })
        };
        match &self.bootstrap {
            Bootstrap::Store(store) => {
                if let Some(id) = id {
                    store.set(key, &bytes(&id)).map_err(|e| CommError::Engine {
                        group: label.to_string(),
                        op: "new_group",
                        reason: e.to_string(),
                    })?;
                    Ok(id)
                } else {
                    let got = store.get(key, self.timeout).map_err(|e| match e {
                        super::StoreError::Timeout { waited, .. } => CommError::Timeout {
                            group: label.to_string(),
                            op: "new_group",
                            seq: 0,
                            waited,
                            missing: vec![ranks[0]],
                        },
                        other => CommError::Engine {
                            group: label.to_string(),
                            op: "new_group",
                            reason: other.to_string(),
                        },
                    })?;
                    from_bytes(&got)
                }
            }
            Bootstrap::World(world) => {
                let comm = world.new_group(key, ranks.to_vec(), self.rank)?;
                let words = |b: Vec<u8>| -> Vec<i64> {
                    b.chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                        .collect()
                };
                let mut buf = Buffer::I64(id.map_or_else(|| vec![0; 16], |id| words(bytes(&id))));
                comm.broadcast(&mut buf, 0)?;
                from_bytes(buf.bytes())
            }
        }
    }
}

struct Raw(sys::ncclComm_t);
// SAFETY: a communicator handle moved once between threads: from the init thread to its
// owner, from its owner to the thread that destroys it.
unsafe impl Send for Raw {}

impl Raw {
    /// The handle (a method, so that a closure moves the whole `Raw`, which is `Send`).
    fn get(self) -> sys::ncclComm_t {
        self.0
    }
}

impl World for NcclWorld {
    fn size(&self) -> usize {
        self.inner.size
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// A group of two or more is an NCCL communicator; a group of this rank alone is a
    /// host one ([`LocalWorld`](super::LocalWorld)'s), as its calls move nothing. An NCCL
    /// communicator of one would still cost a rendezvous, device buffers and a proxy
    /// thread, and a rank has about fifteen such groups (every dimension of size 1).
    fn new_group(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<Comm, CommError> {
        let group = ProcessGroup::of_process(
            name,
            ranks.clone(),
            global_rank,
            (self.inner.rank, self.inner.size),
            "NCCL",
        )?;
        if group.size() == 1 {
            let alone = super::LocalWorld::with_timeout(self.inner.size, self.inner.timeout);
            return Ok(Arc::new(alone.communicator(name, ranks, global_rank)?));
        }
        Ok(Arc::new(NcclCommunicator::new(group, self.inner.clone())?))
    }
}
