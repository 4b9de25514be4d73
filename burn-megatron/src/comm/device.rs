//! Collectives on device memory, for communicators whose engine reads and writes GPU
//! buffers itself (NCCL). The tensor-parallel mappings use them for Burn's CUDA tensors, so
//! activations and gradients never leave the GPU; every other backend and communicator moves
//! host [`Buffer`](super::Buffer)s.

use super::{CommDType, CommError, ReduceOp};

/// A device address with the element type and count it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    /// The address (a `CUdeviceptr` on CUDA).
    pub ptr: u64,
    /// The element type.
    pub dtype: CommDType,
    /// Number of elements.
    pub len: usize,
}

/// The [`Communicator`](super::Communicator) operations on device memory of the CUDA device
/// [`ordinal`](Self::ordinal). Each call returns once the result is in place, and is bounded
/// by the communicator's timeout; the same mismatch checks hold as for host buffers.
///
/// # Safety
///
/// Implementors read `send` and write `recv` only for the duration of the call, on
/// [`stream`](Self::stream). Callers pass addresses of live allocations on
/// [`ordinal`](Self::ordinal) holding at least `len` elements, whose producing kernels have
/// completed or are ordered before work queued next on [`stream`](Self::stream), and do not
/// touch `recv` until the call returns.
pub unsafe trait DeviceCollectives: Send + Sync {
    /// The CUDA device this communicator's buffers must live on.
    fn ordinal(&self) -> usize;

    /// The CUDA stream the collectives are queued on (a `CUstream`, as an address): callers
    /// may order the kernels producing `send` before it rather than wait for them.
    fn stream(&self) -> usize;

    /// [`Communicator::all_reduce`](super::Communicator::all_reduce) from `send` into
    /// `recv` (same dtype and length; they may be the same slice).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_reduce(
        &self,
        send: DeviceSlice,
        recv: DeviceSlice,
        op: ReduceOp,
    ) -> Result<(), CommError>;

    /// [`Communicator::all_gather`](super::Communicator::all_gather): `recv` holds
    /// `group size × send.len` elements.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_gather(&self, send: DeviceSlice, recv: DeviceSlice) -> Result<(), CommError>;

    /// [`Communicator::reduce_scatter`](super::Communicator::reduce_scatter): `recv` holds
    /// `send.len / group size` elements.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn reduce_scatter(
        &self,
        send: DeviceSlice,
        recv: DeviceSlice,
        op: ReduceOp,
    ) -> Result<(), CommError>;

    /// [`Communicator::send`](super::Communicator::send) of `send` to group member `peer`
    /// (not this member), in the same message format, so the peer may receive it into host or
    /// device memory. Returns once the send is queued, like the host call: it does not wait
    /// for the receiver. `order(stream)` is called with the CUDA stream the data is read on
    /// before anything is queued there, for the caller to order its producers before it.
    ///
    /// # Safety
    /// `send` is as the trait says, except that it must stay valid until the send completes:
    /// the implementor holds `keep` (the caller's owner of that memory) until then.
    unsafe fn send(
        &self,
        send: DeviceSlice,
        peer: usize,
        keep: Box<dyn std::any::Any + Send>,
        order: &dyn Fn(usize) -> Result<(), String>,
    ) -> Result<(), CommError>;

    /// [`Communicator::recv`](super::Communicator::recv) into `recv` from group member `peer`
    /// (not this member): a message of another dtype or length is an error (and is consumed).
    /// Returns once the data is in place. `order(stream)` is called with the stream that
    /// writes `recv` before it does, as for [`send`](Self::send).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn recv(
        &self,
        recv: DeviceSlice,
        peer: usize,
        order: &dyn Fn(usize) -> Result<(), String>,
    ) -> Result<(), CommError>;
}
