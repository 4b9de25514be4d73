//! Before a save, the tensor-parallel ranks of each pipeline stage check that they agree on
//! what each parameter is: its global name and shape, whether it is sharded and along which
//! dimension, and — for a parameter every rank holds a copy of — its value.
//!
//! Placement comes from the parallel attributes the layers state (see
//! [`crate::tensor_parallel::set_layout_attrs`]). Where they are missing (a custom layer
//! that shards a parameter without stating it) or stale (ids changed by a record load with
//! no forward since), every rank takes its shard for a whole duplicated tensor and only TP
//! rank 0 writes it: the other shards would be lost without a word. The ranks' copies of a
//! duplicated parameter are equal bit for bit (initialised from one seed, stepped with the
//! same gradients), so shards mistaken for copies show up as copies that differ.

use super::tensors::placement;
use super::{CheckpointError, CheckpointRank};
use crate::comm::{Comm, CommunicatorExt};
use crate::module_path::{PathVisitor, visit_paths};
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, Param};
use burn::tensor::Tensor;
use std::hash::{Hash, Hasher};

/// What one rank states about one parameter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
struct Fact {
    name: String,
    global_shape: Vec<usize>,
    /// The partition dimension of a tensor-parallel shard.
    partition_dim: Option<usize>,
    /// The second copy of a tied weight, which is not written.
    shared: bool,
    /// CRC-32 of a duplicated parameter's bytes.
    copy_crc32: Option<u32>,
}

fn facts<M: Module>(model: &M, rank: &CheckpointRank<'_>) -> Vec<Fact> {
    struct Facts<'a, 'b>(&'a CheckpointRank<'b>, Vec<Fact>);
    impl PathVisitor for Facts<'_, '_> {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            let (rank, value) = (self.0, p.val());
            let attrs = parallel_attrs(p.id);
            // Experts differ per rank by design (expert parallelism may span TP ranks).
            if attrs.expert {
                return;
            }
            let (tp_rank, tp) = rank.tp();
            let sharded = attrs.split_dim().is_some();
            let copy_crc32 = (!sharded).then(|| crc32fast::hash(value.clone().into_data().bytes()));
            self.1.push(Fact {
                name: (rank.names)(path),
                global_shape: placement(p.id, &value.dims(), tp_rank, tp).global_shape,
                partition_dim: attrs.split_dim(),
                shared: attrs.shared,
                copy_crc32,
            });
        }
    }
    let mut f = Facts(rank, Vec::new());
    visit_paths(model, &mut f);
    f.1.sort_by(|a, b| a.name.cmp(&b.name));
    f.1
}

fn digest(facts: &[Fact]) -> i64 {
    let mut h = std::hash::DefaultHasher::new();
    facts.hash(&mut h);
    h.finish() as i64
}

/// Checks, over `model_parallel` (the tp × pp group, every member of which saves), that the
/// tensor-parallel ranks of this rank's stage state the same facts about every parameter.
/// Collective; every member gets the same verdict.
pub(super) fn check_tensor_parallel_layout<M: Module>(
    model: &M,
    rank: &CheckpointRank<'_>,
    model_parallel: &Comm,
) -> Result<(), CheckpointError> {
    if model_parallel.group().size() == 1 {
        return Ok(());
    }
    let mine = facts(model, rank);
    let (tp_rank, stage) = (
        rank.tensor_model_parallel_rank,
        rank.pipeline_model_parallel_rank,
    );
    let bad_record = |e: serde_json::Error| {
        CheckpointError::Mismatch(format!("checking the layout before saving: {e}"))
    };
    let all = model_parallel.all_gather_vec(vec![stage as i64, digest(&mine)])?;
    let members = all.len() / 2;
    let same_stage: Vec<usize> = (0..members)
        .filter(|&i| all[2 * i] == stage as i64)
        .collect();
    let agreed = same_stage
        .iter()
        .all(|&i| all[2 * i + 1] == all[2 * same_stage[0] + 1]);
    // Some stage disagrees: every member takes part in the exchange that names it.
    let any_disagrees = (0..members).any(|i| {
        (0..members).any(|j| all[2 * j] == all[2 * i] && all[2 * j + 1] != all[2 * i + 1])
    });
    if !any_disagrees {
        return Ok(());
    }
    let mut text = serde_json::to_vec(&(tp_rank, &mine)).map_err(bad_record)?;
    let lens = model_parallel.all_gather_vec(vec![text.len() as i64])?;
    let width = lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    text.resize(width.div_ceil(8) * 8, 0);
    let words: Vec<i64> = text
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("padded to 8")))
        .collect();
    let gathered = model_parallel.all_gather_vec(words)?;
    if agreed {
        return Err(CheckpointError::Mismatch(
            "another pipeline stage's tensor-parallel ranks disagree on the layout of what \
             they save (see its error)"
                .into(),
        ));
    }
    let per = width.div_ceil(8);
    let mut theirs: Vec<(usize, Vec<Fact>)> = Vec::new();
    for &i in &same_stage {
        let bytes: Vec<u8> = gathered[i * per..(i + 1) * per]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .take(lens[i].max(0) as usize)
            .collect();
        theirs.push(serde_json::from_slice(&bytes).map_err(bad_record)?);
    }
    Err(CheckpointError::Mismatch(describe(stage, &theirs)))
}

/// The first parameter the stage's tensor-parallel ranks disagree on, named.
fn describe(stage: usize, ranks: &[(usize, Vec<Fact>)]) -> String {
    let says = |f: Option<&Fact>| match f {
        None => "no such parameter".to_string(),
        Some(f) => match f.partition_dim {
            Some(d) => format!("a shard along dim {d} of {:?}", f.global_shape),
            None => format!(
                "a copy of {:?} with CRC-32 {:08x}",
                f.global_shape,
                f.copy_crc32.unwrap_or(0)
            ),
        },
    };
    let (first_rank, first) = &ranks[0];
    let mut names: Vec<&str> = ranks
        .iter()
        .flat_map(|(_, f)| f.iter().map(|f| f.name.as_str()))
        .collect();
    names.sort();
    names.dedup();
    for name in names {
        let find = |facts: &[Fact]| facts.iter().find(|f| f.name == name).cloned();
        let a = find(first);
        if let Some((r, b)) = ranks
            .iter()
            .map(|(r, f)| (r, find(f)))
            .find(|(_, b)| *b != a)
        {
            return format!(
                "tensor-parallel ranks of stage {stage} disagree on {name}: TP rank {first_rank} \
                 holds {}, TP rank {r} {} — a layer that shards a parameter without stating it \
                 (set_layout_attrs in its forward), or attributes gone stale (a record loaded \
                 with no forward since); saving would lose shards",
                says(a.as_ref()),
                says(b.as_ref())
            );
        }
    }
    format!("tensor-parallel ranks of stage {stage} disagree on the parameters they save")
}

#[cfg(test)]
mod tests;
