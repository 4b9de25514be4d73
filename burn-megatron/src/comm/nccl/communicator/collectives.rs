//! [`Communicator`] for [`NcclCommunicator`]: each operation agreed on by its header, then
//! run on the host path (copied to the GPU and back) or as point-to-point messages.

use super::*;

impl Communicator for NcclCommunicator {
    fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn timeout(&self) -> Duration {
        self.world.timeout
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError> {
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("all_reduce", buf)
        };
        let (dtype, len) = (nccl_dtype(buf.dtype()), buf.len());
        let out = self.host_op(desc, buf.bytes(), buf.bytes().len(), |s, r, c, st| {
            // SAFETY: device buffers of `len` elements, live until the wait.
            unsafe {
                self.world
                    .nccl
                    .all_reduce(s as _, r as _, len, dtype, nccl_op(op), c, st)
            }
        })?;
        buf.bytes_mut().copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError> {
        let n = self.group.size();
        let (dtype, len, bytes) = (input.dtype(), input.len(), input.bytes());
        let desc = OpDesc::data("all_gather", &input);
        let out = self.host_op(desc, bytes, n * bytes.len(), |s, r, c, st| {
            // SAFETY: `len` elements in, `n · len` out, live until the wait.
            unsafe {
                self.world
                    .nccl
                    .all_gather(s as _, r as _, len, nccl_dtype(dtype), c, st)
            }
        })?;
        let mut gathered = Buffer::zeros(dtype, n * len);
        gathered.bytes_mut().copy_from_slice(&out);
        Ok(gathered)
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CommError> {
        let m = OpDesc::even_split(&self.group, "reduce_scatter", input.len())?;
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("reduce_scatter", &input)
        };
        let dtype = input.dtype();
        let (nd, nop) = (nccl_dtype(dtype), nccl_op(op));
        let out = self.host_op(desc, input.bytes(), m * dtype.size(), |s, r, c, st| {
            // SAFETY: `n · m` elements in, `m` out, live until the wait.
            unsafe {
                self.world
                    .nccl
                    .reduce_scatter(s as _, r as _, m, nd, nop, c, st)
            }
        })?;
        let mut mine = Buffer::zeros(dtype, m);
        mine.bytes_mut().copy_from_slice(&out);
        Ok(mine)
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError> {
        self.group.check_peer("broadcast", root)?;
        let desc = OpDesc {
            root: Some(root),
            ..OpDesc::data("broadcast", buf)
        };
        let (dtype, len) = (nccl_dtype(buf.dtype()), buf.len());
        let out = self.host_op(desc, buf.bytes(), buf.bytes().len(), |s, r, c, st| {
            // SAFETY: device buffers of `len` elements, live until the wait.
            unsafe {
                self.world
                    .nccl
                    .broadcast(s as _, r as _, len, dtype, root as i32, c, st)
            }
        })?;
        buf.bytes_mut().copy_from_slice(&out);
        Ok(())
    }

    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError> {
        self.reap()?;
        self.group.check_peer("send", peer)?;
        if peer == self.group.rank() {
            lock(&self.to_self).push_back(buf);
            return Ok(());
        }
        self.send_message(peer, buf.dtype(), buf.len(), |stream| {
            let copy = if buf.is_empty() {
                stream.alloc_zeros::<u8>(1)
            } else {
                stream.clone_htod(buf.bytes())
            };
            copy.map(Payload::Copied)
                .map_err(|e| self.engine("send", e))
        })
    }

    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError> {
        self.reap()?;
        self.group.check_peer("recv", peer)?;
        if peer == self.group.rank() {
            let Some(got) = lock(&self.to_self).pop_front() else {
                return Err(self.invalid("recv", "no message from this member to itself".into()));
            };
            if got.dtype() != buf.dtype() || got.len() != buf.len() {
                return Err(self.invalid(
                    "recv",
                    format!(
                        "this member sent itself {} × {}, and expects {} × {}",
                        got.dtype(),
                        got.len(),
                        buf.dtype(),
                        buf.len()
                    ),
                ));
            }
            *buf = got;
            return Ok(());
        }
        let pair = self.pair("recv", peer)?;
        let link = &pair.inn;
        let _serial = lock(&link.lock);
        self.take_header(link, peer, buf.dtype(), buf.len())?;
        let payload = self.recv_bytes(link, buf.bytes().len())?;
        buf.bytes_mut().copy_from_slice(&payload);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.barrier_with_timeout(self.world.timeout)
    }

    /// The header exchange is the barrier; it waits up to `timeout`.
    fn barrier_with_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        self.collective_within(OpDesc::BARRIER, timeout, |_, _| Ok(()))
    }

    fn send_recv(
        &self,
        send: Buffer,
        to: usize,
        recv: &mut Buffer,
        from: usize,
    ) -> Result<(), CommError> {
        // Both pairs open first, in the group's order: opening `to`'s at the send would
        // make a ring of three or more wait on itself (each member on its next).
        self.connect(&[to, from])?;
        Communicator::send(self, send, to)?;
        Communicator::recv(self, recv, from)
    }

    fn connect(&self, peers: &[usize]) -> Result<(), CommError> {
        let me = self.group.rank();
        for &peer in peers {
            self.group.check_peer("connect", peer)?;
        }
        for peer in super::super::pairs::pair_order(me, peers) {
            self.pair("connect", peer)?;
        }
        Ok(())
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}
