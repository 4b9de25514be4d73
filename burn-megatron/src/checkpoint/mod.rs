//! Training checkpoints that load at any layout: saved at one TP × PP × DP (with or without
//! the distributed optimizer), resumed at another.
//!
//! Megatron's layout: `ROOT/iter_0000100/mp_rank_TT[_PPP]/` per model-parallel rank, and
//! `ROOT/latest_checkpointed_iteration.txt`. Each rank directory holds safetensors files of
//! the weights (`model`), the FP32 master weights (`master`) and the fused Adam's moments
//! (`exp_avg`, `exp_avg_sq`), every tensor under its *global* name (layers by global index,
//! so pipeline splits do not rename them), and an `index.json`: the layout saved at, each
//! tensor's global shape and this shard's offset (Megatron's `ShardedTensor`), each file's
//! size and CRC-32, and the training state. A duplicated tensor is written once (by TP
//! rank 0), a tied one by its first copy. Loading reads, for each of the new layout's
//! parameters, whatever saved shards overlap its slice.
//!
//! A save is atomic and durable: every rank writes into `iter_0000100.tmp/`, and
//! [`advanced::commit_checkpoint`] (one rank, once all have written) checks that every rank's index
//! is there, seals the indexes in a `metadata.json` (their sizes and CRC-32s), renames the
//! directory and then `latest`, every file and directory synced on the way (see `commit.rs`
//! for the steps). A crash or power loss at any step leaves `latest` naming a whole
//! checkpoint: the previous one, or once its rename is on disk, this one. On load the indexes are checked against the metadata and each other,
//! and every file against its index, so a truncated, corrupted, edited or foreign file, a
//! missing shard or a shape that does not fit is an error naming it;
//! [`latest_loadable_checkpoint`] falls back to the newest checkpoint that verifies.
//!
//! The optimizer's state follows, whichever the optimizer: the fused Adam's buffers (with or
//! without the distributed optimizer) and a burn-optim optimizer's record (its per-parameter
//! tensors as `optim.{field}` sets, its scalars in the index) are stored by global name too.
//!
//! The files: `save_load.rs` (one rank's save and load), `tensors.rs` (a module's parameters
//! as global tensors, restored from whatever shards overlap; the cutting and joining is the
//! crate's `shards.rs`, which the drop-in loader shares), `index.rs` (`index.json`, the
//! layout saved at), `check.rs` (what every index must agree on), `layout.rs` (before a save,
//! the tensor-parallel ranks agree on each parameter), `commit.rs` (the atomic, durable
//! protocol), `find.rs` (which checkpoint to load), `read.rs` (global tensors read whole, for
//! tools) and `burn_optim.rs` (a burn-optim optimizer's state by global name).

mod burn_optim;
mod check;
mod commit;
mod find;
mod index;
mod layout;
mod read;
mod tensors;

mod save_load;

#[cfg(feature = "test-hooks")]
pub use commit::CRASH_AT;
pub use commit::{committed_dir, iteration_dir, read_latest};
pub use save_load::Restored;

/// A save and a load in their parts, for a loop without
/// [`ParallelTraining`](crate::training::ParallelTraining) (whose `save` and `load` call
/// these on every rank with the barriers between them) and for tools that convert
/// checkpoints offline.
pub mod advanced {
    pub use super::commit::{begin_checkpoint, commit_checkpoint};
    pub use super::save_load::{load_checkpoint, save_checkpoint};
}
pub use find::{LoadableCheckpoint, latest_loadable_checkpoint, verify_checkpoint};
pub use index::{
    CheckpointIndex, CommitMetadata, FORMAT, FileEntry, METADATA, RankIndex, SavedLayout,
    TensorEntry, TrainingState,
};

use crate::optimizer::OptimizerError;
use std::path::Path;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written, or is not what its index says.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The checkpoint does not fit the model (architecture, padding, optimizer).
    #[error("checkpoint does not match the model: {0}")]
    Mismatch(String),
    /// Making the optimizer or gathering a distributed optimizer's state failed.
    #[error("optimizer: {0}")]
    Optimizer(#[from] OptimizerError),
    /// A collective among the ranks saving or loading failed (a timeout, a failed peer).
    #[error("checkpoint collective: {0}")]
    Comm(#[from] crate::comm::CommError),
    /// Another rank failed its part; its own error says what.
    #[error("{0}")]
    Peer(String),
}

fn io(path: &Path, message: impl ToString) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

/// Which of its parameters a rank writes: with expert parallelism the experts' writers (one
/// per expert data-parallel group) are not the dense weights' (one per data-parallel group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveShare {
    /// The dense parameters (all but the experts').
    pub dense: bool,
    /// The experts' parameters.
    pub experts: bool,
}

impl SaveShare {
    /// Every parameter: a rank of a model without expert parallelism.
    pub const ALL: SaveShare = SaveShare {
        dense: true,
        experts: true,
    };
}

/// Where this rank sits, and how its modules' paths are named globally.
pub struct CheckpointRank<'a> {
    /// The layout of this run.
    pub layout: SavedLayout,
    /// This rank's tensor-parallel rank.
    pub tensor_model_parallel_rank: usize,
    /// This rank's pipeline stage.
    pub pipeline_model_parallel_rank: usize,
    /// This rank's expert-parallel rank (0 without experts).
    pub expert_model_parallel_rank: usize,
    /// What this rank writes when it saves.
    pub share: SaveShare,
    /// The global name of the parameter at a local module path (the identity for a model on
    /// one stage; `Bert::global_param_name` for BERT chunks).
    pub names: &'a dyn Fn(&str) -> String,
}

impl CheckpointRank<'_> {
    fn tp(&self) -> (usize, usize) {
        (
            self.tensor_model_parallel_rank,
            self.layout.tensor_model_parallel_size,
        )
    }

    fn dir_name(&self) -> String {
        check::rank_dir_name(
            self.at(),
            self.layout.pipeline_model_parallel_size,
            self.layout.expert_model_parallel_size,
        )
    }

    fn at(&self) -> (usize, usize, usize) {
        (
            self.tensor_model_parallel_rank,
            self.pipeline_model_parallel_rank,
            self.expert_model_parallel_rank,
        )
    }
}

#[cfg(test)]
mod tests;
