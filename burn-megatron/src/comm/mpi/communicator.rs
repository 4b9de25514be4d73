//! One process's communicator on one group: header-checked collectives over byte moves,
//! folded on the host in group order, and non-blocking point-to-point messages.

use super::super::header::{code, decode, encode, mismatch};
use super::{Inner, Raw, Watch};
use crate::comm::Communicator;
use crate::comm::buffer::{Buffer, CommDType};
use crate::comm::group::{CommError, OpDesc, ProcessGroup};
use crate::comm::lock;
use crate::comm::reduce::{ReduceOp, chunk_range, reduce_pieces};
use mpi::datatype::PartitionMut;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::request::{Request, Scope, scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const HEADER_TAG: i32 = 1;
const P2P_TAG: i32 = 2;
const PIECE_TAG: i32 = 3;

#[derive(Default)]
struct OpState {
    seq: u64,
    poisoned: Option<CommError>,
}

/// A message on its way out: MPI reads `header` and `payload` until the requests complete.
struct PendingSend {
    requests: Raw<[ffi::MPI_Request; 2]>,
    _header: Box<[i64; 2]>,
    _payload: Buffer,
    peer: usize,
}

/// One process's handle on one group of an [`MpiWorld`](super::MpiWorld).
pub struct MpiCommunicator {
    /// Freed at drop unless MPI is finalised by then.
    comm: std::mem::ManuallyDrop<Raw<SimpleCommunicator>>,
    group: ProcessGroup,
    label: String,
    /// Held through each collective and receive.
    ops: Mutex<OpState>,
    sends: Mutex<Vec<PendingSend>>,
    world: Arc<Inner>,
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("group", &self.label)
            .finish_non_exhaustive()
    }
}

impl MpiCommunicator {
    pub(crate) fn new(comm: SimpleCommunicator, group: ProcessGroup, world: Arc<Inner>) -> Self {
        Self {
            comm: std::mem::ManuallyDrop::new(Raw(comm)),
            label: group.to_string(),
            group,
            ops: Mutex::new(OpState::default()),
            sends: Mutex::new(Vec::new()),
            world,
        }
    }

    fn invalid(&self, op: &'static str, reason: String) -> CommError {
        CommError::InvalidArgument {
            group: self.label.clone(),
            op,
            reason,
        }
    }

    fn others(&self) -> Vec<usize> {
        let me = self.group.global_rank();
        self.group
            .ranks()
            .iter()
            .copied()
            .filter(|&r| r != me)
            .collect()
    }

    /// MPI counts are `int`s.
    fn count(&self, op: &'static str, bytes: usize) -> Result<i32, CommError> {
        i32::try_from(bytes).map_err(|_| {
            self.invalid(
                op,
                format!("{bytes} bytes exceed MPI's count limit of 2^31 - 1; split the buffer"),
            )
        })
    }

    /// Polls `requests` (each with the global ranks it waits for) until all complete, or
    /// aborts the job at the deadline naming the ranks still awaited.
    fn wait<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        op: &'static str,
        seq: u64,
        requests: Vec<(Vec<usize>, Request<'a, D, S>)>,
    ) {
        self.wait_within(op, seq, requests, self.world.timeout);
    }

    /// [`Self::wait`] with the deadline `timeout` from now.
    fn wait_within<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        op: &'static str,
        seq: u64,
        requests: Vec<(Vec<usize>, Request<'a, D, S>)>,
        timeout: Duration,
    ) {
        Watch::within(&self.world, &self.label, op, seq, timeout)
            .complete(requests, || self.progress_sends());
    }

    /// Swaps headers with every other member and checks they all describe the same call.
    /// Also a barrier: it returns once every member has sent its header.
    fn agree(&self, state: &mut OpState, desc: OpDesc) -> Result<u64, CommError> {
        self.agree_within(state, desc, self.world.timeout)
    }

    /// [`Self::agree`] bounded by `timeout`.
    fn agree_within(
        &self,
        state: &mut OpState,
        desc: OpDesc,
        timeout: Duration,
    ) -> Result<u64, CommError> {
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let seq = state.seq;
        state.seq += 1;
        let (n, me) = (self.group.size(), self.group.rank());
        if n == 1 {
            return Ok(seq);
        }
        let mine = encode(&desc, seq);
        let mut theirs = vec![mine; n];
        scope(|sc| {
            let mut requests = Vec::new();
            for (i, slot) in theirs.iter_mut().enumerate().filter(|(i, _)| *i != me) {
                let peer = self.comm.0.process_at_rank(i as i32);
                let who = vec![self.group.global_rank_of(i)];
                let recv = peer.immediate_receive_into_with_tag(sc, &mut slot[..], HEADER_TAG);
                requests.push((who.clone(), recv));
                requests.push((who, peer.immediate_send_with_tag(sc, &mine[..], HEADER_TAG)));
            }
            self.wait_within(desc.op, seq, requests, timeout);
        });
        if theirs.iter().any(|h| *h != mine) {
            let err = mismatch(&self.label, seq, &self.group, &theirs);
            state.poisoned = Some(err.clone());
            return Err(err);
        }
        Ok(seq)
    }

    /// Tests the sends still in flight and frees the finished ones.
    fn progress_sends(&self) {
        lock(&self.sends).retain_mut(|s| {
            s.requests.0.iter_mut().any(|r| {
                let mut done = 0;
                // SAFETY: a live request of this process; MPI_Test nulls it once complete
                // and accepts a null request as complete.
                unsafe { ffi::MPI_Test(r, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                done == 0
            })
        });
    }

    /// Ranges of the `n` chunks of `len` elements, in bytes: (counts, displacements).
    fn chunk_bytes(
        &self,
        op: &'static str,
        len: usize,
        size: usize,
    ) -> Result<(Vec<i32>, Vec<i32>), CommError> {
        let n = self.group.size();
        let mut counts = Vec::with_capacity(n);
        let mut displs = Vec::with_capacity(n);
        for j in 0..n {
            let r = chunk_range(len, n, j);
            counts.push(self.count(op, r.len() * size)?);
            displs.push(self.count(op, r.start * size)?);
        }
        Ok((counts, displs))
    }

    /// Member `i` gets chunk `i` of every member's `input`: `n` pieces of `m` elements each.
    fn all_to_all(
        &self,
        op: &'static str,
        seq: u64,
        input: &Buffer,
        m: usize,
    ) -> Result<Buffer, CommError> {
        let (n, me, size) = (self.group.size(), self.group.rank(), input.dtype().size());
        self.count(op, input.len() * size)?;
        self.count(op, m * n * size)?;
        let mut pieces = Buffer::zeros(input.dtype(), m * n);
        let bytes = input.bytes();
        // This member's own piece, and a slot for each other member's, in group order.
        let (mut mine, mut theirs) = (None, Vec::with_capacity(n - 1));
        let mut rest = pieces.bytes_mut();
        for i in 0..n {
            let (slot, tail) = rest.split_at_mut(m * size);
            rest = tail;
            if i == me {
                mine = Some(slot);
            } else {
                theirs.push((i, slot));
            }
        }
        let mine = mine.expect("this member is in its group");
        let own = chunk_range(input.len(), n, me);
        mine.copy_from_slice(&bytes[own.start * size..own.end * size]);
        // Point to point, one message per pair: Open MPI's non-blocking all-to-all moves
        // large pieces several times slower.
        scope(|sc| {
            let mut requests = Vec::new();
            for (i, slot) in theirs {
                let peer = self.comm.0.process_at_rank(i as i32);
                let who = vec![self.group.global_rank_of(i)];
                requests.push((
                    who.clone(),
                    peer.immediate_receive_into_with_tag(sc, slot, PIECE_TAG),
                ));
                let r = chunk_range(input.len(), n, i);
                let piece = &bytes[r.start * size..r.end * size];
                requests.push((who, peer.immediate_send_with_tag(sc, piece, PIECE_TAG)));
            }
            self.wait(op, seq, requests);
        });
        Ok(pieces)
    }

    /// Waits for the next message from `peer` on the p2p tag and receives it into `into`
    /// (made from the message's byte count), all within the deadline.
    fn recv_message(
        &self,
        peer: usize,
        seq: u64,
        into: impl FnOnce(usize) -> Result<Buffer, CommError>,
    ) -> Result<Buffer, CommError> {
        let source = self.comm.0.process_at_rank(peer as i32);
        let mut watch = Watch::new(&self.world, &self.label, "recv", seq);
        let (message, status) = loop {
            if let Some(found) = source.immediate_matched_probe_with_tag(P2P_TAG) {
                break found;
            }
            self.progress_sends();
            watch.turn(&[self.group.global_rank_of(peer)]);
        };
        let bytes = status.count(u8::equivalent_datatype()).max(0) as usize;
        let mut buf = into(bytes)?;
        scope(|sc| {
            let r = message.immediate_matched_receive_into(sc, buf.bytes_mut());
            self.wait(
                "recv",
                seq,
                vec![(vec![self.group.global_rank_of(peer)], r)],
            );
        });
        Ok(buf)
    }
}

impl Drop for MpiCommunicator {
    /// Sends still in flight must complete before their buffers go (bounded, like any wait).
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            // Nothing may call MPI any more; the handle goes with the process.
            return;
        }
        let mut watch = Watch::new(&self.world, &self.label, "send", 0);
        loop {
            self.progress_sends();
            let sends = lock(&self.sends);
            if sends.is_empty() {
                drop(sends);
                // SAFETY: dropped once, here; nothing uses the communicator after drop.
                unsafe { std::mem::ManuallyDrop::drop(&mut self.comm) };
                return;
            }
            let awaited: Vec<usize> = sends
                .iter()
                .map(|s| self.group.global_rank_of(s.peer))
                .collect();
            drop(sends);
            watch.turn(&awaited);
        }
    }
}

impl Communicator for MpiCommunicator {
    fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn timeout(&self) -> Duration {
        self.world.timeout
    }

    fn all_reduce(&self, buf: &mut Buffer, op: ReduceOp) -> Result<(), CommError> {
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("all_reduce", buf)
        };
        let seq = self.agree(&mut state, desc)?;
        let (n, me, len) = (self.group.size(), self.group.rank(), buf.len());
        let m = chunk_range(len, n, me).len();
        let pieces = self.all_to_all("all_reduce", seq, buf, m)?;
        let mine = reduce_pieces(&pieces, self.group.size(), op);
        let (counts, displs) = self.chunk_bytes("all_reduce", len, buf.dtype().size())?;
        let mut out = PartitionMut::new(buf.bytes_mut(), counts, displs);
        scope(|sc| {
            let r = self
                .comm
                .0
                .immediate_all_gather_varcount_into(sc, mine.bytes(), &mut out);
            self.wait("all_reduce", seq, vec![(self.others(), r)]);
        });
        Ok(())
    }

    fn all_gather(&self, input: Buffer) -> Result<Buffer, CommError> {
        let mut state = lock(&self.ops);
        let seq = self.agree(&mut state, OpDesc::data("all_gather", &input))?;
        let n = self.group.size();
        self.count("all_gather", input.bytes().len() * n)?;
        let mut out = Buffer::zeros(input.dtype(), input.len() * n);
        scope(|sc| {
            let r = self
                .comm
                .0
                .immediate_all_gather_into(sc, input.bytes(), out.bytes_mut());
            self.wait("all_gather", seq, vec![(self.others(), r)]);
        });
        Ok(out)
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Result<Buffer, CommError> {
        let m = OpDesc::even_split(&self.group, "reduce_scatter", input.len())?;
        let n = self.group.size();
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            reduce: Some(op),
            ..OpDesc::data("reduce_scatter", &input)
        };
        let seq = self.agree(&mut state, desc)?;
        let pieces = self.all_to_all("reduce_scatter", seq, &input, m)?;
        Ok(reduce_pieces(&pieces, n, op))
    }

    fn broadcast(&self, buf: &mut Buffer, root: usize) -> Result<(), CommError> {
        self.group.check_peer("broadcast", root)?;
        let mut state = lock(&self.ops);
        let desc = OpDesc {
            root: Some(root),
            ..OpDesc::data("broadcast", buf)
        };
        let seq = self.agree(&mut state, desc)?;
        if self.group.size() == 1 {
            return Ok(());
        }
        self.count("broadcast", buf.bytes().len())?;
        scope(|sc| {
            let from = self.comm.0.process_at_rank(root as i32);
            let r = from.immediate_broadcast_into(sc, buf.bytes_mut());
            self.wait("broadcast", seq, vec![(self.others(), r)]);
        });
        Ok(())
    }

    fn send(&self, buf: Buffer, peer: usize) -> Result<(), CommError> {
        self.group.check_peer("send", peer)?;
        let bytes = self.count("send", buf.bytes().len())?;
        self.progress_sends();
        let header = Box::new([code(&CommDType::ALL, Some(&buf.dtype())), buf.len() as i64]);
        // SAFETY: reading a constant the MPI library exports.
        let mut requests = [unsafe { ffi::RSMPI_REQUEST_NULL }; 2];
        let (comm, dest) = (self.comm.0.as_raw(), peer as i32);
        // SAFETY: the header and payload allocations live in the pending entry until MPI_Test
        // reports both requests complete (or, at drop, until they are waited for).
        unsafe {
            ffi::MPI_Isend(
                header.as_ptr().cast(),
                16,
                ffi::RSMPI_UINT8_T,
                dest,
                P2P_TAG,
                comm,
                &mut requests[0],
            );
            ffi::MPI_Isend(
                buf.bytes().as_ptr().cast(),
                bytes,
                ffi::RSMPI_UINT8_T,
                dest,
                P2P_TAG,
                comm,
                &mut requests[1],
            );
        }
        lock(&self.sends).push(PendingSend {
            requests: Raw(requests),
            _header: header,
            _payload: buf,
            peer,
        });
        Ok(())
    }

    fn recv(&self, buf: &mut Buffer, peer: usize) -> Result<(), CommError> {
        self.group.check_peer("recv", peer)?;
        let state = lock(&self.ops);
        if let Some(e) = &state.poisoned {
            return Err(e.clone());
        }
        let header = self.recv_message(peer, 0, |_| Ok(Buffer::zeros(CommDType::I64, 2)))?;
        let Buffer::I64(h) = header else {
            unreachable!("received into an i64 buffer")
        };
        let sent = (decode(&CommDType::ALL, h[0]), h[1].max(0) as usize);
        let payload = self.recv_message(peer, 0, |bytes| {
            Ok(match sent.0 {
                Some(dtype) => Buffer::zeros(dtype, bytes / dtype.size()),
                None => Buffer::zeros(CommDType::I64, bytes.div_ceil(8)),
            })
        })?;
        if sent != (Some(buf.dtype()), buf.len()) {
            let err = CommError::Mismatch {
                group: self.label.clone(),
                seq: 0,
                detail: format!(
                    "global rank {} sent {} × {}, global rank {} expected {} × {}",
                    self.group.global_rank_of(peer),
                    sent.0.map_or("?".to_string(), |d| d.to_string()),
                    sent.1,
                    self.group.global_rank(),
                    buf.dtype(),
                    buf.len()
                ),
            };
            drop(state);
            lock(&self.ops).poisoned = Some(err.clone());
            return Err(err);
        }
        *buf = payload;
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.barrier_with_timeout(self.world.timeout)
    }

    fn barrier_with_timeout(&self, timeout: Duration) -> Result<(), CommError> {
        let mut state = lock(&self.ops);
        self.agree_within(&mut state, OpDesc::BARRIER, timeout)
            .map(|_| ())
    }
}
