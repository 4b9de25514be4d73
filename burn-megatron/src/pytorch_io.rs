//! PyTorch checkpoints (`torch.save` of a state dict), read by Burn's `pytorch-reader` a
//! tensor at a time.

use burn::tensor::DType;
use std::path::Path;

/// Whether `path` names a PyTorch checkpoint by its extension (`.pt`, `.pth`, `.bin`).
pub(crate) fn is_pytorch(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("pt" | "pth" | "bin")
    )
}

/// A tensor of a checkpoint, its bytes not read yet.
pub(crate) struct Stored {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// Reads the bytes (contiguous, native-endian) when asked.
    pub(crate) tensor: pytorch_reader::Tensor,
}

/// The tensors of the checkpoint at `path` (its state dict under `top_level_key`, if given).
pub(crate) fn tensors(path: &Path, top_level_key: Option<&str>) -> Result<Vec<Stored>, String> {
    let reader = match top_level_key {
        Some(key) => pytorch_reader::PytorchReader::with_top_level_key(path, key),
        None => pytorch_reader::PytorchReader::new(path),
    }
    .map_err(|e| e.to_string())?;
    Ok(reader
        .into_tensors()
        .into_iter()
        .map(|(name, tensor)| Stored {
            name,
            dtype: burn_dtype(tensor.dtype()),
            shape: tensor.shape().to_vec(),
            tensor,
        })
        .collect())
}

/// Burn's dtype for a PyTorch storage's.
fn burn_dtype(d: pytorch_reader::DType) -> DType {
    use pytorch_reader::DType as T;
    match d {
        T::F64 => DType::F64,
        T::F32 => DType::F32,
        T::F16 => DType::F16,
        T::BF16 => DType::BF16,
        T::I64 => DType::I64,
        T::I32 => DType::I32,
        T::I16 => DType::I16,
        T::I8 => DType::I8,
        T::U64 => DType::U64,
        T::U32 => DType::U32,
        T::U16 => DType::U16,
        T::U8 => DType::U8,
        T::Bool => DType::Bool(burn::tensor::BoolStore::Native),
    }
}
