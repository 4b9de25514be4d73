//! What a checkpoint says about itself: each rank directory's `index.json` (the layout it was
//! saved at, every tensor with its global name, global shape and offset, every file with its
//! size and CRC-32), and the files read back through it, checked.

use super::{CheckpointError, io};
use crate::optimizer::GradScalerState;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The format this version writes and reads.
pub const FORMAT: &str = "burn-megatron-checkpoint-2";

/// The parallel layout a checkpoint was saved at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedLayout {
    /// Tensor-parallel size.
    pub tensor_model_parallel_size: usize,
    /// Pipeline-parallel size.
    pub pipeline_model_parallel_size: usize,
    /// Model chunks per pipeline stage.
    pub virtual_pipeline_model_parallel_size: usize,
    /// Data-parallel size.
    pub data_parallel_size: usize,
    /// Whether the optimizer state was sharded over data-parallel ranks.
    pub distributed_optimizer: bool,
}

impl std::fmt::Display for SavedLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TP {} × PP {} (V {}) × DP {}{}",
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.data_parallel_size,
            if self.distributed_optimizer {
                ", distributed optimizer"
            } else {
                ""
            }
        )
    }
}

/// One saved shard: elements `[offset, offset + shape)` of the global tensor `name` of `set`
/// (`model`, `master`, `exp_avg`, `exp_avg_sq`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TensorEntry {
    /// Which state the tensor belongs to.
    pub set: String,
    /// The global name (layers by global index).
    pub name: String,
    /// The file holding it, in the same directory.
    pub file: String,
    /// The whole tensor's shape.
    pub global_shape: Vec<usize>,
    /// This shard's first element in each dimension.
    pub offset: Vec<usize>,
    /// This shard's shape.
    pub shape: Vec<usize>,
}

/// A file's size and checksum.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    /// Bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the bytes.
    pub crc32: u32,
}

/// What every rank's state agrees on, kept in each index.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainingState {
    /// The iteration the checkpoint was taken after.
    pub iteration: usize,
    /// The loss scaler's state.
    pub grad_scaler: Option<GradScalerState>,
    /// Steps taken by the fused optimizer; `None` for a burn-optim one.
    pub fused_adam_steps: Option<u32>,
    /// The caller's additions (data position, counters).
    pub extra: serde_json::Value,
}

/// One rank directory's `index.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankIndex {
    /// [`FORMAT`].
    pub format: String,
    /// The layout saved at.
    pub layout: SavedLayout,
    /// The tensor-parallel rank that wrote it.
    pub tensor_model_parallel_rank: usize,
    /// The pipeline stage that wrote it.
    pub pipeline_model_parallel_rank: usize,
    /// The training state.
    pub state: TrainingState,
    /// Every shard written.
    pub tensors: Vec<TensorEntry>,
    /// Every file written (the index excepted).
    pub files: BTreeMap<String, FileEntry>,
    /// Parameter ids by local module path, so that a resume at the same layout keeps them.
    pub ids: BTreeMap<String, u64>,
    /// A burn-optim optimizer's per-parameter scalars (its step counters) by global name;
    /// its tensors are the `optim.*` sets.
    #[serde(default)]
    pub optimizer_scalars: BTreeMap<String, BTreeMap<String, serde_json::Value>>,
}

/// A checkpoint iteration directory, read: every rank's index, and its files on demand.
#[derive(Debug)]
pub struct CheckpointIndex {
    /// The iteration directory.
    pub dir: PathBuf,
    /// Each rank directory with its index, in name order.
    pub ranks: Vec<(PathBuf, RankIndex)>,
}

impl CheckpointIndex {
    /// Reads every `mp_rank_*/index.json` of the iteration directory `dir`.
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let entries = std::fs::read_dir(dir).map_err(|e| io(dir, format!("no checkpoint: {e}")))?;
        let mut rank_dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_dir()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("mp_rank_"))
            })
            .collect();
        rank_dirs.sort();
        if rank_dirs.is_empty() {
            return Err(io(dir, "no mp_rank_* directory: not a checkpoint"));
        }
        let mut ranks = Vec::new();
        for d in rank_dirs {
            let path = d.join("index.json");
            let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
            let index: RankIndex = serde_json::from_str(&text)
                .map_err(|e| io(&path, format!("not a checkpoint index: {e}")))?;
            if index.format != FORMAT {
                return Err(io(
                    &path,
                    format!("format {:?}, this version reads {FORMAT:?}", index.format),
                ));
            }
            ranks.push((d, index));
        }
        let first = ranks[0].1.layout;
        if let Some((d, other)) = ranks.iter().find(|(_, r)| r.layout != first) {
            return Err(io(
                d,
                format!("saved at {}, the other ranks at {first}", other.layout),
            ));
        }
        let (tp, pp) = (
            first.tensor_model_parallel_size,
            first.pipeline_model_parallel_size,
        );
        if ranks.len() != tp * pp {
            return Err(io(
                dir,
                format!(
                    "{} rank directories, but the layout {first} has {} model-parallel ranks: a shard is missing",
                    ranks.len(),
                    tp * pp
                ),
            ));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            ranks,
        })
    }

    /// The layout saved at.
    pub fn layout(&self) -> SavedLayout {
        self.ranks[0].1.layout
    }

    /// The training state (the same in every rank's index).
    pub fn state(&self) -> &TrainingState {
        &self.ranks[0].1.state
    }

    /// Every shard of `set` by global name, with the directory holding its file.
    pub(super) fn shards(&self, set: &str) -> BTreeMap<&str, Vec<(&Path, &TensorEntry)>> {
        let mut out: BTreeMap<&str, Vec<(&Path, &TensorEntry)>> = BTreeMap::new();
        for (dir, index) in &self.ranks {
            for t in index.tensors.iter().filter(|t| t.set == set) {
                out.entry(t.name.as_str())
                    .or_default()
                    .push((dir.as_path(), t));
            }
        }
        out
    }

    /// The burn-optim state's sets (`optim.{field}`) and scalars of every rank, merged.
    pub(super) fn optimizer_state(
        &self,
    ) -> (
        Vec<String>,
        BTreeMap<String, BTreeMap<String, serde_json::Value>>,
    ) {
        let mut sets: Vec<String> = Vec::new();
        let mut scalars = BTreeMap::new();
        for (_, index) in &self.ranks {
            for t in index.tensors.iter().filter(|t| t.set.starts_with("optim.")) {
                if !sets.contains(&t.set) {
                    sets.push(t.set.clone());
                }
            }
            scalars.extend(index.optimizer_scalars.clone());
        }
        sets.sort();
        (sets, scalars)
    }

    /// The index of the rank directory of `(tp_rank, pp_rank)`, if the checkpoint has it.
    pub(super) fn rank(&self, tp_rank: usize, pp_rank: usize) -> Option<&(PathBuf, RankIndex)> {
        self.ranks.iter().find(|(_, r)| {
            (r.tensor_model_parallel_rank, r.pipeline_model_parallel_rank) == (tp_rank, pp_rank)
        })
    }

    /// The bytes of `file` in `dir`, checked against that rank's index (size and CRC-32).
    pub(super) fn read_file(&self, dir: &Path, file: &str) -> Result<Vec<u8>, CheckpointError> {
        let path = dir.join(file);
        let index = &self
            .ranks
            .iter()
            .find(|(d, _)| d == dir)
            .ok_or_else(|| io(&path, "not a rank directory of this checkpoint"))?
            .1;
        let expected = index
            .files
            .get(file)
            .ok_or_else(|| io(&path, "not listed in the rank's index"))?;
        let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
        if bytes.len() as u64 != expected.bytes {
            return Err(io(
                &path,
                format!(
                    "{} bytes, the index says {}: truncated or replaced",
                    bytes.len(),
                    expected.bytes
                ),
            ));
        }
        let crc = crc32fast::hash(&bytes);
        if crc != expected.crc32 {
            return Err(io(
                &path,
                format!(
                    "CRC-32 {crc:08x}, the index says {:08x}: the file is corrupted",
                    expected.crc32
                ),
            ));
        }
        Ok(bytes)
    }
}

/// The size and checksum of a file just written.
pub(super) fn file_entry(path: &Path) -> Result<FileEntry, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    Ok(FileEntry {
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(&bytes),
    })
}
