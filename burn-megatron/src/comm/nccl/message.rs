//! Point-to-point messages between two members, one format whatever memory they come from or go
//! to: a 16-byte header (dtype code, element count), then the payload, on the pair's link for
//! that direction. Host sends copy their bytes to the GPU first; device sends hand over the
//! caller's buffer. Either kind of receive takes either kind of send.

use super::super::group::CommError;
use super::super::header::{code, decode};
use super::super::{CommDType, lock};
use super::communicator::{BYTE, Link, NcclCommunicator, Pending, bytes_to_i64s, i64s_to_bytes};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;
use std::time::Instant;

/// A queued message's payload, held until NCCL has sent it.
pub(super) enum Payload {
    /// A device copy of host bytes.
    Copied(CudaSlice<u8>),
    /// The caller's device memory at `ptr`, kept in place by `_keep`.
    Borrowed {
        ptr: u64,
        _keep: Box<dyn std::any::Any + Send>,
    },
}

impl NcclCommunicator {
    /// Queues a message of `len` elements of `dtype` to `peer` (not this member) without
    /// waiting for the receiver; `payload` gives its bytes, given the stream that reads them.
    pub(super) fn send_message(
        &self,
        peer: usize,
        dtype: CommDType,
        len: usize,
        payload: impl FnOnce(&Arc<CudaStream>) -> Result<Payload, CommError>,
    ) -> Result<(), CommError> {
        let pair = self.pair("send", peer)?;
        let link = pair.out();
        let _serial = lock(&link.lock);
        let comm = self.handle(link, "send")?;
        let cuda = |e| self.engine("send", e);
        let header = i64s_to_bytes(&[code(&CommDType::ALL, Some(&dtype)), len as i64]);
        let header = link.stream.clone_htod(&header).map_err(cuda)?;
        let payload = payload(&link.stream)?;
        let nbytes = len * dtype.size();
        {
            let (h, _h) = header.device_ptr(&link.stream);
            let (p, _p) = match &payload {
                Payload::Copied(bytes) => {
                    let (p, record) = bytes.device_ptr(&link.stream);
                    (p, Some(record))
                }
                Payload::Borrowed { ptr, .. } => (*ptr, None),
            };
            let st = link.stream.cu_stream() as _;
            let nccl = |e| self.engine("send", e);
            self.world.nccl.group_start().map_err(nccl)?;
            // SAFETY: the header and the payload live in the pending entry until the event
            // completes; an empty payload sends nothing from its address.
            let sent = unsafe {
                self.world
                    .nccl
                    .send(h as _, 16, BYTE, 1, comm, st)
                    .and_then(|_| self.world.nccl.send(p as _, nbytes, BYTE, 1, comm, st))
            };
            let ended = self.queue("send", || self.world.nccl.group_end());
            sent.and(ended).map_err(nccl)?;
        }
        let event = link.stream.record_event(None).map_err(cuda)?;
        lock(&self.pending).push(Pending {
            pair: pair.clone(),
            event,
            started: Instant::now(),
            _header: header,
            _payload: payload,
        });
        Ok(())
    }

    /// Takes the header of `peer`'s next message on `link`. A message of another dtype or
    /// length than `dtype` × `len` is an error, its payload taken into host memory so that the
    /// next message starts where it should.
    pub(super) fn take_header(
        &self,
        link: &Link,
        peer: usize,
        dtype: CommDType,
        len: usize,
    ) -> Result<(), CommError> {
        let header = bytes_to_i64s(&self.recv_bytes(link, 16)?);
        let sent: Option<CommDType> = decode(&CommDType::ALL, header[0]);
        let sent_len = usize::try_from(header[1]).unwrap_or(0);
        if sent == Some(dtype) && sent_len == len {
            return Ok(());
        }
        self.recv_bytes(link, sent_len * sent.map_or(0, |d| d.size()))?;
        Err(CommError::Mismatch {
            group: self.group.to_string(),
            seq: 0,
            detail: format!(
                "global rank {} sent {} × {sent_len}, global rank {} expects {dtype} × {len}",
                self.group.global_rank_of(peer),
                sent.map_or("?".to_string(), |d| d.to_string()),
                self.group.global_rank(),
            ),
        })
    }
}
