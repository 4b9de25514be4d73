//! Which checkpoint to load: a chosen iteration, checked whole, or the newest one that is.

use super::commit::{LATEST, committed_dir, read_latest};
use super::index::CheckpointIndex;
use super::{CheckpointError, io};
use safetensors::SafeTensors;
use std::collections::BTreeSet;
use std::path::Path;

/// The key of an index entry in its safetensors file: its global name, or for a
/// burn-optim state set (`optim.*`, all in one file) `{set}/{name}`.
pub(super) fn stored_key(set: &str, name: &str) -> String {
    if set.starts_with("optim.") {
        format!("{set}/{name}")
    } else {
        name.to_string()
    }
}

/// Checks committed iteration `iteration` under `root` whole, without a model: its
/// metadata and every index (as [`CheckpointIndex::read`]), every file's size and CRC-32,
/// and every indexed tensor present in its file with its indexed shape. Returns the index.
pub fn verify_checkpoint(
    root: &Path,
    iteration: usize,
) -> Result<CheckpointIndex, CheckpointError> {
    let index = CheckpointIndex::read(&committed_dir(root, iteration))?;
    if index.state().iteration != iteration {
        return Err(io(
            &index.dir,
            format!("holds iteration {}", index.state().iteration),
        ));
    }
    for (dir, rank) in &index.ranks {
        for file in rank.files.keys() {
            let path = dir.join(file);
            let bytes = index.read_file(dir, file)?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| io(&path, format!("not a safetensors file: {e}")))?;
            for t in rank.tensors.iter().filter(|t| &t.file == file) {
                let key = stored_key(&t.set, &t.name);
                let view = st.tensor(&key).map_err(|_| {
                    io(&path, format!("no tensor {key}, though the index lists it"))
                })?;
                if view.shape() != t.shape.as_slice() {
                    return Err(io(
                        &path,
                        format!(
                            "{key} has shape {:?}, the index says {:?}",
                            view.shape(),
                            t.shape
                        ),
                    ));
                }
            }
        }
    }
    Ok(index)
}

/// The checkpoint [`latest_loadable_checkpoint`] found.
#[derive(Debug)]
pub struct LoadableCheckpoint {
    /// Its iteration.
    pub iteration: usize,
    /// Its index, verified.
    pub index: CheckpointIndex,
    /// Newer iterations that did not verify, newest first, with why.
    pub skipped: Vec<(usize, CheckpointError)>,
}

/// The iterations with a committed directory under `root` (`iter_X`, or `iter_X.old`).
fn committed_iterations(root: &Path) -> BTreeSet<usize> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return BTreeSet::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let digits = name.strip_prefix("iter_")?;
            let digits = digits.strip_suffix(".old").unwrap_or(digits);
            (digits.len() >= 7 && digits.bytes().all(|b| b.is_ascii_digit()))
                .then(|| digits.parse().ok())?
        })
        .collect()
}

/// The newest checkpoint under `root` that verifies ([`verify_checkpoint`]), among those
/// at or before the iteration `latest_checkpointed_iteration.txt` names (an older run's
/// newer iterations are another history). Each newer one that does not verify is skipped
/// with a warning naming what failed. Without a readable `latest` file every committed
/// iteration is a candidate (a crash before the first `latest` was written). `None` where
/// there is no checkpoint at all; an error where there are some and none verifies.
pub fn latest_loadable_checkpoint(
    root: &Path,
) -> Result<Option<LoadableCheckpoint>, CheckpointError> {
    let latest = match read_latest(root) {
        Ok(latest) => latest,
        Err(e) => {
            tracing::warn!(
                "{e}; trying every committed checkpoint under {}",
                root.display()
            );
            None
        }
    };
    let mut candidates = committed_iterations(root);
    if let Some(latest) = latest {
        candidates.retain(|&i| i <= latest);
        candidates.insert(latest);
    }
    let mut skipped = Vec::new();
    for &iteration in candidates.iter().rev() {
        match verify_checkpoint(root, iteration) {
            Ok(index) => {
                return Ok(Some(LoadableCheckpoint {
                    iteration,
                    index,
                    skipped,
                }));
            }
            Err(e) => {
                tracing::warn!(
                    "checkpoint iteration {iteration} under {} does not verify, trying an older one: {e}",
                    root.display()
                );
                skipped.push((iteration, e));
            }
        }
    }
    if skipped.is_empty() {
        return Ok(None);
    }
    let why: Vec<String> = skipped
        .iter()
        .map(|(i, e)| format!("iteration {i}: {e}"))
        .collect();
    Err(io(
        &root.join(LATEST),
        format!("no checkpoint verifies ({})", why.join("; ")),
    ))
}
