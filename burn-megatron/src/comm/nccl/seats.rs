//! Ranks that share a GPU.
//!
//! NCCL refuses two members of one communicator on the same device of the same host
//! ("Duplicate GPU detected"). Its host is the hash of `NCCL_HOSTID` when that is set, else of
//! the host's name. So ranks that share a device (more ranks than GPUs: a correctness run on
//! one GPU) can run when each takes itself for a host of its own, and NCCL's socket transport
//! then carries their messages through host memory: right, not fast.
//!
//! Before its first communicator every rank tells the others its seat (host and device). A
//! rank that shares its seat gets an `NCCL_HOSTID` of its own, unless the user set one: then
//! the ranks that share a seat have set the same one, and that is an error naming it.

use super::super::group::CommError;
use super::super::{Buffer, CommunicatorExt, lock};
use super::{Bootstrap, NcclWorld, StoreError};
use std::fmt::Write;

/// The variable NCCL reads for a process's host identity.
pub(crate) const HOST_ID_VAR: &str = "NCCL_HOSTID";

/// Where a rank sits, as NCCL will see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seat {
    /// `NCCL_HOSTID` when set, else the host's name.
    pub(crate) host: String,
    /// Whether `host` is the user's `NCCL_HOSTID`.
    pub(crate) host_id_set: bool,
    /// The CUDA device's UUID.
    pub(crate) device: [u8; 16],
}

/// A seat's bytes on the wire: UUID, flag, host length (two bytes), host; padded to
/// [`SEAT_BYTES`] so that a fixed-size all-gather carries it.
pub(crate) const SEAT_BYTES: usize = 320;
const HOST_MAX: usize = SEAT_BYTES - 19;

impl Seat {
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let host = &self.host.as_bytes()[..self.host.len().min(HOST_MAX)];
        let mut b = Vec::with_capacity(SEAT_BYTES);
        b.extend_from_slice(&self.device);
        b.push(u8::from(self.host_id_set));
        b.extend_from_slice(&(host.len() as u16).to_le_bytes());
        b.extend_from_slice(host);
        b.resize(SEAT_BYTES, 0);
        b
    }

    pub(crate) fn from_bytes(b: &[u8]) -> Result<Self, String> {
        let bad = || format!("a seat of {} bytes is not one this version sends", b.len());
        if b.len() != SEAT_BYTES {
            return Err(bad());
        }
        let n = u16::from_le_bytes([b[17], b[18]]) as usize;
        if n > HOST_MAX {
            return Err(bad());
        }
        Ok(Self {
            device: b[..16].try_into().map_err(|_| bad())?,
            host_id_set: b[16] != 0,
            host: String::from_utf8_lossy(&b[19..19 + n]).into_owned(),
        })
    }
}

/// A UUID as CUDA prints it (`GPU-xxxxxxxx-xxxx-…`).
pub(crate) fn uuid_text(u: &[u8; 16]) -> String {
    let mut s = String::from("GPU-");
    for (i, byte) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        let _ = write!(s, "{byte:02x}");
    }
    s
}

/// The `NCCL_HOSTID` rank `me` must take, if any, given every rank's seat: none when no other
/// rank shares its seat; one of its own when some do; an error when they do because the user
/// gave them the same `NCCL_HOSTID`.
pub(crate) fn host_id_for(me: usize, seats: &[Seat]) -> Result<Option<String>, String> {
    let mine = seats
        .get(me)
        .ok_or_else(|| format!("rank {me} has no seat among {}", seats.len()))?;
    let sharing: Vec<usize> = (0..seats.len())
        .filter(|&r| seats[r].host == mine.host && seats[r].device == mine.device)
        .collect();
    if sharing.len() < 2 {
        return Ok(None);
    }
    if mine.host_id_set {
        return Err(format!(
            "ranks {sharing:?} share CUDA device {} and have the same {HOST_ID_VAR} \
             ({:?}), so NCCL would refuse them (\"Duplicate GPU detected\"). Unset \
             {HOST_ID_VAR} (burn-megatron then gives each rank that shares a device its own) \
             or give each of these ranks a different one",
            uuid_text(&mine.device),
            mine.host
        ));
    }
    Ok(Some(format!("{}/burn-megatron-rank-{me}", mine.host)))
}

impl NcclWorld {
    /// Gives this process an `NCCL_HOSTID` of its own when another rank sits on its GPU (see
    /// `comm/nccl/seats.rs`); says so on stderr and returns it. Every rank calls it, before its
    /// first communicator; a layout NCCL would refuse is an error on every rank that shares a
    /// device.
    pub fn separate_shared_devices(&self) -> Result<Option<String>, CommError> {
        let engine = |reason: String| CommError::Engine {
            group: "world".into(),
            op: "seats",
            reason,
        };
        if !lock(&self.inner.created).is_empty() {
            return Err(engine(
                "ranks that share a device must be separated before the first communicator".into(),
            ));
        }
        let mine = own_seat(&self.inner.ctx).map_err(engine)?;
        let seats = self.gather_seats(&mine)?;
        let rank = self.inner.rank;
        let Some(id) = host_id_for(rank, &seats).map_err(engine)? else {
            return Ok(None);
        };
        let sharing = seats
            .iter()
            .filter(|s| s.host == mine.host && s.device == mine.device)
            .count();
        // SAFETY: NCCL reads the variable when its first communicator starts, which has not
        // happened (checked above). The threads alive now are this crate's (the rendezvous
        // store's, which read no environment) and, under mpirun, MPI's, which read theirs
        // while MPI starts, before this.
        unsafe { std::env::set_var(HOST_ID_VAR, &id) };
        eprintln!(
            "burn-megatron: global rank {rank}: {sharing} ranks share CUDA device {} on this \
             host; NCCL would refuse them, so this rank runs as NCCL host {id:?} \
             ({HOST_ID_VAR}); its messages go through host memory (correct, not fast)",
            uuid_text(&mine.device)
        );
        Ok(Some(id))
    }

    /// Every rank's seat, in rank order, through the bootstrap.
    fn gather_seats(&self, mine: &Seat) -> Result<Vec<Seat>, CommError> {
        let (rank, size, timeout) = (self.inner.rank, self.inner.size, self.inner.timeout);
        let engine = |reason: String| CommError::Engine {
            group: "world".into(),
            op: "seats",
            reason,
        };
        let bytes: Vec<Vec<u8>> = match &self.inner.bootstrap {
            Bootstrap::Store(store) => {
                let key = |r: usize| format!("nccl/seat/{r}");
                store
                    .set(&key(rank), &mine.to_bytes())
                    .map_err(|e| engine(e.to_string()))?;
                (0..size)
                    .map(|r| {
                        store.get(&key(r), timeout).map_err(|e| match e {
                            StoreError::Timeout { waited, .. } => CommError::Timeout {
                                group: "world".into(),
                                op: "seats",
                                seq: 0,
                                waited,
                                missing: vec![r],
                            },
                            other => engine(other.to_string()),
                        })
                    })
                    .collect::<Result<_, _>>()?
            }
            Bootstrap::World(world) => {
                let comm = world.new_group("nccl/seats", (0..size).collect(), rank)?;
                let words: Vec<i64> = mine
                    .to_bytes()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                let all = comm.all_gather_vec(words)?;
                Buffer::I64(all)
                    .bytes()
                    .chunks(SEAT_BYTES)
                    .map(<[u8]>::to_vec)
                    .collect()
            }
        };
        bytes
            .iter()
            .map(|b| Seat::from_bytes(b).map_err(engine))
            .collect()
    }
}

/// This process's seat: its `NCCL_HOSTID` or host name, and its device's UUID.
fn own_seat(ctx: &cudarc::driver::CudaContext) -> Result<Seat, String> {
    let uuid = ctx
        .uuid()
        .map_err(|e| format!("the UUID of CUDA device {}: {e:?}", ctx.ordinal()))?;
    let device = uuid.bytes.map(|b| b as u8);
    let (host, host_id_set) = match std::env::var(HOST_ID_VAR) {
        Ok(id) if !id.is_empty() => (id, true),
        _ => (host_name()?, false),
    };
    Ok(Seat {
        host,
        host_id_set,
        device,
    })
}

fn host_name() -> Result<String, String> {
    let mut buf = [0u8; 256];
    // SAFETY: writes at most `buf.len()` bytes into `buf`.
    let status = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if status != 0 {
        return Err(format!("gethostname: {}", std::io::Error::last_os_error()));
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
mod tests;
