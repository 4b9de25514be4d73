//! The [`DeviceCollectives`] of an [`NcclCommunicator`]: the caller's device buffers handed
//! to NCCL, with the same header check and deadline as the host calls.

use super::super::group::{CommError, OpDesc};
use super::super::{DeviceCollectives, DeviceSlice, ReduceOp, lock};
use super::communicator::{BYTE, NcclCommunicator, nccl_dtype, nccl_op};
use super::library::NcclResult;
use super::message::Payload;
use cudarc::nccl::sys;

impl NcclCommunicator {
    fn check_device(&self, op: &'static str, s: &[DeviceSlice]) -> Result<(), CommError> {
        if s.windows(2).any(|w| w[0].dtype != w[1].dtype) {
            return Err(self.invalid(op, "send and receive dtypes differ".into()));
        }
        Ok(())
    }

    /// Enqueues a collective on device memory and waits for it.
    fn device_op(
        &self,
        desc: OpDesc,
        enqueue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> NcclResult,
    ) -> Result<(), CommError> {
        let op = desc.op;
        self.collective(desc, |seq, comm| {
            self.queue(op, || enqueue(comm, self.link.stream.cu_stream() as _))
                .map_err(|e| self.engine(op, e))?;
            self.wait(&self.link, op, seq)
        })
    }
}

/// What a device collective of `send` asks for: as the host call with that buffer, so device
/// and host calls check against each other.
fn device_desc(op: &'static str, send: DeviceSlice, reduce: Option<ReduceOp>) -> OpDesc {
    OpDesc {
        op,
        dtype: Some(send.dtype),
        len: send.len,
        reduce,
        root: None,
    }
}

// SAFETY: every call queues its NCCL work on the link's stream (`stream`) and waits for it
// before returning, so `send` is read and `recv` written only during the call.
unsafe impl DeviceCollectives for NcclCommunicator {
    fn ordinal(&self) -> usize {
        self.world.ctx.ordinal()
    }

    fn stream(&self) -> usize {
        self.link.stream.cu_stream() as usize
    }

    unsafe fn send(
        &self,
        send: DeviceSlice,
        peer: usize,
        keep: Box<dyn std::any::Any + Send>,
        order: &dyn Fn(usize) -> Result<(), String>,
    ) -> Result<(), CommError> {
        self.reap()?;
        self.group.check_peer("send", peer)?;
        if peer == self.group.rank() {
            return Err(self.invalid("send", "a device send to this member itself".into()));
        }
        self.send_message(peer, send.dtype, send.len, |stream| {
            order(stream.cu_stream() as usize).map_err(|e| self.engine("send", e))?;
            // `keep` holds `send` in place until the event completes (see the trait).
            Ok(Payload::Borrowed {
                ptr: send.ptr,
                _keep: keep,
            })
        })
    }

    unsafe fn recv(
        &self,
        recv: DeviceSlice,
        peer: usize,
        order: &dyn Fn(usize) -> Result<(), String>,
    ) -> Result<(), CommError> {
        self.reap()?;
        self.group.check_peer("recv", peer)?;
        if peer == self.group.rank() {
            return Err(self.invalid("recv", "a device receive from this member itself".into()));
        }
        let pair = self.pair("recv", peer)?;
        let link = &pair.inn;
        let _serial = lock(&link.lock);
        self.take_header(link, peer, recv.dtype, recv.len)?;
        let comm = self.handle(link, "recv")?;
        order(link.stream.cu_stream() as usize).map_err(|e| self.engine("recv", e))?;
        let nbytes = recv.len * recv.dtype.size();
        // SAFETY: the caller's slice (see the trait), written only until the wait below.
        self.queue("recv", || unsafe {
            self.world.nccl.recv(
                recv.ptr as _,
                nbytes,
                BYTE,
                0,
                comm,
                link.stream.cu_stream() as _,
            )
        })
        .map_err(|e| self.engine("recv", e))?;
        self.wait(link, "recv", 0)
    }

    unsafe fn all_reduce(
        &self,
        send: DeviceSlice,
        recv: DeviceSlice,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.check_device("all_reduce", &[send, recv])?;
        if send.len != recv.len {
            return Err(self.invalid("all_reduce", "send and receive lengths differ".into()));
        }
        let desc = device_desc("all_reduce", send, Some(op));
        self.device_op(desc, |c, st| {
            // SAFETY: the caller's slices (see the trait).
            unsafe {
                self.world.nccl.all_reduce(
                    send.ptr as _,
                    recv.ptr as _,
                    send.len,
                    nccl_dtype(send.dtype),
                    nccl_op(op),
                    c,
                    st,
                )
            }
        })
    }

    unsafe fn all_gather(&self, send: DeviceSlice, recv: DeviceSlice) -> Result<(), CommError> {
        self.check_device("all_gather", &[send, recv])?;
        if recv.len != send.len * self.group.size() {
            return Err(self.invalid("all_gather", "recv must hold size × send elements".into()));
        }
        let desc = device_desc("all_gather", send, None);
        self.device_op(desc, |c, st| {
            // SAFETY: the caller's slices (see the trait).
            unsafe {
                self.world.nccl.all_gather(
                    send.ptr as _,
                    recv.ptr as _,
                    send.len,
                    nccl_dtype(send.dtype),
                    c,
                    st,
                )
            }
        })
    }

    unsafe fn reduce_scatter(
        &self,
        send: DeviceSlice,
        recv: DeviceSlice,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.check_device("reduce_scatter", &[send, recv])?;
        let m = OpDesc::even_split(&self.group, "reduce_scatter", send.len)?;
        if recv.len != m {
            return Err(self.invalid(
                "reduce_scatter",
                "recv must hold send / size elements".into(),
            ));
        }
        let desc = device_desc("reduce_scatter", send, Some(op));
        self.device_op(desc, |c, st| {
            // SAFETY: the caller's slices (see the trait).
            unsafe {
                self.world.nccl.reduce_scatter(
                    send.ptr as _,
                    recv.ptr as _,
                    m,
                    nccl_dtype(send.dtype),
                    nccl_op(op),
                    c,
                    st,
                )
            }
        })
    }
}
