//! A burn-optim optimizer's state under global names, so that it loads at any layout too.
//!
//! burn-optim's record keys everything by parameter id: tensors `"{id}.{field}"` (Adam's
//! moments, each of the parameter's shape), scalars `"{id}.{key}"` (its step counter, the
//! tensor rank) and the parameter's module path under `"{id}"`. Saved, each state tensor
//! becomes a shard of set `optim.{field}` under the parameter's global name, placed like the
//! parameter, and the scalars are kept by global name in the index. Loaded, the record is
//! rebuilt for the new model's ids from the slices of the new layout.

use super::find::stored_key;
use super::index::TensorEntry;
use super::tensors::{Files, Placement, placement, written_here};
use super::{CheckpointError, io};
use crate::module_path::{PathVisitor, visit_paths};
use crate::safetensors_io;
use burn::module::{Module, Param, ParamId};
use burn::optim::OptimizerRecord;
use burn::tensor::{Bytes, Tensor, TensorData};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Scalars of one parameter's state, by key.
pub(super) type Scalars = BTreeMap<String, serde_json::Value>;

/// The one file holding every `optim.*` set.
pub(super) const FILE: &str = "optim.safetensors";

fn scalar_to_json(s: &burn_pack::Scalar) -> serde_json::Value {
    match *s {
        burn_pack::Scalar::Int(v) => serde_json::json!({ "int": v }),
        burn_pack::Scalar::UInt(v) => serde_json::json!({ "uint": v }),
        burn_pack::Scalar::Float(v) => serde_json::json!({ "float": v }),
        burn_pack::Scalar::Bool(v) => serde_json::json!({ "bool": v }),
    }
}

fn scalar_from_json(v: &serde_json::Value) -> Option<burn_pack::Scalar> {
    let (kind, value) = v.as_object()?.iter().next()?;
    Some(match kind.as_str() {
        "int" => burn_pack::Scalar::Int(value.as_i64()?),
        "uint" => burn_pack::Scalar::UInt(value.as_u64()?),
        "float" => burn_pack::Scalar::Float(value.as_f64()?),
        "bool" => burn_pack::Scalar::Bool(value.as_bool()?),
        _ => return None,
    })
}

/// (local path, dims, trainable) of each float parameter, by id.
fn params<M: Module>(model: &M) -> HashMap<ParamId, (String, Vec<usize>, bool)> {
    struct P(HashMap<ParamId, (String, Vec<usize>, bool)>);
    impl PathVisitor for P {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            let v = p.val();
            self.0.insert(
                p.id,
                (path.to_string(), v.dims().to_vec(), v.is_require_grad()),
            );
        }
    }
    let mut p = P(HashMap::new());
    visit_paths(model, &mut p);
    p.0
}

/// Writes `record` (of an optimizer of `model`) into `dir` under global names: the index
/// entries of its tensors and its scalars by global name.
pub(super) fn save<M: Module>(
    dir: &Path,
    record: OptimizerRecord,
    model: &M,
    names: &dyn Fn(&str) -> String,
    tp: (usize, usize),
    share: super::SaveShare,
) -> Result<(Vec<TensorEntry>, BTreeMap<String, Scalars>), CheckpointError> {
    let path = dir.join(FILE);
    let bytes = record
        .into_bytes()
        .map_err(|e| io(&path, format!("reading the optimizer's record: {e:?}")))?;
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| io(&path, format!("{e:?}")))?;
    let by_id = params(model);
    // Written once, as the weights.
    let owned = |id: u64| -> Option<(String, Vec<usize>)> {
        let id = ParamId::from(id);
        let (path, dims, _) = by_id.get(&id)?;
        written_here(id, tp.0, share).then(|| (names(path), dims.clone()))
    };
    let mut scalars: BTreeMap<String, Scalars> = BTreeMap::new();
    for (key, value) in reader.scalars() {
        let Some((id, field)) = key.split_once('.') else {
            continue;
        };
        if let Some((name, _)) = id.parse().ok().and_then(owned) {
            scalars
                .entry(name)
                .or_default()
                .insert(field.to_string(), scalar_to_json(value));
        }
    }
    let mut named = Vec::new();
    let mut entries = Vec::new();
    for t in reader
        .into_tensors()
        .map_err(|e| io(&path, format!("{e:?}")))?
    {
        let (name, dtype, shape, param_id, bytes) =
            t.into_parts().map_err(|e| io(&path, format!("{e:?}")))?;
        let (Some(id), Some((_, field))) = (param_id, name.split_once('.')) else {
            continue;
        };
        let Some((global, dims)) = owned(id) else {
            continue;
        };
        let shape = shape.to_vec();
        if shape != dims {
            return Err(io(
                &path,
                format!("state {field} of {global} has shape {shape:?}, the parameter {dims:?}"),
            ));
        }
        let set = format!("optim.{field}");
        let placement = placement(ParamId::from(id), &dims, tp.0, tp.1);
        let Some(data) = placement.stored_part(TensorData::from_bytes(bytes, shape, dtype)) else {
            continue;
        };
        let Placement {
            global_shape,
            offset,
            padded_dim,
            ..
        } = placement;
        entries.push(TensorEntry {
            set: set.clone(),
            name: global.clone(),
            file: FILE.to_string(),
            global_shape,
            offset,
            shape: data.shape().to_vec(),
            padded_dim,
        });
        // One safetensors key per (set, name).
        named.push((stored_key(&set, &global), data));
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    entries.sort_by(|a, b| (&a.set, &a.name).cmp(&(&b.set, &b.name)));
    safetensors_io::write(&named, HashMap::new(), &path).map_err(|e| io(&path, e))?;
    Ok((entries, scalars))
}

/// The record of an optimizer of `model` at this rank's layout, from the checkpoint's
/// `optim.*` shards and `scalars` (by global name).
pub(super) fn load<M: Module>(
    files: &mut Files<'_>,
    sets: &[String],
    scalars: &BTreeMap<String, Scalars>,
    model: &M,
    names: &dyn Fn(&str) -> String,
    tp: (usize, usize),
) -> Result<OptimizerRecord, CheckpointError> {
    let mut tensors = Vec::new();
    let mut writer_scalars = Vec::new();
    let mut paths = Vec::new();
    let mut by_id: Vec<_> = params(model).into_iter().collect();
    by_id.sort_by_key(|(id, _)| id.val());
    for (id, (path, dims, trainable)) in by_id {
        if !trainable {
            continue;
        }
        let global = names(&path);
        let Some(own) = scalars.get(&global) else {
            // A parameter the optimizer never stepped has no state; it starts fresh.
            continue;
        };
        let key = id.val().to_string();
        for (k, v) in own {
            let s = scalar_from_json(v).ok_or_else(|| {
                CheckpointError::Mismatch(format!("optimizer scalar {k} of {global}: {v}"))
            })?;
            writer_scalars.push((format!("{key}.{k}"), s));
        }
        paths.push((key.clone(), path.clone()));
        let want = placement(id, &dims, tp.0, tp.1);
        for set in sets {
            let field = set.strip_prefix("optim.").unwrap_or(set);
            let data = files.slice_in(set, &stored_key(set, &global), &global, &want, &dims)?;
            let (bytes, dtype) = (data.as_bytes().to_vec(), data.dtype());
            tensors.push(burn_pack::Tensor::new(
                format!("{key}.{field}"),
                dtype,
                dims.clone(),
                Some(id.val()),
                Bytes::from_bytes_vec(bytes),
            ));
        }
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, s) in &writer_scalars {
        writer = writer.with_scalar(k, *s);
    }
    for (k, p) in &paths {
        writer = writer.with_metadata(k, p);
    }
    let bytes = writer.into_bytes().map_err(|e| {
        CheckpointError::Mismatch(format!("rebuilding the optimizer record: {e:?}"))
    })?;
    OptimizerRecord::from_bytes(bytes)
        .map_err(|e| CheckpointError::Mismatch(format!("rebuilding the optimizer record: {e:?}")))
}
