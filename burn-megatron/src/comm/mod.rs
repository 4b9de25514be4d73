//! Collectives between ranks, shaped after NCCL so that an NCCL backend can slot in.
//!
//! A [`Communicator`] is one rank's handle on one [`ProcessGroup`]. Every call is bounded
//! by a timeout and returns a [`CommError`] rather than hanging: a peer that calls a
//! different collective, passes a different element count, dtype or root, fails, or exits
//! early makes the call fail on every member, naming the group, the operation and the ranks.
//!
//! A [`World`] makes communicators; the rest of the library sees only [`Comm`]s. Backends:
//! - ranks as threads of this process ([`LocalWorld`]), the default;
//! - `mpi` (feature `mpi`): one process per rank over MPI (`mpi::MpiWorld`);
//! - `nccl` (feature `cuda`): one process per GPU over NCCL (`nccl::NcclWorld`), bootstrapped
//!   through a [`TcpStore`] or MPI; its communicators also work on device memory
//!   ([`DeviceCollectives`]).
//!
//! [`Probed`] wraps any of them and shows each call it passes on (a count of a layout's
//! collectives, a benchmark's paced network). Tensor-level helpers on Burn tensors live in
//! [`tensor`].

pub(crate) mod all_to_all;
mod buffer;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_tensor;
mod device;
mod group;
pub(crate) mod handoff;
#[cfg(any(feature = "mpi", feature = "cuda"))]
mod header;
mod lend;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
mod probe;
mod reduce;
mod store;
pub mod tensor;

#[cfg(test)]
mod tests;

pub use buffer::{Buffer, CommDType, CommElement};
pub(crate) use buffer::{comm_dtype, map_vec};
#[cfg(feature = "cuda")]
pub use cuda_tensor::{P2P_VAR, P2pStats, p2p_stats};
pub use device::{DeviceCollectives, DeviceSlice};
pub use group::{CommError, ProcessGroup};
pub use local::{LocalCommunicator, LocalWorld};
pub use probe::{CommCall, Probed};
pub use reduce::{ReduceOp, has_non_finite};
pub use store::{StoreError, TcpStore};

use std::sync::Arc;
use std::time::{Duration, Instant};

/// Locks a mutex, ignoring poisoning: a panicking rank is reported through its world, and
/// the state it leaves is consistent because no user code runs under the backends' locks.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Prints a dying rank's last line to stderr in one `write`, so that launchers which merge
/// the ranks' streams (`mpirun`) never interleave two ranks' lines mid-sentence, as
/// `eprintln!` (one `write` per formatted piece) lets them.
#[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
pub(crate) fn last_words(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut text = line.to_string();
    text.push('\n');
    // Nothing is left to do with an error: the process ends next.
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// A group of this rank alone, for a layer built without the group it could be split over
/// (its collectives return at once).
pub(crate) fn solo_group(name: &str) -> Comm {
    Arc::new(
        LocalWorld::new(1)
            .communicator(name, vec![0], 0)
            .expect("rank 0 of a fresh world of one is a member, unclaimed"),
    )
}

/// The timeout of every call unless configured otherwise (the examples'
/// `--distributed-timeout-minutes` sets another).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A bound for the barriers around checkpoint I/O ([`Communicator::barrier_with_timeout`]):
/// writing or reading a large checkpoint on a slow file system may take far longer than any
/// collective should, and a healthy job must not die of it.
pub const CHECKPOINT_BARRIER_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// The end of a wait of `timeout` from some start. A timeout past what an [`Instant`] can
/// hold (`Duration::MAX` and its like) is no deadline at all, rather than an overflow
/// panic: such a wait is bounded only by the peers' failures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    /// The longest a caller sleeps at once when there is no deadline; it then looks again.
    const NAP: Duration = Duration::from_secs(3600);

    /// `timeout` after `start`.
    pub(crate) fn after(start: Instant, timeout: Duration) -> Self {
        Self(start.checked_add(timeout))
    }

    /// `timeout` from now.
    pub(crate) fn from_now(timeout: Duration) -> Self {
        Self::after(Instant::now(), timeout)
    }

    /// Whether `now` is at or past the deadline.
    pub(crate) fn passed(&self, now: Instant) -> bool {
        self.0.is_some_and(|d| now >= d)
    }

    /// How long from `now` until the deadline (zero once past); with no deadline, a long
    /// nap after which the caller checks again.
    pub(crate) fn left(&self, now: Instant) -> Duration {
        self.0
            .map_or(Self::NAP, |d| d.saturating_duration_since(now))
    }
}

/// A shared handle on a communicator, as layers and optimizers hold it.
pub type Comm = Arc<dyn Communicator>;

/// One rank's endpoint on a process group.
///
/// Peers and roots are group indices. Collectives must be called by every member in the
/// same order; point-to-point messages are ordered per (sender, receiver) pair.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// The group this communicator belongs to.
    fn group(&self) -> &ProcessGroup;

    /// The bound on every call.
    fn timeout(&self) -> Duration;

    /// Reduces `buf` element-wise over the group, in place. After an error its contents
    /// are unspecified (the threaded backend leaves it empty: the other ranks' threads may
    /// still have been using its memory, so it is leaked rather than freed).
    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError>;

    /// Concatenates every member's `input` in group order (all of the same length).
    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError>;

    /// [`Communicator::all_gather`] of a borrowed `input` into `out`, resized to the
    /// gathered length with its allocation kept where the backend can (the threaded one
    /// does): a caller gathering into the same buffer every step writes pages it already has
    /// instead of faulting in fresh ones, and keeps its input. After an error `out` is
    /// unspecified (the threaded backend leaves it empty, as [`Communicator::all_reduce`]
    /// its buffer). The default copies the input, gathers, then moves the result into
    /// `out`.
    fn all_gather_into(&self, input: &Buffer, out: &mut Buffer) -> Result<(), CommError> {
        *out = self.all_gather(input.clone())?;
        Ok(())
    }

    /// [`Communicator::all_gather`] where `buf` is the gathered buffer: it holds one piece
    /// per member (its length divisible by the group size), this member's at index
    /// `rank`, and on return every piece holds its member's. What ZeRO's parameter gather
    /// does: the threaded backend then moves each piece to the other members only,
    /// `(n − 1)/n` of the bytes an all-gather into a separate output writes. Members may mix
    /// this with [`Communicator::all_gather_into`] of their piece in one call. After an
    /// error `buf` is unspecified, as for [`Communicator::all_reduce`]. The default copies
    /// the piece out and gathers into `buf`.
    ///
    /// ```
    /// use burn_megatron::comm::{Buffer, Communicator, LocalWorld};
    /// let world = LocalWorld::new(2);
    /// let handles: Vec<_> = (0..2)
    ///     .map(|rank| {
    ///         let world = world.clone();
    ///         std::thread::spawn(move || {
    ///             let comm = world.communicator("dp", vec![0, 1], rank).unwrap();
    ///             // Each rank has written only its own piece.
    ///             let mut v = vec![0.0f32; 4];
    ///             v[2 * rank..2 * rank + 2].fill(rank as f32 + 1.0);
    ///             let mut buf = Buffer::from(v);
    ///             comm.all_gather_in_place(&mut buf).unwrap();
    ///             buf
    ///         })
    ///     })
    ///     .collect();
    /// for h in handles {
    ///     assert_eq!(h.join().unwrap(), Buffer::from(vec![1.0f32, 1.0, 2.0, 2.0]));
    /// }
    /// ```
    fn all_gather_in_place(&self, buf: &mut Buffer) -> Result<(), CommError> {
        let m = group::OpDesc::even_split(self.group(), "all_gather", buf.len())?;
        let piece = buf.slice(self.group().rank() * m..(self.group().rank() + 1) * m);
        self.all_gather_into(&piece, buf)
    }

    /// Reduces `input` over the group and returns this member's chunk: elements
    /// `[rank·len/n, (rank+1)·len/n)`. The length must be divisible by the group size.
    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CommError>;

    /// [`Communicator::reduce_scatter`] of a borrowed `input` into `out`, its allocation
    /// kept where the backend can, as [`Communicator::all_gather_into`]. `input` comes back
    /// unchanged; it is borrowed mutably so that the threaded backend can lend it to the
    /// other ranks' threads for the call (on an error it is left empty). The default copies
    /// the input, reduces, then moves the chunk into `out`.
    fn reduce_scatter_into(
        &self,
        input: &mut Buffer,
        op: ReduceOp,
        out: &mut Buffer,
    ) -> Result<(), CommError> {
        *out = self.reduce_scatter(input.clone(), op)?;
        Ok(())
    }

    /// Copies `buf` of member `root` into `buf` of every member.
    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError>;

    /// Sends `buf` to member `peer`. Never blocks on the receiver.
    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError>;

    /// Receives the next message from member `peer` into `buf`, whose dtype and length
    /// must match the message's.
    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError>;

    /// Sends to `to` and receives from `from` as one operation, which cannot deadlock when
    /// two neighbours both send first (NCCL's grouped send/recv).
    fn send_recv(
        &self,
        send: Buffer,
        to: usize,
        recv: &mut Buffer,
        from: usize,
    ) -> Result<(), CommError> {
        self.send(send, to)?;
        self.recv(recv, from)
    }

    /// Sends `send_counts[j]` consecutive elements of `input` to member `j`, in group
    /// order, and returns what the members sent this one, concatenated in group order:
    /// `recv_counts[i]` elements from member `i` (NCCL's and MPI's `all_to_all_v`, which
    /// mixture-of-experts token dispatch needs). Every member's counts and dtype are
    /// checked against the others' before any data moves: a count that does not match its
    /// peer's is an error on every member, naming both ranks.
    ///
    /// ```
    /// use burn_megatron::comm::{Buffer, Communicator, LocalWorld};
    /// let world = LocalWorld::new(2);
    /// let handles: Vec<_> = (0..2)
    ///     .map(|rank| {
    ///         let world = world.clone();
    ///         std::thread::spawn(move || {
    ///             let comm = world.communicator("ep", vec![0, 1], rank).unwrap();
    ///             // Rank 0 keeps one element and sends two; rank 1 sends one, keeps none.
    ///             let (input, send, recv) = match rank {
    ///                 0 => (vec![1.0f32, 2.0, 3.0], [1, 2], [1, 1]),
    ///                 _ => (vec![4.0f32], [1, 0], [2, 0]),
    ///             };
    ///             comm.all_to_all_v(Buffer::from(input), &send, &recv).unwrap()
    ///         })
    ///     })
    ///     .collect();
    /// let out: Vec<Buffer> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    /// assert_eq!(out, [Buffer::from(vec![1.0f32, 4.0]), Buffer::from(vec![2.0f32, 3.0])]);
    /// ```
    fn all_to_all_v(
        &self,
        input: Buffer,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Buffer, CommError> {
        all_to_all::all_to_all_v(self, input, send_counts, recv_counts)
    }

    /// Waits until every member has reached the barrier.
    fn barrier(&self) -> Result<(), CommError>;

    /// [`Communicator::barrier`] bounded by `timeout` instead of the communicator's
    /// timeout: for the barriers around checkpoint I/O, where a slow save is no failure
    /// (see [`CHECKPOINT_BARRIER_TIMEOUT`]). Every member must call this where the others
    /// do (it is the same collective as a barrier), and may pass another bound. The
    /// default is [`Communicator::barrier`], bounded by the communicator's own timeout, for
    /// wrappers that have no other; the library's backends all honour `timeout`.
    ///
    /// ```
    /// use burn_megatron::comm::{CHECKPOINT_BARRIER_TIMEOUT, Communicator, LocalWorld};
    /// let world = LocalWorld::new(1);
    /// let comm = world.communicator("solo", vec![0], 0).unwrap();
    /// comm.barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT).unwrap();
    /// ```
    fn barrier_with_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        let _ = timeout;
        self.barrier()
    }

    /// Opens the point-to-point channels to `peers` ahead of the first message, where the
    /// engine opens them on demand and opening one waits for the peer to open it too (NCCL:
    /// a pair's first message creates communicators for it). Each member names its own peers,
    /// symmetrically (if `a` names `b`, `b` names `a`), and the channels open in one order
    /// over the whole group, so a ring whose members all send first cannot wait on itself.
    /// Channels already open cost nothing. The default does nothing: the other engines need
    /// no channel per pair.
    fn connect(&self, peers: &[usize]) -> Result<(), CommError> {
        let _ = peers;
        Ok(())
    }

    /// The same collectives on device memory, where this communicator's engine has them
    /// (NCCL); `None` (the default) means data moves through host buffers.
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
}

/// Where communicators come from: the ranks of one job, whatever the engine.
///
/// Creating a group is collective over its members (MPI builds the communicator with
/// them): every member creates it, and members create their shared groups in the same
/// order.
pub trait World: Send + Sync + std::fmt::Debug {
    /// Number of ranks.
    fn size(&self) -> usize;

    /// The bound on every call of the communicators made here.
    fn timeout(&self) -> Duration;

    /// This rank's communicator on the group `name` over global `ranks`, in group order.
    fn new_group(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<Comm, CommError>;
}

impl World for LocalWorld {
    fn size(&self) -> usize {
        LocalWorld::size(self)
    }

    fn timeout(&self) -> Duration {
        LocalWorld::timeout(self)
    }

    fn new_group(
        &self,
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<Comm, CommError> {
        Ok(Arc::new(self.communicator(name, ranks, global_rank)?))
    }
}

/// Typed conveniences over [`Communicator`] for plain `Vec`s.
///
/// ```
/// use burn_megatron::comm::{CommunicatorExt, LocalWorld, ReduceOp};
/// let world = LocalWorld::new(1);
/// let comm = world.communicator("solo", vec![0], 0).unwrap();
/// let mut v = vec![1i64, 2];
/// comm.all_reduce_vec(&mut v, ReduceOp::Max).unwrap();
/// assert_eq!(v, vec![1, 2]);
/// ```
pub trait CommunicatorExt: Communicator {
    /// [`Communicator::all_reduce`] on a typed vector.
    fn all_reduce_vec<T: CommElement>(
        &self,
        v: &mut Vec<T>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let mut buf = T::into_buffer(std::mem::take(v));
        self.all_reduce(&mut buf, op)?;
        *v = T::from_buffer(buf).expect("all_reduce keeps the dtype");
        Ok(())
    }

    /// [`Communicator::all_gather`] on a typed vector.
    fn all_gather_vec<T: CommElement>(&self, v: Vec<T>) -> Result<Vec<T>, CommError> {
        let out = self.all_gather(T::into_buffer(v))?;
        Ok(T::from_buffer(out).expect("all_gather keeps the dtype"))
    }

    /// [`Communicator::reduce_scatter`] on a typed vector.
    fn reduce_scatter_vec<T: CommElement>(
        &self,
        v: Vec<T>,
        op: ReduceOp,
    ) -> Result<Vec<T>, CommError> {
        let out = self.reduce_scatter(T::into_buffer(v), op)?;
        Ok(T::from_buffer(out).expect("reduce_scatter keeps the dtype"))
    }

    /// Whether `flag` is set on any member: how the members of a collective step agree that
    /// one of them failed, so that every member returns an error rather than the others
    /// waiting on it.
    fn any_rank(&self, flag: bool) -> Result<bool, CommError> {
        let mut v = vec![i64::from(flag)];
        self.all_reduce_vec(&mut v, ReduceOp::Max)?;
        Ok(v[0] != 0)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
