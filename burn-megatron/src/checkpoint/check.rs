//! What every index of an iteration must agree on before any tensor is read: one layout,
//! every model-parallel rank's directory once, one training state, and shards that tile
//! each tensor exactly. Indexes are input like any file, so the arithmetic is checked: a
//! crafted shape or offset is an error, never an overflow or a huge allocation.

use super::index::{RankIndex, TensorEntry};
use super::{CheckpointError, io};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The directory name of model-parallel rank `(tp_rank, pp_rank, ep_rank)` when the
/// pipeline has `pp` stages and the experts are split over `ep` ranks (Megatron's: no stage
/// suffix without pipelining, an expert suffix with expert parallelism).
pub(super) fn rank_dir_name(
    (tp_rank, pp_rank, ep_rank): (usize, usize, usize),
    pp: usize,
    ep: usize,
) -> String {
    match (pp, ep) {
        (1, 1) => format!("mp_rank_{tp_rank:02}"),
        (_, 1) => format!("mp_rank_{tp_rank:02}_{pp_rank:03}"),
        _ => format!("mp_rank_{tp_rank:02}_{pp_rank:03}_{ep_rank:03}"),
    }
}

fn name_of(d: &Path) -> &str {
    d.file_name().and_then(|n| n.to_str()).unwrap_or_default()
}

/// One layout and training state, and each (TP, PP) rank's directory exactly once, holding
/// that rank's index.
pub(super) fn ranks(dir: &Path, ranks: &[(PathBuf, RankIndex)]) -> Result<(), CheckpointError> {
    let (first_dir, first) = &ranks[0];
    let layout = first.layout;
    if let Some((d, other)) = ranks.iter().find(|(_, r)| r.layout != layout) {
        return Err(io(
            d,
            format!("saved at {}, the other ranks at {layout}", other.layout),
        ));
    }
    let (tp, pp, ep) = (
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.expert_model_parallel_size,
    );
    let sizes = [
        tp,
        pp,
        ep,
        layout.virtual_pipeline_model_parallel_size,
        layout.data_parallel_size,
    ];
    let count = tp.checked_mul(pp).filter(|_| !sizes.contains(&0));
    let Some(count) = count else {
        return Err(io(first_dir, format!("an impossible layout: {layout}")));
    };
    // With experts, the experts' writers (one per EP rank and stage) need not be the dense
    // weights' (one per TP rank and stage): both sets must be complete.
    let (mut seen, mut experts_seen) = (BTreeSet::new(), BTreeSet::new());
    for (d, r) in ranks {
        let at = (r.tensor_model_parallel_rank, r.pipeline_model_parallel_rank);
        let ep_rank = r.expert_model_parallel_rank;
        if at.0 >= tp || at.1 >= pp || ep_rank >= ep {
            return Err(io(
                d,
                format!(
                    "the index of TP rank {} × PP rank {} × EP rank {ep_rank}, outside its layout \
                     {layout}",
                    at.0, at.1
                ),
            ));
        }
        let expected = rank_dir_name((at.0, at.1, ep_rank), pp, ep);
        if name_of(d) != expected {
            return Err(io(
                d,
                format!(
                    "holds the index of {expected} (TP rank {}, PP rank {}, EP rank {ep_rank})",
                    at.0, at.1
                ),
            ));
        }
        seen.insert(at);
        experts_seen.insert((ep_rank, at.1));
        if r.state != first.state {
            return Err(io(
                d,
                format!(
                    "its training state (iteration {}) differs from {}'s (iteration {}): \
                     the ranks saved different steps",
                    r.state.iteration,
                    name_of(first_dir),
                    first.state.iteration
                ),
            ));
        }
    }
    if seen.len() != count {
        // The names of the first few missing, without walking a crafted huge layout.
        let missing: Vec<String> = (0..pp)
            .flat_map(|p| (0..tp).map(move |t| (t, p)))
            .filter(|at| !seen.contains(at))
            .take(3)
            .map(|(t, p)| match ep {
                1 => rank_dir_name((t, p, 0), pp, 1),
                _ => format!("TP rank {t} × PP rank {p}"),
            })
            .collect();
        return Err(io(
            dir,
            format!(
                "{} rank directories, but the layout {layout} has {count} model-parallel ranks \
                 ({} missing): a shard is missing",
                seen.len(),
                missing.join(", ")
            ),
        ));
    }
    if ep > 1 && experts_seen.len() != ep * pp {
        return Err(io(
            dir,
            format!(
                "the experts of {} of the {} (EP rank, PP rank) pairs of {layout}: a shard is \
                 missing",
                experts_seen.len(),
                ep * pp
            ),
        ));
    }
    Ok(())
}

/// The elements of a box of `shape`, or `None` on overflow.
pub(super) fn volume(shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |v, &d| v.checked_mul(u64::try_from(d).ok()?))
}

/// The file of a set: `{set}.safetensors`, and one `optim.safetensors` for a burn-optim
/// optimizer's sets.
pub(super) fn set_file(set: &str) -> String {
    if set.starts_with("optim.") {
        super::burn_optim::FILE.to_string()
    } else {
        format!("{set}.safetensors")
    }
}

/// A file name of a rank directory: no path, no `index.json`.
fn plain_file_name(file: &str) -> bool {
    !file.is_empty()
        && file != "."
        && file != ".."
        && file != "index.json"
        && !file.contains(['/', '\\'])
}

/// Every shard inside its global shape and inside its file, each (set, name) once per rank,
/// and each tensor's shards disjoint and adding up to its whole (so they tile it exactly:
/// overlapping shards cannot hide a hole).
pub(super) fn tensors(ranks: &[(PathBuf, RankIndex)]) -> Result<(), CheckpointError> {
    type Key<'a> = (&'a str, &'a str);
    let mut all: BTreeMap<Key<'_>, Vec<(&Path, &TensorEntry)>> = BTreeMap::new();
    for (d, r) in ranks {
        if let Some(f) = r.files.keys().find(|f| !plain_file_name(f)) {
            return Err(io(&d.join("index.json"), format!("lists the file {f:?}")));
        }
        // Elements per file: each is at least a byte, so no file holds more than its size.
        let mut in_file: BTreeMap<&str, u64> = BTreeMap::new();
        let mut here = BTreeSet::new();
        for t in &r.tensors {
            let at = d.join(&t.file);
            let bad = |why: String| io(&at, format!("{} tensor {}: {why}", t.set, t.name));
            let Some(file) = r.files.get(&t.file) else {
                return Err(bad("its file is not in the index".into()));
            };
            if t.file != set_file(&t.set) {
                // Each set has its file: an entry pointing at another set's file would read
                // that set's tensor of the same name.
                return Err(bad(format!("its file should be {}", set_file(&t.set))));
            }
            if !here.insert((t.set.as_str(), t.name.as_str())) {
                return Err(bad("listed twice".into()));
            }
            let n = t.global_shape.len();
            if t.offset.len() != n || t.shape.len() != n {
                return Err(bad(format!(
                    "offset {:?} and shape {:?} for a global shape {:?}",
                    t.offset, t.shape, t.global_shape
                )));
            }
            for k in 0..n {
                let end = t.offset[k].checked_add(t.shape[k]);
                if end.is_none_or(|e| e > t.global_shape[k]) {
                    return Err(bad(format!(
                        "the shard at offset {:?} of shape {:?} is outside the global shape {:?}",
                        t.offset, t.shape, t.global_shape
                    )));
                }
            }
            let elements =
                volume(&t.shape).ok_or_else(|| bad(format!("shape {:?} overflows", t.shape)))?;
            let total = in_file.entry(&t.file).or_default();
            *total = total.saturating_add(elements);
            if *total > file.bytes {
                return Err(bad(format!(
                    "the file's {} bytes cannot hold its tensors",
                    file.bytes
                )));
            }
            all.entry((&t.set, &t.name)).or_default().push((d, t));
        }
    }
    for ((set, name), shards) in &all {
        let (d0, first) = shards[0];
        let whole = volume(&first.global_shape);
        let mut covered: u64 = 0;
        for (i, &(d, t)) in shards.iter().enumerate() {
            let at = || format!("{set} tensor {name}");
            if t.global_shape != first.global_shape {
                return Err(io(
                    &d.join(&t.file),
                    format!(
                        "{}: global shape {:?}, {} says {:?}",
                        at(),
                        t.global_shape,
                        d0.join(&first.file).display(),
                        first.global_shape
                    ),
                ));
            }
            if let Some(&(d2, _)) = shards[..i].iter().find(|(_, u)| intersects(t, u)) {
                return Err(io(
                    &d.join(&t.file),
                    format!(
                        "{}: the shard at offset {:?} overlaps one in {}",
                        at(),
                        t.offset,
                        d2.display()
                    ),
                ));
            }
            // Inside the global shape, so bounded by its volume (checked below).
            covered = covered.saturating_add(volume(&t.shape).unwrap_or(u64::MAX));
        }
        if whole != Some(covered) {
            return Err(io(
                d0,
                format!(
                    "{set} tensor {name}: its shards cover {covered} of the {} elements of \
                     the global shape {:?}: a shard is missing",
                    whole.map_or("overflowing".to_string(), |w| w.to_string()),
                    first.global_shape
                ),
            ));
        }
    }
    Ok(())
}

/// Whether two non-empty boxes (inside the same global shape) share an element.
fn intersects(a: &TensorEntry, b: &TensorEntry) -> bool {
    let empty = |t: &TensorEntry| t.shape.contains(&0);
    !empty(a)
        && !empty(b)
        && (0..a.shape.len()).all(|k| {
            // In bounds (checked before), so the sums do not overflow.
            a.offset[k] < b.offset[k] + b.shape[k] && b.offset[k] < a.offset[k] + a.shape[k]
        })
}

#[cfg(test)]
mod tests;
