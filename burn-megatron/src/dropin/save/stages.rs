//! The plain model's record, written from a model split into pipeline stages (and split by
//! tensor parallelism within each): what `save_gathered` does for one stage, over all of
//! them.
//!
//! The writer is tensor-parallel rank 0 of the first pipeline stage. It writes its own
//! stage's tensors as `save_gathered` does, and asks each other stage for its tensors one at
//! a time: a token to the stage's tensor-parallel rank 0, which gathers the tensor over its
//! group and sends it back. So the writer holds one whole tensor at a time, and a send (which
//! never waits for its receiver) cannot fill the writer's memory ahead of the file.

use super::safetensors::write as write_safetensors;
use super::safetensors::{Layout, layouts, remove_index, shard_name, write_index};
use super::{Entry, SaveOptions, entries, entries_in, gather_all, write};
use crate::comm::{Buffer, CHECKPOINT_BARRIER_TIMEOUT, Comm, CommDType, CommunicatorExt};
use crate::dropin::PpStage;
use crate::pipeline::PipelineError;
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, ParamGroup, ParamId};
use burn::tensor::{DType, TensorData};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

/// What the writer needs to know of another stage's tensor before asking for it.
#[derive(Serialize, Deserialize)]
struct Meta {
    path: String,
    id: u64,
    dtype: DType,
    shape: Vec<usize>,
}

/// Writes the record the whole plain model saves with `Module::save_file` (a burnpack file
/// at `path`, each parameter whole under the whole model's module path), from this rank's
/// `chunks`, built for `stages` (from [`PpPlan::stages`](crate::dropin::PpPlan::stages)). Burn's
/// `load_file` reads it into the plain model, and
/// [`load_sharded`](crate::dropin::load_sharded) into any layout.
///
/// Collective over the model-parallel ranks of one replica: every rank of `tp` (its
/// tensor-parallel group) and `pp` (its pipeline group, `ctx.groups.pp`) calls it. The
/// writer holds one whole tensor at a time. Each exchange waits at most the collective
/// timeout, and a failed write or gather is an error on every rank.
pub fn save_gathered_stages<M: Module>(
    chunks: &[M],
    stages: &[PpStage],
    path: impl AsRef<Path>,
    tp: &Comm,
    pp: &Comm,
) -> Result<(), PipelineError> {
    let path = path.as_ref();
    check_stages(chunks.len(), stages, pp)?;
    let mut mine: Vec<Entry> = Vec::new();
    for (chunk, stage) in chunks.iter().zip(stages) {
        for mut e in entries(chunk, tp) {
            // The last stage's copy of a tied weight: the first stage's is written.
            if parallel_attrs(ParamId::from(e.id)).shared {
                continue;
            }
            e.path = stage.global_name(&e.path);
            mine.push(e);
        }
    }
    let written = match tp.group().rank() {
        0 => lead(mine, path, pp),
        _ => gather_all(&mine),
    };
    agreed_stages(written, path, tp, pp)
}

/// [`save_safetensors`](super::save_safetensors) for a model split into pipeline stages (and
/// by tensor parallelism within each), as a sharded Hugging Face checkpoint: each stage's
/// tensor-parallel rank 0 writes its stage's parameters, under the whole model's paths, to
/// its own file beside `path` (`model-0000{s+1}-of-0000{P}.safetensors` for
/// `model.safetensors`), and the first stage's the index naming them
/// (`model.safetensors.index.json`, written last; a file at `path` itself goes). No tensor
/// crosses stages. `chunks` and `stages` as for [`save_gathered_stages`]; `options`' patterns
/// name whole-model paths. A tied weight's second copy (on the last stage) is not written.
///
/// Collective over the model-parallel ranks of one replica, as [`save_gathered_stages`].
/// Errors on every rank: those of `save_safetensors`, a stage layout that does not match
/// `pp`, and `with_max_shard_bytes` (the files are the stages).
pub fn save_safetensors_stages<M: Module>(
    chunks: &[M],
    stages: &[PpStage],
    path: impl AsRef<Path>,
    tp: &Comm,
    pp: &Comm,
    options: &SaveOptions,
) -> Result<(), PipelineError> {
    let path = path.as_ref();
    check_stages(chunks.len(), stages, pp)?;
    if options.max_shard_bytes().is_some() {
        return Err(PipelineError::Invalid(
            "with_max_shard_bytes: a model split into pipeline stages writes a file per stage"
                .into(),
        ));
    }
    let (mut mine, mut layout): (Vec<Entry>, Vec<Layout>) = (Vec::new(), Vec::new());
    for (chunk, stage) in chunks.iter().zip(stages) {
        let entries = entries_in(chunk, tp, &ParamGroup::all());
        let layouts = layouts(chunk, &entries, options.pytorch_adapter());
        for (mut e, l) in entries.into_iter().zip(layouts) {
            e.path = stage.global_name(&e.path);
            let skipped = options.skips(&e.path);
            if !skipped && !parallel_attrs(ParamId::from(e.id)).shared {
                mine.push(e);
                layout.push(l);
            }
        }
    }
    let (rank, n) = (pp.group().rank(), pp.group().size());
    let name = shard_name(path, rank, n);
    let written = match tp.group().rank() {
        0 => {
            let dir = path.parent().unwrap_or(Path::new("."));
            // No index over a mix of old and new files while they are written.
            let cleared = match rank {
                0 => remove_index(path),
                _ => Ok(()),
            };
            let mine =
                cleared.and_then(|()| write_safetensors(&mine, &layout, &dir.join(&name), options));
            // Every stage's names to the first, or `null` for a stage that failed, whatever
            // each wrote; the stages wait for the slowest writer as for a checkpoint.
            let names = mine.as_ref().ok();
            let json = serde_json::to_vec(&names).map_err(|e| e.to_string());
            let waited = pp.barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT);
            let all = (waited.map_err(|e| e.to_string()))
                .and(json)
                .and_then(|json| all_gather_bytes(pp, &json));
            match (mine, all) {
                (Err(e), _) | (_, Err(e)) => Err(e),
                (Ok(_), Ok(all)) if rank == 0 => {
                    let files = (all.iter().enumerate())
                        .map(|(s, json)| {
                            let tensors: Option<Vec<(String, usize)>> =
                                serde_json::from_slice(json).map_err(|e| e.to_string())?;
                            let tensors = tensors.ok_or_else(|| {
                                format!("pipeline stage {s} failed to write its file: no index")
                            })?;
                            Ok((shard_name(path, s, n), tensors))
                        })
                        .collect::<Result<Vec<_>, String>>();
                    files.and_then(|files| write_index(path, &files))
                }
                (Ok(_), Ok(_)) => Ok(()),
            }
        }
        _ => gather_all(&mine),
    };
    agreed_stages(written, path, tp, pp)
}

/// This rank's part of a write over the stages as the outcome on every rank: an error
/// anywhere is an error everywhere, naming `path`.
fn agreed_stages(
    written: Result<(), String>,
    path: &Path,
    tp: &Comm,
    pp: &Comm,
) -> Result<(), PipelineError> {
    // The writers may still be writing: the others wait for them as for a checkpoint. Then
    // every rank learns whether any failed: over its stage, then over the stages.
    tp.barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT)?;
    pp.barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT)?;
    let failed = pp.any_rank(tp.any_rank(written.is_err())?)?;
    match (written, failed) {
        (Err(e), _) => Err(PipelineError::Invalid(format!("{}: {e}", path.display()))),
        (Ok(()), false) => Ok(()),
        (Ok(()), true) => Err(PipelineError::Invalid(format!(
            "{}: not written: another rank failed to write or gather it (see its error)",
            path.display()
        ))),
    }
}

/// One chunk per stage, each stage at this rank's place in `pp`.
fn check_stages(chunks: usize, stages: &[PpStage], pp: &Comm) -> Result<(), PipelineError> {
    let (pp_rank, pp_size) = (pp.group().rank(), pp.group().size());
    if chunks != stages.len() || stages.is_empty() {
        return Err(PipelineError::Invalid(format!(
            "{} chunks for {} stages (one chunk per stage)",
            chunks,
            stages.len()
        )));
    }
    if let Some(s) = stages.iter().find(|s| {
        let p = s.position();
        (p.pipeline_size, p.pipeline_rank) != (pp_size, pp_rank)
    }) {
        return Err(PipelineError::Invalid(format!(
            "a stage at pipeline rank {} of {}, but the pipeline group {} is rank {pp_rank} of \
             {pp_size}",
            s.position().pipeline_rank,
            s.position().pipeline_size,
            pp.group()
        )));
    }
    Ok(())
}

/// A stage's tensor-parallel rank 0: the writer on the first stage, a server on the others.
fn lead(mine: Vec<Entry>, path: &Path, pp: &Comm) -> Result<(), String> {
    let meta: Vec<Meta> = (mine.iter())
        .map(|e| Meta {
            path: e.path.clone(),
            id: e.id,
            dtype: e.dtype,
            shape: e.shape.clone(),
        })
        .collect();
    let json = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
    let all = all_gather_bytes(pp, &json)?;
    if pp.group().rank() != 0 {
        return serve(&mine, pp);
    }
    let mut entries = mine;
    for (stage, json) in all.iter().enumerate().skip(1) {
        let metas: Vec<Meta> = serde_json::from_slice(json).map_err(|e| e.to_string())?;
        for (index, m) in metas.into_iter().enumerate() {
            let (comm, bytes) = (
                pp.clone(),
                m.shape.iter().product::<usize>() * m.dtype.size(),
            );
            let (dtype, shape, name) = (m.dtype, m.shape.clone(), m.path.clone());
            let fetch = move |keep: bool| -> Result<Option<TensorData>, String> {
                let comm_err = |e: crate::comm::CommError| e.to_string();
                comm.send(Buffer::I64(vec![i64::from(keep)]), stage)
                    .map_err(comm_err)?;
                if !keep {
                    return Ok(None);
                }
                let mut status = Buffer::I64(vec![0]);
                comm.recv(&mut status, stage).map_err(comm_err)?;
                if status != Buffer::I64(vec![1]) {
                    return Err(format!(
                        "pipeline stage {stage} failed to gather `{name}` (its tensor {index})"
                    ));
                }
                let mut words = Buffer::zeros(CommDType::I64, bytes.div_ceil(8));
                comm.recv(&mut words, stage).map_err(comm_err)?;
                let data = words.bytes()[..bytes].to_vec();
                Ok(Some(TensorData::from_bytes_vec(data, shape.clone(), dtype)))
            };
            entries.push(Entry {
                path: m.path,
                id: m.id,
                dtype: m.dtype,
                shape: m.shape,
                gather: Arc::new(fetch),
            });
        }
    }
    write(&entries, path)
}

/// Another stage's tensor-parallel rank 0: each of its tensors gathered in order (its
/// group's ranks gather with it) and sent when the writer asks for it.
fn serve(mine: &[Entry], pp: &Comm) -> Result<(), String> {
    let mut first = Ok(());
    for e in mine {
        let mut token = Buffer::I64(vec![0]);
        pp.recv(&mut token, 0).map_err(|e| e.to_string())?;
        let keep = token == Buffer::I64(vec![1]);
        let gathered = (e.gather)(keep);
        if !keep {
            continue;
        }
        let sent = match gathered {
            Ok(Some(data)) => pp
                .send(Buffer::I64(vec![1]), 0)
                .and_then(|()| pp.send(words(data.as_bytes()), 0)),
            Ok(None) => pp.send(Buffer::I64(vec![0]), 0),
            Err(err) => {
                if first.is_ok() {
                    first = Err(err);
                }
                pp.send(Buffer::I64(vec![0]), 0)
            }
        };
        sent.map_err(|e| e.to_string())?;
    }
    first
}

/// `bytes` in 8-byte words (zeros after the end), for a channel of typed elements.
fn words(bytes: &[u8]) -> Buffer {
    let mut buf = Buffer::zeros(CommDType::I64, bytes.len().div_ceil(8));
    buf.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
    buf
}

/// Every member's `bytes`, in member order.
fn all_gather_bytes(comm: &Comm, bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let err = |e: crate::comm::CommError| e.to_string();
    let lengths = comm.all_gather_vec(vec![bytes.len() as i64]).map_err(err)?;
    let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
    let mut mine = words(bytes);
    if let Buffer::I64(v) = &mut mine {
        v.resize(longest.div_ceil(8), 0);
    }
    let all = comm.all_gather(mine).map_err(err)?;
    let raw = all.bytes();
    let stride = longest.div_ceil(8) * 8;
    Ok((lengths.iter().enumerate())
        .map(|(i, &n)| raw[i * stride..i * stride + n as usize].to_vec())
        .collect())
}
