//! One rank's side of a save and a load: its shards written under their global names,
//! and read back at whatever layout the rank now runs.

use super::commit::{staging_dir, synced, write_atomic};
use super::index::file_entry;
use super::tensors::{Files, Restore, collect, ids, write_set};
use super::*;
use crate::optimizer::{Buffer, MegatronOptimizer, OptimizerError};
use burn::module::Module;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Writes this rank's part of iteration `iteration` under `root` (staged until
/// [`commit_checkpoint`](super::commit::commit_checkpoint)), with `extra` kept in the index (data position, counters).
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
    // The statistics' last update belongs in the checkpoint.
    crate::module_path::commit_running_states(model);
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
