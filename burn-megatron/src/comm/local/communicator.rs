//! The collectives and point-to-point calls of [`LocalCommunicator`], on the slot protocol
//! of the parent module: large reductions and gathers work on buffers the members lend
//! each other for the call (see [`super::super::lend`]).

use super::LocalCommunicator;
use crate::comm::buffer::Buffer;
use crate::comm::group::{CommError, OpDesc, ProcessGroup};
use crate::comm::lend::{self, Lent};
use crate::comm::reduce::{ReduceOp, chunk_range};
use crate::comm::{Communicator, lock};
use std::time::{Duration, Instant};

/// Bytes of its input an all-gather member copies to every output before the next block:
/// the block stays in L2 between the copies.
const GATHER_BLOCK: usize = 128 << 10;

impl Communicator for LocalCommunicator {
    fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn timeout(&self) -> Duration {
        self.shared.world.timeout
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError> {
        let (me, n, len) = (self.group.rank(), self.group.size(), buf.len());
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("all_reduce", buf)
        };
        // Every member folds its chunk of all the buffers and writes the result into that
        // chunk of each: every element is read once and written once per member, in place.
        self.lend(desc, buf, |lent| {
            // SAFETY: lent until every member released the call; chunk `me` of each is
            // this member's alone.
            unsafe { lend::reduce_in_place(lent, chunk_range(len, n, me), op) };
        })
    }

    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError> {
        let mut out = Buffer::with_capacity(input.dtype(), 0);
        self.all_gather_into(&input, &mut out)?;
        Ok(out)
    }

    fn all_gather_into(&self, input: &Buffer, out: &mut Buffer) -> Result<(), CommError> {
        let (me, n) = (self.group.rank(), self.group.size());
        // Every member lends its output and writes its input into its place in each.
        out.resize_for(input.dtype(), n * input.len());
        let desc = OpDesc::data("all_gather", input);
        self.lend(desc, out, |lent| {
            // SAFETY: lent until every member released the call; piece `me` of each output
            // is this member's alone.
            unsafe { write_piece(lent, me, input.bytes(), None) }
        })
    }

    fn all_gather_in_place(&self, buf: &mut Buffer) -> Result<(), CommError> {
        let piece = OpDesc::even_split(&self.group, "all_gather", buf.len())?;
        let (me, dtype) = (self.group.rank(), buf.dtype());
        // The call of a member that gathers into a separate output (the same description):
        // that member writes its piece into every lent buffer, this one into every other.
        let desc = OpDesc {
            len: piece,
            ..OpDesc::data("all_gather", buf)
        };
        self.lend(desc, buf, |lent| {
            let size = piece * dtype.size();
            // SAFETY: lent until every member released the call; piece `me` of each buffer
            // is this member's alone, to read in its own and to write in the others.
            unsafe {
                let own = lent[me].bytes(me * size, size);
                write_piece(lent, me, own, Some(me));
            }
        })
    }

    fn reduce_scatter(&self, mut input: Buffer, op: ReduceOp) -> Result<Buffer, CommError> {
        let mut out = Buffer::with_capacity(input.dtype(), 0);
        self.reduce_scatter_into(&mut input, op, &mut out)?;
        Ok(out)
    }

    fn reduce_scatter_into(
        &self,
        input: &mut Buffer,
        op: ReduceOp,
        out: &mut Buffer,
    ) -> Result<(), CommError> {
        let chunk = OpDesc::even_split(&self.group, "reduce_scatter", input.len())?;
        let (me, n, dtype) = (self.group.rank(), self.group.size(), input.dtype());
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("reduce_scatter", input)
        };
        // Every member lends its input and folds its own chunk of all of them.
        self.lend(desc, input, |lent| {
            let stream = chunk * n * dtype.size() >= lend::STREAM_FROM;
            let range = me * chunk..(me + 1) * chunk;
            // SAFETY: lent until every member released the call; nobody writes it.
            unsafe { lend::reduce_into(lent, range, op, out, stream) };
        })
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError> {
        self.group.check_peer("broadcast", root)?;
        let desc = OpDesc {
            root: Some(root),
            ..OpDesc::data("broadcast", buf)
        };
        let me = self.group.rank();
        let input = (me == root).then(|| buf.clone());
        let (seq, inputs) = self.arrive(desc, input)?;
        self.finish(seq);
        if me != root
            && let Some(data) = &inputs[root]
        {
            *buf = data.as_ref().clone();
        }
        Ok(())
    }

    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError> {
        self.group.check_peer("send", peer)?;
        let mut state = lock(&self.shared.state);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        state
            .mailboxes
            .entry((self.group.rank(), peer))
            .or_default()
            .push_back(buf);
        self.shared.notify();
        Ok(())
    }

    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError> {
        self.group.check_peer("recv", peer)?;
        let key = (peer, self.group.rank());
        let state = lock(&self.shared.state);
        let mut state = self.wait(
            state,
            "recv",
            0,
            Instant::now(),
            self.shared.world.timeout,
            |s| s.mailboxes.get(&key).is_some_and(|q| !q.is_empty()),
            |_| vec![peer],
        )?;
        let msg = state
            .mailboxes
            .get_mut(&key)
            .and_then(|q| q.pop_front())
            .expect("wait returned with a message queued");
        if msg.dtype() != buf.dtype() || msg.len() != buf.len() {
            let err = CommError::Mismatch {
                group: self.shared.label.clone(),
                seq: 0,
                detail: format!(
                    "global rank {} sent {} × {}, global rank {} expected {} × {}",
                    self.shared.ranks[peer],
                    msg.dtype(),
                    msg.len(),
                    self.group.global_rank(),
                    buf.dtype(),
                    buf.len()
                ),
            };
            state.poisoned = Some(err.clone());
            self.shared.notify();
            return Err(err);
        }
        *buf = msg;
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.barrier_with_timeout(self.shared.world.timeout)
    }

    fn barrier_with_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        let (seq, _, _) = self.arrive_with(OpDesc::BARRIER, None, None, timeout)?;
        self.finish(seq);
        Ok(())
    }
}

/// Writes `piece` (member `me`'s) into its place in every lent buffer but `skip`, a block
/// at a time: each block is read once, then written to every buffer from L2.
///
/// # Safety
/// The buffers are lent for the call, each at least `(me + 1) · piece.len()` bytes, and
/// no other thread accesses piece `me` of those written meanwhile.
unsafe fn write_piece(lent: &[Lent], me: usize, piece: &[u8], skip: Option<usize>) {
    let stream = piece.len() * lent.len() >= lend::STREAM_FROM;
    for (b, block) in piece.chunks(GATHER_BLOCK).enumerate() {
        let at = me * piece.len() + b * GATHER_BLOCK;
        for (i, out) in lent.iter().enumerate() {
            if Some(i) != skip {
                // SAFETY: in bounds and exclusive per the caller.
                unsafe { out.write_bytes(at, block, stream) };
            }
        }
    }
    lend::fence();
}
