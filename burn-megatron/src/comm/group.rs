//! Process groups and the errors a collective can end with.

use super::buffer::CommDType;
use super::reduce::ReduceOp;
use std::fmt;
use std::time::Duration;

/// An ordered set of global ranks that communicate together, seen from one member.
///
/// Peers and roots in the [`Communicator`](super::Communicator) API are *group indices*
/// (positions in [`ranks`](Self::ranks)), as NCCL's communicator ranks are.
///
/// ```
/// use burn_megatron::comm::ProcessGroup;
/// let g = ProcessGroup::new("dp", vec![1, 3, 5], 3).unwrap();
/// assert_eq!(g.rank(), 1);
/// assert_eq!(g.size(), 3);
/// assert_eq!(g.global_rank_of(2), 5);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProcessGroup {
    name: String,
    ranks: Vec<usize>,
    index: usize,
}

impl ProcessGroup {
    /// A group named `name` over global `ranks` (distinct), seen from `global_rank`.
    pub fn new(
        name: impl Into<String>,
        ranks: Vec<usize>,
        global_rank: usize,
    ) -> Result<Self, CommError> {
        let name = name.into();
        let invalid = |reason: String| CommError::InvalidArgument {
            group: format!("{name} {ranks:?}"),
            op: "new_group",
            reason,
        };
        if ranks.is_empty() {
            return Err(invalid("a group needs at least one rank".into()));
        }
        let mut sorted = ranks.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid("ranks must be distinct".into()));
        }
        let Some(index) = ranks.iter().position(|&r| r == global_rank) else {
            return Err(invalid(format!("rank {global_rank} is not a member")));
        };
        Ok(Self { name, ranks, index })
    }

    /// [`new`](Self::new) in a world of one process per rank, where this process is global
    /// rank `this` of `world_size` (as `engine`, e.g. "MPI", numbers it): the group must be
    /// seen from this process and lie inside the world.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn of_process(
        name: &str,
        ranks: Vec<usize>,
        global_rank: usize,
        (this, world_size): (usize, usize),
        engine: &str,
    ) -> Result<Self, CommError> {
        let group = Self::new(name, ranks, global_rank)?;
        let invalid = |reason: String| CommError::InvalidArgument {
            group: group.to_string(),
            op: "new_group",
            reason,
        };
        if global_rank != this {
            return Err(invalid(format!(
                "this process is {engine} rank {this}, not {global_rank}"
            )));
        }
        if let Some(&bad) = group.ranks().iter().find(|&&r| r >= world_size) {
            return Err(invalid(format!(
                "rank {bad} is outside the {engine} world of {world_size}"
            )));
        }
        Ok(group)
    }

    /// The group's name (e.g. `"tp"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Member global ranks, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// This member's index in the group.
    pub fn rank(&self) -> usize {
        self.index
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// This member's global rank.
    pub fn global_rank(&self) -> usize {
        self.ranks[self.index]
    }

    /// Refuses a peer or root that is not a group index.
    pub(crate) fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), CommError> {
        if peer >= self.size() {
            return Err(CommError::InvalidArgument {
                group: self.to_string(),
                op,
                reason: format!("peer {peer} is not a group index (size {})", self.size()),
            });
        }
        Ok(())
    }

    /// The global rank of the member at group index `index` (panics when out of range).
    pub fn global_rank_of(&self, index: usize) -> usize {
        self.ranks[index]
    }
}

impl fmt::Display for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "'{}' {:?}", self.name, self.ranks)
    }
}

/// Why a collective or point-to-point call failed. Every variant names the group
/// (`'name' [global ranks]`) and the operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// The call did not complete within the communicator's timeout.
    #[error(
        "{op} #{seq} on group {group} timed out after {waited:?}: global rank(s) {missing:?} did not take part"
    )]
    Timeout {
        /// The group.
        group: String,
        /// The operation.
        op: &'static str,
        /// The call's sequence number on this group.
        seq: u64,
        /// How long this rank waited.
        waited: Duration,
        /// Global ranks that had not joined when the time ran out.
        missing: Vec<usize>,
    },
    /// The call did not complete in time and the engine cannot tell which ranks are missing
    /// (NCCL runs on the GPU and reports no progress); the communicator is aborted.
    #[error(
        "{op} #{seq} on group {group} did not complete within {waited:?}: a member did not \
         take part or failed; the communicator is aborted"
    )]
    Stalled {
        /// The group.
        group: String,
        /// The operation.
        op: &'static str,
        /// The call's sequence number on this group.
        seq: u64,
        /// How long this rank waited.
        waited: Duration,
    },
    /// The engine reported an error of its own (CUDA, NCCL).
    #[error("{op} on group {group} failed in the engine: {reason}")]
    Engine {
        /// The group.
        group: String,
        /// The operation.
        op: &'static str,
        /// The engine's error.
        reason: String,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("collective mismatch on group {group} at call #{seq}: {detail}")]
    Mismatch {
        /// The group.
        group: String,
        /// The call's sequence number on this group.
        seq: u64,
        /// What each rank called.
        detail: String,
    },
    /// Another rank failed (returned an error or panicked); the world is aborted.
    #[error("{op} on group {group} aborted: global rank {rank} failed: {reason}")]
    PeerFailed {
        /// The group.
        group: String,
        /// The operation.
        op: &'static str,
        /// The failing global rank.
        rank: usize,
        /// Its error or panic message.
        reason: String,
    },
    /// A rank this call waits for has already finished its work.
    #[error("{op} on group {group} cannot complete: global rank {rank} has already exited")]
    PeerExited {
        /// The group.
        group: String,
        /// The operation.
        op: &'static str,
        /// The exited global rank.
        rank: usize,
    },
    /// The arguments are invalid on this rank alone (bad root or peer, indivisible count).
    #[error("invalid {op} on group {group}: {reason}")]
    InvalidArgument {
        /// The group.
        group: String,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// What one member asked for; all members of a call must agree.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OpDesc {
    pub(crate) op: &'static str,
    pub(crate) dtype: Option<CommDType>,
    pub(crate) len: usize,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) root: Option<usize>,
}

impl OpDesc {
    /// A barrier: no data.
    pub(crate) const BARRIER: Self = Self {
        op: "barrier",
        dtype: None,
        len: 0,
        reduce: None,
        root: None,
    };

    /// A call `op` moving `buf` (no reduction, no root).
    pub(crate) fn data(op: &'static str, buf: &super::Buffer) -> Self {
        Self {
            op,
            dtype: Some(buf.dtype()),
            len: buf.len(),
            reduce: None,
            root: None,
        }
    }

    /// A call of `op` on `group` splitting `len` elements evenly over its members: the chunk
    /// length, or the error every backend gives.
    pub(crate) fn even_split(
        group: &ProcessGroup,
        op: &'static str,
        len: usize,
    ) -> Result<usize, CommError> {
        let n = group.size();
        if !len.is_multiple_of(n) {
            return Err(CommError::InvalidArgument {
                group: group.to_string(),
                op,
                reason: format!("{len} elements do not split evenly over {n} ranks"),
            });
        }
        Ok(len / n)
    }
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}(", self.op)?;
        if let Some(r) = self.reduce {
            write!(f, "{r}, ")?;
        }
        if let Some(root) = self.root {
            write!(f, "root {root}, ")?;
        }
        match self.dtype {
            Some(d) => write!(f, "{d} × {})", self.len),
            None => write!(f, "no data)"),
        }
    }
}
