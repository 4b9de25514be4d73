//! A flat tensor written on one thread and reduced on another: the overlapped data-parallel
//! reduction's buckets, filled by backward on the rank's thread and reduced by its worker.
//!
//! On CUDA over NCCL the bucket is reduced in place, in device memory. CubeCL queues each
//! thread's kernels on a stream of that thread, so the worker could not order NCCL after the
//! kernels that filled the bucket by itself: the writing thread marks its stream and takes the
//! buffer's device address when it hands the bucket over, and the worker makes NCCL's stream
//! wait for that mark right before its collective (queued at the handover, a later bucket's
//! wait would hold up an earlier bucket's collective); it calls nothing but NCCL.
//! Everywhere else the worker reads the bucket into host memory and reduces it there, and the
//! owner turns the result back into a tensor when it takes it.

use super::tensor::{buffer_to_tensor, tensor_to_buffer};
use super::{Buffer, CommError, Communicator, ReduceOp};
use burn::tensor::{Device, Tensor};
use std::ops::Range;

/// A flat tensor ready to be reduced from any thread (see the module documentation).
pub(crate) struct Handoff(Path);

enum Path {
    /// Device memory the communicator's device collectives reduce in place.
    #[cfg(feature = "cuda")]
    Device(super::cuda_tensor::InPlace),
    /// Reduced through host memory.
    Host(Tensor<1>),
}

/// A reduced tensor (or this member's part of it), for the thread that owns the bucket.
pub(crate) enum Reduced {
    /// A tensor whose `range` is the result (the bucket reduced in place, or not reduced at
    /// all in a group of one). Boxed: a tensor is large beside a buffer.
    Tensor(Box<Tensor<1>>, Range<usize>),
    /// Reduced in host memory.
    Host(Buffer),
}

impl std::fmt::Debug for Reduced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reduced::Tensor(_, range) => write!(f, "Reduced::Tensor({range:?})"),
            Reduced::Host(buf) => write!(f, "Reduced::Host({} elements)", buf.len()),
        }
    }
}

impl Reduced {
    /// The result as a tensor on `device` (the bucket's).
    pub(crate) fn into_tensor(self, device: &Device) -> Tensor<1> {
        match self {
            Reduced::Tensor(t, range) if range.len() == t.dims()[0] => *t,
            Reduced::Tensor(t, range) => t.narrow(0, range.start, range.len()),
            Reduced::Host(buf) => {
                let n = buf.len();
                buffer_to_tensor(buf, [n], device)
            }
        }
    }
}

impl Handoff {
    /// Takes `flat` over on the thread whose kernels wrote it. Whatever happens, the result
    /// is reduced on one path or the other, so that every member takes part in the
    /// collective.
    pub(crate) fn new(comm: &(impl Communicator + ?Sized), flat: Tensor<1>) -> Self {
        #[cfg(feature = "cuda")]
        if let Some(dev) = comm.device_collectives()
            && comm.group().size() > 1
        {
            let group = comm.group().to_string();
            return Self(match super::cuda_tensor::InPlace::new(dev, &group, flat) {
                Ok(in_place) => Path::Device(in_place),
                Err(flat) => Path::Host(*flat),
            });
        }
        let _ = comm;
        Self(Path::Host(flat))
    }

    /// Reduces the tensor over the group: every member gets the whole result, or with
    /// `scatter` only its block (the tensor's length split evenly over the group, in group
    /// order).
    pub(crate) fn reduce(
        self,
        comm: &(impl Communicator + ?Sized),
        op: ReduceOp,
        scatter: bool,
    ) -> Result<Reduced, CommError> {
        match self.0 {
            #[cfg(feature = "cuda")]
            Path::Device(d) if scatter => d.reduce_scatter(comm, op),
            #[cfg(feature = "cuda")]
            Path::Device(d) => d.all_reduce(comm, op),
            Path::Host(t) if scatter => {
                let buf = tensor_to_buffer(comm, "reduce_scatter", t)?;
                Ok(Reduced::Host(comm.reduce_scatter(buf, op)?))
            }
            Path::Host(t) => {
                let mut buf = tensor_to_buffer(comm, "all_reduce", t)?;
                comm.all_reduce(&mut buf, op)?;
                Ok(Reduced::Host(buf))
            }
        }
    }
}
