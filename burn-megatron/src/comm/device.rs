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
/// Implementors read `send` and write `recv` only for the duration of the call. Callers
/// pass addresses of live allocations on [`ordinal`](Self::ordinal) holding at least `len`
/// elements, whose producing kernels have completed, and do not touch `recv` until the call
/// returns.
pub unsafe trait DeviceCollectives: Send + Sync {
    /// The CUDA device this communicator's buffers must live on.
    fn ordinal(&self) -> usize;

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
}
