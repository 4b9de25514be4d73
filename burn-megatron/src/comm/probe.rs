//! A communicator that shows each call it passes on: to count what a layout sends, or to pace
//! a benchmark's collectives as a network would.

use super::{Buffer, Comm, CommError, Communicator, DeviceCollectives, ProcessGroup, ReduceOp};
use std::time::Duration;

/// One call a [`Probed`] communicator passes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommCall {
    /// The operation, by the [`Communicator`] method's name: `all_reduce`, `all_gather`,
    /// `reduce_scatter`, `broadcast`, `send`, `recv`, `all_to_all_v`, `barrier` or
    /// `connect` (the `_into` and `_in_place` forms report their collective's name;
    /// `send_recv` is a `send` then a `recv`; `connect` is one call per peer, moving no
    /// elements).
    pub op: &'static str,
    /// The elements this member hands to the call (for `recv`, the ones it takes; for
    /// `all_gather_in_place`, its own piece's).
    pub elements: usize,
    /// Those elements' bytes.
    pub bytes: usize,
    /// The member sent to, received from or connected to (`None` for a collective).
    pub peer: Option<usize>,
}

impl CommCall {
    fn of(op: &'static str, buf: &Buffer) -> Self {
        Self::sized(op, buf.len(), buf.len() * buf.dtype().size())
    }

    fn sized(op: &'static str, elements: usize, bytes: usize) -> Self {
        Self {
            op,
            elements,
            bytes,
            peer: None,
        }
    }

    fn to(self, peer: usize) -> Self {
        Self {
            peer: Some(peer),
            ..self
        }
    }
}

type Hook = Box<dyn Fn(CommCall) + Send + Sync>;

/// `inner`, calling `hook` before each call it passes on to it, on the calling thread.
///
/// Calls on device memory (NCCL's [`DeviceCollectives`], which `comm::tensor` takes for CUDA
/// tensors) go to `inner`'s device collectives unseen.
///
/// ```
/// use burn_megatron::comm::{Buffer, Comm, Communicator, LocalWorld, Probed, ReduceOp};
/// use std::sync::{Arc, Mutex};
/// let world = LocalWorld::new(1);
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let log = seen.clone();
/// let solo: Comm = Arc::new(world.communicator("tp", vec![0], 0).unwrap());
/// let comm = Probed::new(solo, move |call| log.lock().unwrap().push((call.op, call.bytes)));
/// let mut buf = Buffer::from(vec![1.0f32; 3]);
/// comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
/// assert_eq!(*seen.lock().unwrap(), [("all_reduce", 12)]);
/// ```
pub struct Probed {
    inner: Comm,
    hook: Hook,
}

impl Probed {
    /// `inner`, with `hook` called before each of its calls.
    pub fn new(inner: Comm, hook: impl Fn(CommCall) + Send + Sync + 'static) -> Self {
        Self {
            inner,
            hook: Box::new(hook),
        }
    }
}

impl std::fmt::Debug for Probed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probed")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Communicator for Probed {
    fn group(&self) -> &ProcessGroup {
        self.inner.group()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError> {
        (self.hook)(CommCall::of("all_reduce", buf));
        self.inner.all_reduce(buf, op)
    }

    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError> {
        (self.hook)(CommCall::of("all_gather", &input));
        self.inner.all_gather(input)
    }

    fn all_gather_into(&self, input: &Buffer, out: &mut Buffer) -> Result<(), CommError> {
        (self.hook)(CommCall::of("all_gather", input));
        self.inner.all_gather_into(input, out)
    }

    fn all_gather_in_place(&self, buf: &mut Buffer) -> Result<(), CommError> {
        let n = self.group().size().max(1);
        let call = CommCall::of("all_gather", buf);
        (self.hook)(CommCall::sized(call.op, call.elements / n, call.bytes / n));
        self.inner.all_gather_in_place(buf)
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CommError> {
        (self.hook)(CommCall::of("reduce_scatter", &input));
        self.inner.reduce_scatter(input, op)
    }

    fn reduce_scatter_into(
        &self,
        input: &mut Buffer,
        op: ReduceOp,
        out: &mut Buffer,
    ) -> Result<(), CommError> {
        (self.hook)(CommCall::of("reduce_scatter", input));
        self.inner.reduce_scatter_into(input, op, out)
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError> {
        (self.hook)(CommCall::of("broadcast", buf));
        self.inner.broadcast(buf, root)
    }

    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError> {
        (self.hook)(CommCall::of("send", &buf).to(peer));
        self.inner.send(buf, peer)
    }

    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError> {
        (self.hook)(CommCall::of("recv", buf).to(peer));
        self.inner.recv(buf, peer)
    }

    fn send_recv(
        &self,
        send: Buffer,
        to: usize,
        recv: &mut Buffer,
        from: usize,
    ) -> Result<(), CommError> {
        (self.hook)(CommCall::of("send", &send).to(to));
        (self.hook)(CommCall::of("recv", recv).to(from));
        self.inner.send_recv(send, to, recv, from)
    }

    fn all_to_all_v(
        &self,
        input: Buffer,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Buffer, CommError> {
        (self.hook)(CommCall::of("all_to_all_v", &input));
        self.inner.all_to_all_v(input, send_counts, recv_counts)
    }

    fn barrier(&self) -> Result<(), CommError> {
        (self.hook)(CommCall::sized("barrier", 0, 0));
        self.inner.barrier()
    }

    fn barrier_with_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        (self.hook)(CommCall::sized("barrier", 0, 0));
        self.inner.barrier_with_timeout(timeout)
    }

    fn connect(&self, peers: &[usize]) -> Result<(), CommError> {
        for &peer in peers {
            (self.hook)(CommCall::sized("connect", 0, 0).to(peer));
        }
        self.inner.connect(peers)
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.inner.device_collectives()
    }
}
