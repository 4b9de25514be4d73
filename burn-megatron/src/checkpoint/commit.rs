//! The save protocol, durable against a crash or a power loss at any step.
//!
//! 1. [`begin_checkpoint`] (one rank) clears a half-written staging directory and finishes
//!    what a crash left of an earlier commit.
//! 2. Every rank writes `iter_X.tmp/mp_rank_*/`: each file synced, then the index (under a
//!    temporary name, synced, renamed), then the rank directory synced.
//! 3. [`commit_checkpoint`] (one rank, after a barrier) checks every rank's index, writes
//!    `metadata.json` sealing them, syncs, and renames `iter_X.tmp` to `iter_X`. An existing
//!    `iter_X` is first renamed aside to `iter_X.old` and deleted only once the new one and
//!    `latest_checkpointed_iteration.txt` are in: a crash between those steps leaves
//!    `iter_X.old`, which loading takes as iteration X while `iter_X` is missing. After each
//!    rename the parent directory is synced, so the rename is on disk before the next step.

use super::index::{CheckpointIndex, CommitMetadata, FORMAT, METADATA};
use super::{CheckpointError, io};
use crate::safetensors_io::{sync, write_synced};
use std::path::{Path, PathBuf};

/// The file naming the newest committed iteration (Megatron's).
pub(super) const LATEST: &str = "latest_checkpointed_iteration.txt";

/// `ROOT/iter_{iteration:07}`.
///
/// ```
/// use burn_megatron::checkpoint::iteration_dir;
/// use std::path::Path;
/// assert_eq!(iteration_dir(Path::new("ckpt"), 5), Path::new("ckpt/iter_0000005"));
/// ```
pub fn iteration_dir(root: &Path, iteration: usize) -> PathBuf {
    root.join(format!("iter_{iteration:07}"))
}

pub(super) fn staging_dir(root: &Path, iteration: usize) -> PathBuf {
    root.join(format!("iter_{iteration:07}.tmp"))
}

/// Where a re-saved iteration's previous copy waits until the new one is in.
pub(super) fn aside_dir(root: &Path, iteration: usize) -> PathBuf {
    root.join(format!("iter_{iteration:07}.old"))
}

/// The directory holding committed iteration `iteration`: `iter_X`, or `iter_X.old` where
/// a crash mid-commit left only that.
pub fn committed_dir(root: &Path, iteration: usize) -> PathBuf {
    let done = iteration_dir(root, iteration);
    let aside = aside_dir(root, iteration);
    if !done.exists() && aside.exists() {
        aside
    } else {
        done
    }
}

pub(super) fn synced(path: &Path) -> Result<(), CheckpointError> {
    sync(path).map_err(|e| io(path, e))
}

/// Writes `text` to `path` atomically and durably: a temporary name, synced, renamed, and
/// the directory synced. `crash` names the test hook between the write and the rename.
pub(super) fn write_atomic(
    path: &Path,
    text: &str,
    crash: Option<(&str, usize)>,
) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("tmp");
    write_synced(&tmp, text.as_bytes()).map_err(|e| io(&tmp, e))?;
    if let Some((point, iteration)) = crash {
        crash_point(point, iteration);
    }
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
    synced(path.parent().unwrap_or(Path::new(".")))
}

/// The environment variable of the crash-injection test hook (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub const CRASH_AT: &str = "BURN_MEGATRON_CRASH_AT";

/// The crash-injection test hook, compiled with the feature `test-hooks` only (the examples'
/// tests turn it on): with `BURN_MEGATRON_CRASH_AT=<point>` or `<point>@<iteration>` the
/// process kills itself (SIGKILL: no destructor, no flush) when the save of that iteration
/// reaches `point`. The points, in order: `shard` (a rank has written its first file),
/// `saved` (every rank has written, the commit begins), `sealed` (`metadata.json` written),
/// `aside` (a previous copy of the iteration renamed to `.old`), `renamed` (the new
/// directory in), `latest` (the new `latest` written under its temporary name, not yet
/// renamed) and `committed` (before the previous copy is deleted). Tests use it to show
/// that a crash at any of them leaves a checkpoint that resumes exactly.
#[cfg(feature = "test-hooks")]
pub(crate) fn crash_point(point: &str, iteration: usize) {
    let Ok(wanted) = std::env::var(CRASH_AT) else {
        return;
    };
    let (name, at) = match wanted.split_once('@') {
        Some((name, at)) => (name, at.parse::<usize>().ok()),
        None => (wanted.as_str(), None),
    };
    if name == point && at.is_none_or(|at| at == iteration) {
        kill_self();
    }
}

/// Without the feature `test-hooks`, a save has no crash points.
#[cfg(not(feature = "test-hooks"))]
pub(crate) fn crash_point(_point: &str, _iteration: usize) {}

#[cfg(all(unix, feature = "test-hooks"))]
fn kill_self() {
    // SAFETY: kill(2) on our own pid with a valid signal number touches no memory.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort();
}

#[cfg(all(not(unix), feature = "test-hooks"))]
fn kill_self() {
    std::process::abort();
}

/// The newest committed checkpoint under `root`, as `latest_checkpointed_iteration.txt`
/// names it, if there is that file. (Whether that checkpoint loads is
/// [`super::latest_loadable_checkpoint`]'s question.)
pub fn read_latest(root: &Path) -> Result<Option<usize>, CheckpointError> {
    let path = root.join(LATEST);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    text.trim()
        .parse()
        .map(Some)
        .map_err(|e| io(&path, format!("not an iteration number: {e}")))
}

/// Clears what interrupted saves left behind (`iter_*.tmp`, never committed), and finishes
/// any commit a crash interrupted: where `iter_X.old` is all that is left of iteration X it
/// is renamed back, where `iter_X` is in it is deleted. Call it on one rank before the ranks
/// save `iteration` (and separate the two by a barrier).
pub fn begin_checkpoint(root: &Path, _iteration: usize) -> Result<(), CheckpointError> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        let Some(name) = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| n.starts_with("iter_") && path.is_dir())
        else {
            continue;
        };
        if name.ends_with(".tmp") {
            std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
            continue;
        }
        let Some(done) = name.strip_suffix(".old").map(|n| root.join(n)) else {
            continue;
        };
        let aside = path;
        if done.exists() {
            std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        } else {
            std::fs::rename(&aside, &done).map_err(|e| io(&done, e))?;
        }
        synced(root)?;
    }
    Ok(())
}

/// Makes iteration `iteration` under `root` the newest checkpoint, once every rank has
/// saved (one rank calls it, after a barrier): every model-parallel rank's index must be
/// there and agree, and each file its size; then `metadata.json` seals the indexes, the
/// directory is renamed in and `latest_checkpointed_iteration.txt` updated, each step
/// synced. A previous copy of the iteration is kept until the new one is in.
pub fn commit_checkpoint(root: &Path, iteration: usize) -> Result<(), CheckpointError> {
    crash_point("saved", iteration);
    let staging = staging_dir(root, iteration);
    let (index, seals) = CheckpointIndex::read_staged(&staging)?;
    if index.state().iteration != iteration {
        return Err(io(
            &staging,
            format!("holds iteration {}", index.state().iteration),
        ));
    }
    for (dir, rank) in &index.ranks {
        for (file, entry) in &rank.files {
            let path = dir.join(file);
            let len = std::fs::metadata(&path).map_err(|e| io(&path, e))?.len();
            if len != entry.bytes {
                return Err(io(
                    &path,
                    format!("{len} bytes, the index says {}", entry.bytes),
                ));
            }
        }
    }
    let metadata = CommitMetadata {
        format: FORMAT.to_string(),
        iteration,
        indexes: seals,
    };
    let path = staging.join(METADATA);
    let text = serde_json::to_string_pretty(&metadata).map_err(|e| io(&path, e))?;
    write_synced(&path, text.as_bytes()).map_err(|e| io(&path, e))?;
    // The rank directories' names and the metadata's.
    synced(&staging)?;
    crash_point("sealed", iteration);
    let (done, aside) = (iteration_dir(root, iteration), aside_dir(root, iteration));
    if done.exists() {
        if aside.exists() {
            // From an earlier crash; `done` is whole, so this copy is not the only one.
            std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        }
        std::fs::rename(&done, &aside).map_err(|e| io(&aside, e))?;
        synced(root)?;
        crash_point("aside", iteration);
    }
    std::fs::rename(&staging, &done).map_err(|e| io(&done, e))?;
    synced(root)?;
    crash_point("renamed", iteration);
    write_atomic(
        &root.join(LATEST),
        &iteration.to_string(),
        Some(("latest", iteration)),
    )?;
    crash_point("committed", iteration);
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        synced(root)?;
    }
    Ok(())
}
