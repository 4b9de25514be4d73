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
//! [`commit_checkpoint`] (one rank, once all have written) checks that every rank's index
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

mod burn_optim;
mod check;
mod commit;
mod find;
mod index;
mod layout;
mod read;
mod shards;
mod tensors;

pub use commit::{
    CRASH_AT, begin_checkpoint, commit_checkpoint, committed_dir, crash_point, iteration_dir,
    read_latest,
};
pub use find::{LoadableCheckpoint, latest_loadable_checkpoint, verify_checkpoint};
pub use index::{
    CheckpointIndex, CommitMetadata, FORMAT, FileEntry, METADATA, RankIndex, SavedLayout,
    TensorEntry, TrainingState,
};

use crate::optimizer::{Buffer, MegatronOptimizer, OptimizerError};
use burn::module::Module;
use commit::{staging_dir, synced, write_atomic};
use index::file_entry;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tensors::{Files, Restore, collect, ids, write_set};

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

/// Writes this rank's part of iteration `iteration` under `root` (staged until
/// [`commit_checkpoint`]), with `extra` kept in the index (data position, counters).
///
/// With a distributed optimizer call it on every rank: the state of every rank's shards is
/// gathered into whole parameters, which data-parallel rank 0 writes (expert data-parallel
/// rank 0 the experts'). Otherwise call it on the ranks whose `rank.share` has something.
pub fn save_checkpoint<M: Module + Clone>(
    root: &Path,
    iteration: usize,
    rank: &CheckpointRank<'_>,
    model: &M,
    optimizer: &MegatronOptimizer<M>,
    extra: serde_json::Value,
) -> Result<(), CheckpointError> {
    // Collective for a distributed optimizer: before any rank returns.
    let burn_state = optimizer.burn_state(model)?;
    let mut flat_state = Vec::new();
    if let Some(flat) = optimizer.flat() {
        for buffer in Buffer::ALL {
            flat_state.push((buffer.file_stem(), flat.state_module(buffer, model)?));
        }
    }
    // A distributed optimizer gathered its state to (expert) data-parallel rank 0, which
    // writes it; the other ranks took part in the gathers only.
    let first = |r: Option<usize>| r.is_none_or(|r| r == 0);
    let has_experts = !crate::data_parallel::expert_params(model).is_empty();
    let share = SaveShare {
        dense: rank.share.dense && first(optimizer.data_parallel_rank()),
        experts: rank.share.experts && has_experts && first(optimizer.expert_data_parallel_rank()),
    };
    if !share.dense && !share.experts {
        return Ok(());
    }
    // Collective over the model-parallel group, all of whose members write the dense
    // weights when one does (experts are not compared: they differ per rank).
    if share.dense {
        layout::check_tensor_parallel_layout(model, rank, optimizer.model_parallel())?;
    }
    let dir = staging_dir(root, iteration).join(rank.dir_name());
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    let (names, tp) = (rank.names, rank.tp());
    let mut entries = write_set(&dir, "model", &collect(model, names, tp, share, false))?;
    commit::crash_point("shard", iteration);
    let (record, master) = burn_state.unzip();
    if let Some(master) = master.flatten() {
        let tensors = collect(&master, names, tp, share, true);
        entries.extend(write_set(&dir, "master", &tensors)?);
    }
    for (stem, module) in &flat_state {
        let tensors = collect(module, names, tp, share, true);
        entries.extend(write_set(&dir, stem, &tensors)?);
    }
    let mut optimizer_scalars = BTreeMap::new();
    if let Some(record) = record {
        let (state, scalars) = burn_optim::save(&dir, record, model, names, tp, share)?;
        entries.extend(state);
        optimizer_scalars = scalars;
    }
    let mut files = BTreeMap::new();
    for file in entries.iter().map(|e| e.file.clone()) {
        if !files.contains_key(&file) {
            files.insert(file.clone(), file_entry(&dir.join(&file))?);
        }
    }
    let index = RankIndex {
        format: FORMAT.to_string(),
        layout: rank.layout,
        tensor_model_parallel_rank: rank.tensor_model_parallel_rank,
        pipeline_model_parallel_rank: rank.pipeline_model_parallel_rank,
        expert_model_parallel_rank: rank.expert_model_parallel_rank,
        state: TrainingState {
            iteration,
            grad_scaler: optimizer.grad_scaler().map(|s| s.state()),
            fused_adam_steps: optimizer.flat().map(|f| f.steps()),
            extra,
        },
        tensors: entries,
        files,
        ids: ids(model),
        optimizer_scalars,
    };
    let path = dir.join("index.json");
    let text = serde_json::to_string_pretty(&index).map_err(|e| io(&path, e))?;
    // The index last: a rank directory without one is a save that did not finish.
    write_atomic(&path, &text, None)?;
    // The files' names in the rank directory.
    synced(&dir)
}

/// What [`load_checkpoint`] restores.
pub struct Restored<M: Module> {
    /// The model, with the saved weights.
    pub model: M,
    /// The optimizer, with its saved state (unless it was not loaded).
    pub optimizer: MegatronOptimizer<M>,
    /// The iteration the checkpoint was taken after.
    pub iteration: usize,
    /// The caller's `extra`.
    pub extra: serde_json::Value,
    /// The layout the checkpoint was saved at.
    pub saved_at: SavedLayout,
    /// Newer checkpoints passed over because they did not verify, newest first, with why
    /// (empty when an iteration was asked for).
    pub skipped: Vec<(usize, String)>,
}

/// Loads iteration `iteration` under `root` into a freshly built `model` at this rank's
/// layout, whatever layout saved it. `make_optimizer` builds the optimizer for the loaded
/// model; with `load_optimizer` its state is then restored (Megatron's `--no-load-optim`
/// is `false`: weights only, a fresh optimizer).
pub fn load_checkpoint<M: Module + Clone>(
    root: &Path,
    iteration: usize,
    rank: &CheckpointRank<'_>,
    model: M,
    make_optimizer: impl FnOnce(&M) -> Result<MegatronOptimizer<M>, OptimizerError>,
    load_optimizer: bool,
) -> Result<Restored<M>, CheckpointError> {
    let index = CheckpointIndex::read(&committed_dir(root, iteration))?;
    let saved = index.layout();
    let same_model_layout = (
        saved.tensor_model_parallel_size,
        saved.pipeline_model_parallel_size,
        saved.virtual_pipeline_model_parallel_size,
        saved.expert_model_parallel_size,
    ) == (
        rank.layout.tensor_model_parallel_size,
        rank.layout.pipeline_model_parallel_size,
        rank.layout.virtual_pipeline_model_parallel_size,
        rank.layout.expert_model_parallel_size,
    );
    let own = rank
        .rank(&index)
        .filter(|_| same_model_layout)
        .map(|(d, r)| (d.clone(), r.ids.clone()));
    let mut files = Files::new(&index);
    let model = Restore {
        files: &mut files,
        set: "model",
        names: rank.names,
        tp: rank.tp(),
        trainable_only: false,
        ids: own.as_ref().map(|(_, ids)| ids),
        error: None,
    }
    .apply(model)?;
    let mut optimizer = make_optimizer(&model)?;
    let state = index.state().clone();
    optimizer.restore_scaler(state.grad_scaler);
    let done = |model, optimizer| Restored {
        model,
        optimizer,
        iteration: state.iteration,
        extra: state.extra.clone(),
        saved_at: saved,
        skipped: Vec::new(),
    };
    if !load_optimizer {
        return Ok(done(model, optimizer));
    }
    let kind = |fused: bool| {
        if fused {
            "the fused Adam"
        } else {
            "a burn-optim optimizer"
        }
    };
    if optimizer.is_fused() != state.fused_adam_steps.is_some() {
        return Err(CheckpointError::Mismatch(format!(
            "{}: saved by {}, loading into {} (load the weights only to change optimizer)",
            index.dir.display(),
            kind(state.fused_adam_steps.is_some()),
            kind(optimizer.is_fused())
        )));
    }
    // Asked before the sets are read; an error only matters to an optimizer that needs it.
    let master_from = master_set(&mut files, &index);
    let mut read_set = |set: &str, module: M| -> Result<M, CheckpointError> {
        Restore {
            files: &mut files,
            set,
            names: rank.names,
            tp: rank.tp(),
            trainable_only: true,
            ids: None,
            error: None,
        }
        .apply(module)
    };
    let optimizer = match (optimizer.flat_mut(), state.fused_adam_steps) {
        (Some(flat), Some(steps)) => {
            let mut modules = Vec::new();
            for buffer in Buffer::ALL {
                modules.push(read_set(buffer.file_stem(), flat.state_template(&model))?);
            }
            flat.load([&modules[0], &modules[1], &modules[2]], steps)
                .map_err(|e| CheckpointError::Mismatch(format!("{}: {e}", index.dir.display())))?;
            optimizer
        }
        _ => {
            let master = match optimizer.master_template(&model) {
                Some(m) => Some(read_set(master_from?, m)?),
                None => None,
            };
            let (sets, scalars) = index.optimizer_state();
            let record =
                burn_optim::load(&mut files, &sets, &scalars, &model, rank.names, rank.tp())?;
            optimizer.restore(record, master)?
        }
    };
    Ok(done(model, optimizer))
}

/// Where a burn-optim optimizer that keeps FP32 master weights reads them from: the
/// `master` set, or, from a checkpoint of an FP32 model stepped without a master copy (a
/// burn-optim optimizer keeps none then, the distributed one always does), the weights,
/// which were the master weights.
fn master_set(
    files: &mut Files<'_>,
    index: &CheckpointIndex,
) -> Result<&'static str, CheckpointError> {
    if files.saved_dtype("master")?.is_some() {
        return Ok("master");
    }
    match files.saved_dtype("model")? {
        Some(burn::tensor::DType::F32) => Ok("model"),
        saved => Err(CheckpointError::Mismatch(format!(
            "{}: no FP32 master weights, and the weights were saved in {saved:?}, not F32",
            index.dir.display()
        ))),
    }
}

impl CheckpointRank<'_> {
    fn rank<'i>(&self, index: &'i CheckpointIndex) -> Option<&'i (PathBuf, RankIndex)> {
        index.rank(self.at())
    }
}

#[cfg(test)]
mod durability_tests;
#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod tests;
