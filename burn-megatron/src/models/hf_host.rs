//! What the Hugging Face interop of every model shares: its error, the checkpoint files of a
//! directory, and host-side matrices (the row-major f32 form HF tensors are reshaped,
//! permuted and sharded in).

use crate::comm::CommError;
use crate::safetensors_io;
use burn::module::Param;
use burn::tensor::{Tensor, TensorCreationOptions, TensorData};
use std::collections::HashMap;
use std::path::Path;

/// Why a Hugging Face checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A tensor is missing or has the wrong shape.
    #[error("{0}")]
    Checkpoint(String),
    /// The checkpoint uses something this model does not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Gathering the shards failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

fn io(path: &Path, message: impl ToString) -> HfError {
    HfError::Io {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

/// Every tensor of a Hugging Face directory, from the first of these it holds:
/// `model.safetensors.index.json` (the safetensors files its `weight_map` names: real
/// checkpoints are sharded), `model.safetensors`, `pytorch_model.bin.index.json` (PyTorch
/// shards), `pytorch_model.bin` (what `save_pretrained` wrote before safetensors, and what
/// many checkpoints still ship alone).
///
/// ```no_run
/// let tensors = burn_megatron::models::read_hf_tensors("bert-base-uncased".as_ref())?;
/// println!("{} tensors", tensors.len());
/// # Ok::<(), burn_megatron::models::HfError>(())
/// ```
pub fn read_hf_tensors(dir: &Path) -> Result<HashMap<String, TensorData>, HfError> {
    let found = [
        "model.safetensors.index.json",
        "model.safetensors",
        "pytorch_model.bin.index.json",
        "pytorch_model.bin",
    ]
    .into_iter()
    .find(|name| dir.join(name).is_file())
    .ok_or_else(|| {
        io(
            dir,
            "no model.safetensors, pytorch_model.bin or index of either",
        )
    })?;
    let files = if found.ends_with(".index.json") {
        index_files(&dir.join(found))?
    } else {
        vec![found.to_string()]
    };
    let mut out = HashMap::new();
    for file in files {
        let path = dir.join(&file);
        if crate::pytorch_io::is_pytorch(&path) {
            out.extend(read_pytorch(&path)?);
        } else {
            let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
            let (tensors, _) = safetensors_io::read(&bytes).map_err(|e| io(&path, e))?;
            out.extend(tensors);
        }
    }
    Ok(out)
}

/// The files an index names (see [`safetensors_io::index_files`]).
fn index_files(index: &Path) -> Result<Vec<String>, HfError> {
    safetensors_io::index_files(index).map_err(|e| io(index, e))
}

/// The tensors of a PyTorch state dict (any container `torch.save` writes).
fn read_pytorch(path: &Path) -> Result<Vec<(String, TensorData)>, HfError> {
    let tensors = crate::pytorch_io::tensors(path, None).map_err(|e| io(path, e))?;
    tensors
        .into_iter()
        .map(|t| {
            let bytes = t.tensor.read().map_err(|e| io(path, e))?;
            Ok((t.name, TensorData::from_bytes_vec(bytes, t.shape, t.dtype)))
        })
        .collect()
}

/// A row-major host matrix (a 1-d tensor is one column).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Host {
    pub(super) values: Vec<f32>,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl Host {
    pub(super) fn transpose(&self) -> Host {
        let mut values = vec![0.0; self.values.len()];
        for r in 0..self.rows {
            for c in 0..self.cols {
                values[c * self.rows + r] = self.values[r * self.cols + c];
            }
        }
        Host {
            values,
            rows: self.cols,
            cols: self.rows,
        }
    }

    pub(super) fn rows(&self, range: std::ops::Range<usize>) -> Host {
        Host {
            values: self.values[range.start * self.cols..range.end * self.cols].to_vec(),
            rows: range.len(),
            cols: self.cols,
        }
    }

    pub(super) fn cols(&self, range: std::ops::Range<usize>) -> Host {
        self.transpose().rows(range).transpose()
    }
}

/// HF's query, key and value rows stacked as `[q (heads·hn); k (groups·hn); v (groups·hn)]`
/// ⇄ the fused order of Megatron-Core's `linear_qkv`, per query group:
/// `[group][its heads' q…, k, v][hn]` (rows). With one group per head (BERT, GPT-2) this
/// is `[head][q, k, v][hn]`.
pub(super) fn qkv_permutation(heads: usize, groups: usize, hn: usize) -> Vec<usize> {
    let per_group = heads / groups;
    let (k0, v0) = (heads * hn, (heads + groups) * hn);
    let mut perm = Vec::with_capacity((heads + 2 * groups) * hn);
    for g in 0..groups {
        for head in g * per_group..(g + 1) * per_group {
            perm.extend((0..hn).map(|d| head * hn + d));
        }
        perm.extend((0..hn).map(|d| k0 + g * hn + d));
        perm.extend((0..hn).map(|d| v0 + g * hn + d));
    }
    perm
}

pub(super) fn permute_rows(m: &Host, perm: &[usize], inverse: bool) -> Host {
    let mut values = vec![0.0; m.values.len()];
    for (dst, &src) in perm.iter().enumerate() {
        let (to, from) = if inverse { (src, dst) } else { (dst, src) };
        values[to * m.cols..(to + 1) * m.cols]
            .copy_from_slice(&m.values[from * m.cols..(from + 1) * m.cols]);
    }
    Host {
        values,
        ..m.clone()
    }
}

pub(super) fn host_of(name: &str, data: &TensorData) -> Result<Host, HfError> {
    let values: Vec<f32> = data.iter::<f32>().collect();
    match data.shape().len() {
        1 => Ok(Host {
            rows: values.len(),
            cols: 1,
            values,
        }),
        2 => Ok(Host {
            rows: data.shape()[0],
            cols: data.shape()[1],
            values,
        }),
        n => Err(HfError::Checkpoint(format!(
            "{name}: expected a 1-d or 2-d tensor, found {n}-d"
        ))),
    }
}

pub(super) fn set_param<const D: usize>(
    p: &mut Param<Tensor<D>>,
    values: Vec<f32>,
    shape: [usize; D],
) {
    let old = p.val();
    let options = TensorCreationOptions::new(old.device()).with_dtype(old.dtype());
    let t = Tensor::<D>::from_data(TensorData::new(values, shape), options)
        .set_require_grad(old.is_require_grad());
    *p = p.clone().map(|_| t);
}

#[cfg(test)]
mod tests;
