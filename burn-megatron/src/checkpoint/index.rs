//! What a checkpoint says about itself: each rank directory's `index.json` (the layout it was
//! saved at, every tensor with its global name, global shape and offset, every file with its
//! size and CRC-32), and the files read back through it, checked.

use super::{CheckpointError, check, io};
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
    /// Expert-parallel size (1 in checkpoints from before experts).
    #[serde(default = "one")]
    pub expert_model_parallel_size: usize,
}

fn one() -> usize {
    1
}

impl std::fmt::Display for SavedLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TP {} × PP {} (V {}) × DP {}{}{}",
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.data_parallel_size,
            match self.expert_model_parallel_size {
                1 => String::new(),
                ep => format!(" × EP {ep}"),
            },
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
    /// The dimension along which `global_shape` is the real extent of a tensor its model
    /// pads (a padded vocabulary), so that a layout padding it otherwise loads it; `None` for
    /// every other tensor, and in checkpoints saved before 2026-12-07, which held such a
    /// tensor's padding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padded_dim: Option<usize>,
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
    /// The expert-parallel rank that wrote it (0 without experts).
    #[serde(default)]
    pub expert_model_parallel_rank: usize,
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

/// `metadata.json`: written into an iteration directory when it is committed, after every
/// rank's index. It seals each rank's `index.json` (size and CRC-32), so an index that was
/// edited, truncated or replaced after the commit is refused, and its presence marks a
/// directory whose save finished (Megatron's `dist_checkpointing` writes its metadata at
/// the same point).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CommitMetadata {
    /// [`FORMAT`].
    pub format: String,
    /// The iteration committed.
    pub iteration: usize,
    /// Each rank directory's `index.json` by directory name.
    pub indexes: BTreeMap<String, FileEntry>,
}

/// The name of [`CommitMetadata`]'s file in an iteration directory.
pub const METADATA: &str = "metadata.json";

/// A checkpoint iteration directory, read: every rank's index, and its files on demand.
#[derive(Debug)]
pub struct CheckpointIndex {
    /// The iteration directory.
    pub dir: PathBuf,
    /// Each rank directory with its index, in name order.
    pub ranks: Vec<(PathBuf, RankIndex)>,
}

impl CheckpointIndex {
    /// Reads the committed iteration directory `dir`: its `metadata.json`, then every
    /// `mp_rank_*/index.json` it seals, checked against it and against each other (every
    /// model-parallel rank present once, one training state, every tensor covered exactly
    /// once by shards inside its global shape).
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(METADATA);
        let bytes = std::fs::read(&path).map_err(|e| {
            io(
                &path,
                format!("{e}: not a committed checkpoint (its save did not finish, or an older version wrote it)"),
            )
        })?;
        let meta: CommitMetadata = serde_json::from_slice(&bytes)
            .map_err(|e| io(&path, format!("not a checkpoint's metadata: {e}")))?;
        if meta.format != FORMAT {
            return Err(io(
                &path,
                format!("format {:?}, this version reads {FORMAT:?}", meta.format),
            ));
        }
        let (index, _) = Self::read_ranks(dir, Some(&meta.indexes))?;
        if index.state().iteration != meta.iteration {
            return Err(io(
                &path,
                format!(
                    "iteration {}, the indexes say {}",
                    meta.iteration,
                    index.state().iteration
                ),
            ));
        }
        Ok(index)
    }

    /// Reads a staged (not yet committed) directory; returns it with each index's size and
    /// CRC-32, for its `metadata.json`.
    pub(super) fn read_staged(
        dir: &Path,
    ) -> Result<(Self, BTreeMap<String, FileEntry>), CheckpointError> {
        Self::read_ranks(dir, None)
    }

    fn read_ranks(
        dir: &Path,
        sealed: Option<&BTreeMap<String, FileEntry>>,
    ) -> Result<(Self, BTreeMap<String, FileEntry>), CheckpointError> {
        let entries = std::fs::read_dir(dir).map_err(|e| io(dir, format!("no checkpoint: {e}")))?;
        let mut rank_dirs: Vec<(String, PathBuf)> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter_map(|p| {
                let name = p.file_name()?.to_str()?.to_string();
                (p.is_dir() && name.starts_with("mp_rank_")).then_some((name, p))
            })
            .collect();
        rank_dirs.sort();
        if rank_dirs.is_empty() {
            return Err(io(dir, "no mp_rank_* directory: not a checkpoint"));
        }
        if let Some(sealed) = sealed {
            if let Some(name) = sealed
                .keys()
                .find(|n| !rank_dirs.iter().any(|(d, _)| d == *n))
            {
                return Err(io(
                    &dir.join(name),
                    "missing, though metadata.json lists it: a shard is missing",
                ));
            }
            if let Some((_, d)) = rank_dirs.iter().find(|(n, _)| !sealed.contains_key(n)) {
                return Err(io(
                    d,
                    "not listed in metadata.json: a foreign rank directory",
                ));
            }
        }
        let mut ranks = Vec::new();
        let mut seals = BTreeMap::new();
        for (name, d) in rank_dirs {
            let path = d.join("index.json");
            let missing = |e: std::io::Error| {
                let why = if e.kind() == std::io::ErrorKind::NotFound {
                    "missing: this rank's save did not finish".to_string()
                } else {
                    e.to_string()
                };
                io(&path, why)
            };
            let len = std::fs::metadata(&path).map_err(missing)?.len();
            if let Some(seal) = sealed.and_then(|s| s.get(&name))
                && len != seal.bytes
            {
                // Checked before reading, so a huge file is never read in.
                return Err(io(
                    &path,
                    format!(
                        "{len} bytes, metadata.json says {}: truncated or replaced",
                        seal.bytes
                    ),
                ));
            }
            let bytes = std::fs::read(&path).map_err(missing)?;
            let seal = FileEntry {
                bytes: bytes.len() as u64,
                crc32: crc32fast::hash(&bytes),
            };
            if let Some(expected) = sealed.and_then(|s| s.get(&name))
                && *expected != seal
            {
                return Err(io(
                    &path,
                    format!(
                        "CRC-32 {:08x}, metadata.json says {:08x}: the index is corrupted or was edited",
                        seal.crc32, expected.crc32
                    ),
                ));
            }
            let index: RankIndex = serde_json::from_slice(&bytes)
                .map_err(|e| io(&path, format!("not a checkpoint index: {e}")))?;
            if index.format != FORMAT {
                return Err(io(
                    &path,
                    format!("format {:?}, this version reads {FORMAT:?}", index.format),
                ));
            }
            seals.insert(name, seal);
            ranks.push((d, index));
        }
        check::ranks(dir, &ranks)?;
        check::tensors(&ranks)?;
        Ok((
            Self {
                dir: dir.to_path_buf(),
                ranks,
            },
            seals,
        ))
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

    /// The index of the rank directory of `(tp_rank, pp_rank, ep_rank)`, if the checkpoint
    /// has it.
    pub(super) fn rank(&self, at: (usize, usize, usize)) -> Option<&(PathBuf, RankIndex)> {
        self.ranks.iter().find(|(_, r)| {
            let ep = r.expert_model_parallel_rank;
            (
                r.tensor_model_parallel_rank,
                r.pipeline_model_parallel_rank,
                ep,
            ) == at
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
        // The size first, so that a file larger than the index says is never read in.
        let len = std::fs::metadata(&path).map_err(|e| io(&path, e))?.len();
        if len != expected.bytes {
            return Err(io(
                &path,
                format!(
                    "{len} bytes, the index says {}: truncated or replaced",
                    expected.bytes
                ),
            ));
        }
        let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
        if bytes.len() as u64 != expected.bytes {
            return Err(io(&path, "changed while it was read"));
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
