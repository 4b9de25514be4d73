//! Training checkpoints in Megatron's layout: `ROOT/iter_0000100/mp_rank_01/` holds one
//! tensor-parallel rank's weights (safetensors, by module path, dtype kept), its FP32
//! master weights when it has them, the inner optimizer's state (burnpack) and a
//! `state.json` (iteration, loss-scaler state, whatever the caller adds);
//! `ROOT/latest_checkpointed_iteration.txt` names the newest.
//!
//! Burn keys optimizer state by [`ParamId`], so a loaded model takes the ids it was saved
//! with (its tensor-parallel attributes move along): the optimizer state then applies
//! unchanged, and resuming continues the exact run.

use crate::optimizer::{Buffer, GradScalerState, MegatronOptimizer};
use crate::safetensors_io;
use crate::tensor_parallel::{parallel_attrs, set_parallel_attrs};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::OptimizerRecord;
use burn::tensor::{Tensor, TensorCreationOptions, TensorData};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The checkpoint does not fit the model (another layout or architecture).
    #[error("checkpoint does not match the model: {0}")]
    Mismatch(String),
    /// Gathering a distributed optimizer's state failed.
    #[error("gathering the optimizer state: {0}")]
    Optimizer(#[from] crate::optimizer::OptimizerError),
}

fn io(path: &Path, message: impl ToString) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

/// Megatron's directory of one model-parallel rank:
/// `ROOT/iter_{iteration:07}/mp_rank_{tp_rank:02}`, or `mp_rank_{tp_rank:02}_{pp_rank:03}`
/// with pipeline parallelism (`pp_rank` given).
///
/// ```
/// use burn_megatron::checkpoint::rank_dir;
/// use std::path::Path;
/// let d = rank_dir(Path::new("ckpt"), 5, 1, Some(2));
/// assert_eq!(d, Path::new("ckpt/iter_0000005/mp_rank_01_002"));
/// ```
pub fn rank_dir(root: &Path, iteration: usize, tp_rank: usize, pp_rank: Option<usize>) -> PathBuf {
    let name = match pp_rank {
        None => format!("mp_rank_{tp_rank:02}"),
        Some(pp) => format!("mp_rank_{tp_rank:02}_{pp:03}"),
    };
    root.join(format!("iter_{iteration:07}")).join(name)
}

/// Records `iteration` as the newest complete checkpoint (call once every rank has saved).
pub fn write_latest(root: &Path, iteration: usize) -> Result<(), CheckpointError> {
    let path = root.join("latest_checkpointed_iteration.txt");
    std::fs::write(&path, iteration.to_string()).map_err(|e| io(&path, e))
}

/// The newest complete checkpoint under `root`, if any.
pub fn read_latest(root: &Path) -> Result<Option<usize>, CheckpointError> {
    let path = root.join("latest_checkpointed_iteration.txt");
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    text.trim()
        .parse()
        .map(Some)
        .map_err(|e| io(&path, format!("not an iteration number: {e}")))
}

#[derive(Default)]
struct Path_(Vec<String>);

impl Path_ {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn join(&self) -> String {
        self.0.join(".")
    }
}

struct Collect {
    path: Path_,
    out: Vec<(String, TensorData)>,
    ids: HashMap<String, String>,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let name = self.path.join();
        self.ids.insert(name.clone(), p.id.val().to_string());
        self.out.push((name, p.val().into_data()));
    }
}

/// `module`'s float parameters by path, with their ids as metadata.
fn collect<M: Module>(module: &M) -> (Vec<(String, TensorData)>, HashMap<String, String>) {
    let mut c = Collect {
        path: Path_::default(),
        out: Vec::new(),
        ids: HashMap::new(),
    };
    module.visit(&mut c);
    c.out.sort_by(|a, b| a.0.cmp(&b.0));
    (c.out, c.ids)
}

struct Restore {
    path: Path_,
    tensors: HashMap<String, TensorData>,
    ids: HashMap<String, String>,
    error: Option<String>,
}

impl ModuleMapper for Restore {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let name = self.path.join();
        let (Some(data), Some(id)) = (self.tensors.remove(&name), self.ids.get(&name)) else {
            self.error.get_or_insert(format!("no tensor {name}"));
            return p;
        };
        let Ok(id) = id.parse::<u64>().map(ParamId::from) else {
            self.error
                .get_or_insert(format!("{name}: bad parameter id {id}"));
            return p;
        };
        let (old_id, old, mapper) = p.consume();
        if data.shape().to_vec() != old.dims().to_vec() {
            self.error.get_or_insert(format!(
                "{name}: saved shape {:?}, model shape {:?}",
                data.shape().to_vec(),
                old.dims()
            ));
            return Param::from_mapped_value(old_id, old, mapper);
        }
        let options = TensorCreationOptions::new(old.device()).with_dtype(old.dtype());
        let t = Tensor::<D>::from_data(data, options).set_require_grad(old.is_require_grad());
        set_parallel_attrs(id, parallel_attrs(old_id));
        Param::from_mapped_value(id, t, mapper)
    }
}

fn save_module<M: Module>(module: &M, path: &Path) -> Result<(), CheckpointError> {
    let (tensors, ids) = collect(module);
    safetensors_io::write(&tensors, ids, path).map_err(|e| io(path, e))
}

fn load_module<M: Module>(module: M, path: &Path) -> Result<M, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let (tensors, ids) = safetensors_io::read(&bytes).map_err(|e| io(path, e))?;
    let mut restore = Restore {
        path: Path_::default(),
        tensors: tensors.into_iter().collect(),
        ids,
        error: None,
    };
    let module = module.map(&mut restore);
    if let Some(e) = restore.error {
        return Err(CheckpointError::Mismatch(format!(
            "{}: {e}",
            path.display()
        )));
    }
    if let Some(extra) = restore.tensors.keys().next() {
        return Err(CheckpointError::Mismatch(format!(
            "{}: tensor {extra} has no parameter in the model",
            path.display()
        )));
    }
    Ok(module)
}

#[derive(serde::Serialize, serde::Deserialize)]
struct State {
    iteration: usize,
    grad_scaler: Option<GradScalerState>,
    /// Steps taken by the fused optimizer; absent for a burn-optim one.
    #[serde(default)]
    fused_adam_steps: Option<u32>,
    extra: serde_json::Value,
}

/// Saves one rank's model and optimizer into `dir` (see [`rank_dir`]), with `extra` (e.g.
/// scheduler and data positions) kept in `state.json`.
///
/// With a distributed optimizer call it on every data-parallel rank: the state of every
/// rank's shards is gathered into whole parameters (the same files as without it, so either
/// optimizer can load them) and data-parallel rank 0 writes. Otherwise call it on one rank
/// of the data-parallel group.
pub fn save_checkpoint<M: Module + Clone>(
    dir: &Path,
    iteration: usize,
    model: &M,
    optimizer: &MegatronOptimizer<M>,
    extra: serde_json::Value,
) -> Result<(), CheckpointError> {
    // The fused optimizer's flat buffers, cut back into per-parameter tensors by module
    // path: readable by any tool, and independent of how parameters were grouped or sharded.
    let mut flat_state = Vec::new();
    if let Some(flat) = optimizer.flat() {
        for buffer in Buffer::ALL {
            flat_state.push((buffer, flat.state_module(buffer, model)?));
        }
    }
    if optimizer.data_parallel_rank().is_some_and(|r| r != 0) {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    save_module(model, &dir.join("model.safetensors"))?;
    if let Some(master) = optimizer.master() {
        save_module(master, &dir.join("master.safetensors"))?;
    }
    if let Some(inner) = optimizer.inner() {
        let optim = dir.join("optimizer.bpk");
        inner
            .to_record()
            .save(&optim)
            .map_err(|e| io(&optim, format!("{e:?}")))?;
    }
    for (buffer, module) in &flat_state {
        let path = dir.join(format!("{}.safetensors", buffer.file_stem()));
        save_module(module, &path)?;
    }
    let state = State {
        iteration,
        grad_scaler: optimizer.grad_scaler().map(|s| s.state()),
        fused_adam_steps: optimizer.flat().map(|f| f.steps()),
        extra,
    };
    let path = dir.join("state.json");
    let text = serde_json::to_string_pretty(&state).map_err(|e| io(&path, e))?;
    std::fs::write(&path, text).map_err(|e| io(&path, e))
}

/// What [`load_checkpoint`] restores.
pub struct Restored<M: Module> {
    /// The model, with the saved weights and parameter ids.
    pub model: M,
    /// The optimizer, with its saved state.
    pub optimizer: MegatronOptimizer<M>,
    /// The iteration the checkpoint was taken after.
    pub iteration: usize,
    /// The caller's `extra`.
    pub extra: serde_json::Value,
}

/// Loads what [`save_checkpoint`] wrote in `dir` into a freshly built `model` (same
/// architecture and layout). `make_optimizer` builds the optimizer for the loaded model
/// (whose parameter ids are the saved ones, so id-based parameter groups match); its state
/// is then restored.
pub fn load_checkpoint<M: Module + Clone>(
    dir: &Path,
    model: M,
    make_optimizer: impl FnOnce(&M) -> Result<MegatronOptimizer<M>, crate::optimizer::OptimizerError>,
) -> Result<Restored<M>, CheckpointError> {
    if !dir.is_dir() {
        return Err(io(
            dir,
            "no checkpoint here (saved with another tensor-parallel size?)",
        ));
    }
    let model = load_module(model, &dir.join("model.safetensors"))?;
    let mut optimizer = make_optimizer(&model)?;
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    let state: State = serde_json::from_str(&text).map_err(|e| io(&path, e))?;
    optimizer.restore_scaler(state.grad_scaler);
    let kind = |fused: bool| {
        if fused {
            "the fused Adam"
        } else {
            "a burn-optim optimizer"
        }
    };
    if optimizer.is_fused() != state.fused_adam_steps.is_some() {
        return Err(CheckpointError::Mismatch(format!(
            "{}: saved by {}, loading into {}",
            dir.display(),
            kind(state.fused_adam_steps.is_some()),
            kind(optimizer.is_fused())
        )));
    }
    let optimizer = match (optimizer.flat_mut(), state.fused_adam_steps) {
        (Some(flat), Some(steps)) => {
            let mut modules = Vec::new();
            for buffer in Buffer::ALL {
                let path = dir.join(format!("{}.safetensors", buffer.file_stem()));
                modules.push(load_module(flat.state_template(&model), &path)?);
            }
            flat.load([&modules[0], &modules[1], &modules[2]], steps)
                .map_err(|e| CheckpointError::Mismatch(format!("{}: {e}", dir.display())))?;
            optimizer
        }
        _ => {
            let master = match optimizer.master() {
                Some(m) => Some(load_module(m.clone(), &dir.join("master.safetensors"))?),
                None => None,
            };
            let optim = dir.join("optimizer.bpk");
            let record = OptimizerRecord::load(&optim).map_err(|e| io(&optim, format!("{e:?}")))?;
            optimizer.restore(record, master)
        }
    };
    Ok(Restored {
        model,
        optimizer,
        iteration: state.iteration,
        extra: state.extra,
    })
}

#[cfg(test)]
mod tests;
