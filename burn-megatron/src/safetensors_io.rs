//! Burn `TensorData` ⇄ safetensors, dtype kept (f32, f16, bf16, i64).

use burn::tensor::{DType, TensorData};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

/// A named tensor read from or written to a safetensors file.
pub(crate) type Named = Vec<(String, TensorData)>;

pub(crate) fn to_data(view: &TensorView<'_>) -> Result<TensorData, String> {
    let shape = view.shape().to_vec();
    let bytes = view.data();
    let data = match view.dtype() {
        Dtype::F32 => TensorData::new(bytemuck::pod_collect_to_vec::<u8, f32>(bytes), shape),
        Dtype::F16 => TensorData::new(bytemuck::pod_collect_to_vec::<u8, half::f16>(bytes), shape),
        Dtype::BF16 => {
            TensorData::new(bytemuck::pod_collect_to_vec::<u8, half::bf16>(bytes), shape)
        }
        Dtype::I64 => TensorData::new(bytemuck::pod_collect_to_vec::<u8, i64>(bytes), shape),
        other => return Err(format!("unsupported dtype {other:?}")),
    };
    Ok(data)
}

/// The files a Hugging Face index of a sharded checkpoint (`model.safetensors.index.json`,
/// `pytorch_model.bin.index.json`) names in its `weight_map`, each once, in name order:
/// file names of the index's directory (a path elsewhere is refused).
pub(crate) fn index_files(index: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let map = v["weight_map"].as_object().ok_or("no weight_map object")?;
    let mut files: Vec<String> = map
        .values()
        .map(|f| {
            f.as_str()
                .map(str::to_string)
                .ok_or_else(|| "a weight_map entry is not a file name".to_string())
        })
        .collect::<Result<_, _>>()?;
    files.sort();
    files.dedup();
    if let Some(bad) = files.iter().find(|f| f.contains('/') || f.contains("..")) {
        return Err(format!("{bad:?} is not a file of the directory"));
    }
    Ok(files)
}

/// Burn's dtype for a safetensors dtype.
pub(crate) fn burn_dtype(d: Dtype) -> Result<DType, String> {
    Ok(match d {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool(burn::tensor::BoolStore::Native),
        other => return Err(format!("unsupported dtype {other:?}")),
    })
}

pub(crate) fn dtype(d: DType) -> Result<Dtype, String> {
    Ok(match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        other => return Err(format!("cannot store dtype {other:?}")),
    })
}

/// Reads every tensor of `bytes`, with the file's metadata.
pub(crate) fn read(bytes: &[u8]) -> Result<(Named, HashMap<String, String>), String> {
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for name in file.names() {
        let view = file.tensor(name).map_err(|e| e.to_string())?;
        out.push((
            name.to_string(),
            to_data(&view).map_err(|e| format!("{name}: {e}"))?,
        ));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

/// Writes `tensors` (sorted by name, as safetensors requires) with `metadata`.
pub(crate) fn write(
    tensors: &Named,
    metadata: HashMap<String, String>,
    path: &Path,
) -> Result<(), String> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            let view =
                TensorView::new(dtype(data.dtype())?, data.shape().to_vec(), data.as_bytes())
                    .map_err(|e| format!("{name}: {e}"))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, String>>()?;
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| e.to_string())?;
    // Streamed to the file (no second copy in memory), then flushed to the disk.
    sync(path)
}

/// Waits until the file or directory at `path` is on disk (`fsync`). For a directory that
/// is its entries: the names of files created or renamed in it.
pub(crate) fn sync(path: &Path) -> Result<(), String> {
    // Windows cannot open a directory as a file to sync it; there the rename is all we have.
    if cfg!(not(unix)) && path.is_dir() {
        return Ok(());
    }
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    file.sync_all().map_err(|e| format!("fsync: {e}"))
}

/// Writes `bytes` to `path` and waits until they are on disk (`fsync`), so that a power loss
/// after a checkpoint names this file cannot leave it empty or short.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    file.write_all(bytes).map_err(|e| e.to_string())?;
    file.sync_all().map_err(|e| format!("fsync: {e}"))
}
