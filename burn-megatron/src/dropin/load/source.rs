//! Where a whole-model record is, and its tensors read as views of the file where the format
//! allows.

use super::{Bytes, Stored};
use crate::safetensors_io;
use crate::shards::{Piece, assemble_padded};
use crate::tensor_parallel::TpError;
use std::path::{Path, PathBuf};

/// A whole-model record on disk: one Burn 0.22 writes, a legacy Burn record, or a PyTorch or
/// Hugging Face checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordSource {
    /// A burnpack file (`.bpk`): what `Module::save_file` and burn-store's `BurnpackStore`
    /// write.
    Burnpack(PathBuf),
    /// A safetensors file: burn-store's `SafetensorsStore`, or Hugging Face's.
    Safetensors(PathBuf),
    /// A PyTorch checkpoint (`torch.save` of a state dict: `.pt`, `.pth`, Hugging Face's
    /// `pytorch_model.bin`), in any container `torch.save` has written; with
    /// `top_level_key`, the state dict is the value under that key (`"state_dict"`,
    /// `"model"`) of a checkpoint that holds more.
    Pytorch {
        /// The file.
        path: PathBuf,
        /// The key whose value is the state dict, if it is not the file's top level.
        top_level_key: Option<String>,
    },
    /// A checkpoint sharded over several files, as Hugging Face saves one: its index
    /// (`model.safetensors.index.json`, `pytorch_model.bin.index.json`), whose `weight_map`
    /// names the files of its directory, each read by its extension (safetensors, or a
    /// PyTorch state dict).
    Index(PathBuf),
    /// A record of the Burn before 0.22, which Burn 0.22 no longer reads:
    /// `NamedMpkFileRecorder`'s `.mpk` (read through a memory map) or
    /// `NamedMpkGzFileRecorder`'s `.mpk.gz` (inflated into memory whole first), written by
    /// Burn 0.14 to 0.21 at full or half precision. tracel-ai's pretrained models
    /// (llama-burn's `model.mpk`) are such records.
    NamedMpk(PathBuf),
    /// A checkpoint saved split over model-parallel ranks, one file per rank in rank order
    /// (safetensors or PyTorch state dicts): Meta's `consolidated.00.pth` … `consolidated.07.pth`
    /// of a Llama 70B, fairscale's layout. Every file holds every tensor, whole (a norm) or
    /// one rank's part of it: the tensor is the concatenation of the parts along the one
    /// dimension whose extents add up to the model's, found from the parameter's global
    /// shape, so no split is configured and any tensor-parallel size reads it. A rank reads
    /// only the parts its shard overlaps, each whole (at TP = MP, one file's part of each
    /// tensor); a tensor under [`LoadOptions::with_transform`](super::LoadOptions::with_transform)
    /// is joined whole first.
    ModelParallel(Vec<PathBuf>),
}

impl RecordSource {
    /// The source for `path`, by its name: `*.index.json` an index of shards;
    /// `.safetensors`; `.mpk` or `.mpk.gz` a legacy Burn record; `.pt`, `.pth` or `.bin` a
    /// PyTorch state dict at the top level; anything else burnpack.
    ///
    /// ```
    /// use burn_megatron::dropin::RecordSource;
    /// let source = RecordSource::from_path("checkpoint/pytorch_model.bin");
    /// assert!(matches!(source, RecordSource::Pytorch { top_level_key: None, .. }));
    /// let source = RecordSource::from_path("Llama-3.1-8B/model.safetensors.index.json");
    /// assert!(matches!(source, RecordSource::Index(_)));
    /// let source = RecordSource::from_path("llama-3.2-1b-instruct-burn/model.mpk");
    /// assert!(matches!(source, RecordSource::NamedMpk(_)));
    /// ```
    pub fn from_path(path: impl AsRef<Path>) -> Self {
        let path = path.as_ref().to_path_buf();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".index.json") {
            return Self::Index(path);
        }
        if crate::legacy_record::is_legacy(&path) {
            return Self::NamedMpk(path);
        }
        if crate::pytorch_io::is_pytorch(&path) {
            return Self::Pytorch {
                path,
                top_level_key: None,
            };
        }
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => Self::Safetensors(path),
            _ => Self::Burnpack(path),
        }
    }

    /// The weights of a Hugging Face model directory, as `save_pretrained` writes them and
    /// `transformers` looks for them: `model.safetensors`, `model.safetensors.index.json`,
    /// `pytorch_model.bin`, then `pytorch_model.bin.index.json`. None of them is an error
    /// naming the directory.
    pub fn from_hugging_face(dir: impl AsRef<Path>) -> Result<Self, TpError> {
        const NAMES: [&str; 4] = [
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        ];
        let dir = dir.as_ref();
        let found = NAMES.iter().map(|n| dir.join(n)).find(|p| p.is_file());
        found.map(Self::from_path).ok_or_else(|| {
            TpError::Invalid(format!("{}: none of {}", dir.display(), NAMES.join(", ")))
        })
    }

    /// The weights of a Llama directory as Meta's download script writes it: its
    /// `consolidated.NN.pth`, one per model-parallel rank (a [`Self::Pytorch`] file alone, a
    /// [`Self::ModelParallel`] checkpoint for several). None, or numbers that do not run
    /// from `00` without a gap, is an error naming the directory.
    pub fn from_meta(dir: impl AsRef<Path>) -> Result<Self, TpError> {
        let dir = dir.as_ref();
        let error = |e: String| TpError::Invalid(format!("{}: {e}", dir.display()));
        let mut ranks = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| error(e.to_string()))? {
            let name = entry.map_err(|e| error(e.to_string()))?.file_name();
            let rank = (name.to_str())
                .and_then(|n| n.strip_prefix("consolidated.")?.strip_suffix(".pth"))
                .and_then(|n| n.parse::<usize>().ok());
            ranks.extend(rank.map(|r| (r, dir.join(name))));
        }
        ranks.sort();
        if ranks.is_empty() || ranks.iter().enumerate().any(|(i, (r, _))| i != *r) {
            let found: Vec<usize> = ranks.iter().map(|(r, _)| *r).collect();
            return Err(error(format!(
                "no run of consolidated.NN.pth from 00 (ranks found: {found:?})"
            )));
        }
        let mut files: Vec<PathBuf> = ranks.into_iter().map(|(_, p)| p).collect();
        Ok(match files.len() {
            1 => Self::from_path(files.remove(0)),
            _ => Self::ModelParallel(files),
        })
    }

    /// The file it reads (for shards, their index; for a model-parallel checkpoint, its
    /// first file).
    pub fn path(&self) -> &Path {
        match self {
            Self::Burnpack(p)
            | Self::Safetensors(p)
            | Self::Index(p)
            | Self::NamedMpk(p)
            | Self::Pytorch { path: p, .. } => p,
            Self::ModelParallel(files) => files.first().map_or(Path::new(""), |p| p.as_path()),
        }
    }
}

/// The tensors of a model-parallel checkpoint's files (`files[r]` rank `r`'s), each key's
/// parts gathered in rank order, to be joined against the parameter that takes them. Every
/// file must hold the same keys, each of one dtype and number of dimensions in all.
pub(super) fn model_parallel_parts<'a>(
    files: Vec<Vec<(String, Stored<'a>)>>,
    names: &[PathBuf],
) -> Result<Vec<(String, Stored<'a>)>, String> {
    let mut files = files.into_iter();
    let first = files.next().unwrap_or_default();
    let mut rest: Vec<std::collections::HashMap<String, Stored<'a>>> =
        files.map(|f| f.into_iter().collect()).collect();
    let name = |r: usize| {
        names
            .get(r)
            .map_or(String::new(), |p| p.display().to_string())
    };
    let mut out = Vec::with_capacity(first.len());
    for (key, stored) in first {
        let mut parts = vec![stored];
        for (r, file) in rest.iter_mut().enumerate() {
            let part = file
                .remove(&key)
                .ok_or_else(|| format!("`{key}` is in {} but not in {}", name(0), name(r + 1)))?;
            if part.dtype != parts[0].dtype || part.dims.len() != parts[0].dims.len() {
                return Err(format!(
                    "`{key}`: {:?} {:?} in {}, {:?} {:?} in {}",
                    parts[0].dtype,
                    parts[0].dims,
                    name(0),
                    part.dtype,
                    part.dims,
                    name(r + 1)
                ));
            }
            parts.push(part);
        }
        let (dtype, dims) = (parts[0].dtype, parts[0].dims.clone());
        let bytes = Bytes::Parts(parts);
        out.push((key, Stored { dtype, dims, bytes }));
    }
    if let Some((r, key)) =
        (rest.iter().enumerate()).find_map(|(r, f)| f.keys().min().map(|k| (r, k.clone())))
    {
        return Err(format!(
            "`{key}` is in {} but not in {}",
            name(r + 1),
            name(0)
        ));
    }
    Ok(out)
}

/// How a model-parallel checkpoint's parts of one tensor make the tensor the model's
/// parameter has: `shapes` are its global shapes in the stored layout (a padded vocabulary's
/// real extent too). `None`: whole in every file, read from the first; else the dimension
/// they join along, and the joined shape: the one dimension whose extents add up to the
/// model's (with two or more parts of non-zero extent, never both, never two dimensions).
pub(super) fn join_along(
    parts: &[Stored<'_>],
    shapes: &[Vec<usize>],
) -> Result<Option<(usize, Vec<usize>)>, String> {
    let first = &parts[0].dims;
    // Every part has as many dimensions as the first.
    for want in shapes.iter().filter(|w| w.len() == first.len()) {
        if parts.iter().all(|p| p.dims == *want) {
            return Ok(None);
        }
        let along = (0..want.len()).find(|&d| {
            let others = |p: &Stored<'_>| (0..want.len()).all(|e| e == d || p.dims[e] == want[e]);
            parts.iter().all(others) && parts.iter().map(|p| p.dims[d]).sum::<usize>() == want[d]
        });
        if let Some(d) = along {
            return Ok(Some((d, want.clone())));
        }
    }
    let all: Vec<&Vec<usize>> = parts.iter().map(|p| &p.dims).collect();
    let mut model: Vec<&Vec<usize>> = shapes.iter().collect();
    model.dedup();
    Err(format!(
        "its parts in the {} files, of shapes {all:?}, are neither the model's shape (as \
         stored: {model:?}) whole nor split along one of its dimensions",
        parts.len(),
    ))
}

/// The box at `at` of `size` in the tensor of shape `want` (zeros past its extent) that
/// `parts` make joined along `along`, from the parts the box overlaps, each read whole; and
/// the bytes read. The whole tensor is the box at zero of `want`.
pub(super) fn cut_parts(
    parts: &[Stored<'_>],
    along: usize,
    want: &[usize],
    at: &[usize],
    size: &[usize],
) -> Result<(Vec<u8>, usize), String> {
    let (lo, hi) = (at[along], (at[along] + size[along]).min(want[along]));
    let mut read = Vec::new();
    let mut start = 0;
    for part in parts {
        let end = start + part.dims[along];
        if start < hi && lo < end {
            let mut offset = vec![0; want.len()];
            offset[along] = start;
            read.push((offset, part, part.bytes()?));
        }
        start = end;
    }
    let bytes = read.iter().map(|(_, _, b)| b.len()).sum();
    let pieces: Vec<Piece<'_>> = (read.iter())
        .map(|(offset, part, bytes)| Piece {
            offset,
            shape: &part.dims,
            bytes,
        })
        .collect();
    let elem = parts[0].dtype.size();
    Ok((assemble_padded(at, size, &pieces, elem, want)?, bytes))
}

/// The tensors of a mapped safetensors file, as views of the map.
pub(super) fn safetensors_tensors(map: &[u8]) -> Result<Vec<(String, Stored<'_>)>, String> {
    let st = safetensors::SafeTensors::deserialize(map).map_err(|e| e.to_string())?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = safetensors_io::burn_dtype(view.dtype())?;
            let (dims, bytes) = (view.shape().to_vec(), Bytes::Mapped(view.data()));
            Ok((name, Stored { dtype, dims, bytes }))
        })
        .collect()
}

/// The tensors of a PyTorch checkpoint (its state dict under `top_level_key`, if given),
/// each read when its shard is cut.
pub(super) fn pytorch_tensors(
    path: &Path,
    top_level_key: Option<&str>,
) -> Result<Vec<(String, Stored<'static>)>, String> {
    let tensors = crate::pytorch_io::tensors(path, top_level_key)?;
    Ok(tensors
        .into_iter()
        .map(|t| {
            let (dtype, dims, bytes) = (t.dtype, t.shape, Bytes::Read(t.tensor));
            (t.name, Stored { dtype, dims, bytes })
        })
        .collect())
}

/// The tensors of a legacy Burn record (`.mpk`, or `.mpk.gz` inflated), as views of `buffer`.
pub(super) fn legacy_tensors(buffer: &[u8]) -> Result<Vec<(String, Stored<'_>)>, String> {
    let (version, tensors) = crate::legacy_record::tensors(buffer)?;
    tracing::debug!("a record of Burn {version}: {} tensors", tensors.len());
    Ok(tensors
        .into_iter()
        .map(|t| {
            let (dtype, dims, bytes) = (t.dtype, t.dims, Bytes::Mapped(t.bytes));
            (t.name, Stored { dtype, dims, bytes })
        })
        .collect())
}

/// Rewrites a record of the Burn before 0.22 (`NamedMpkFileRecorder`'s `.mpk`, or
/// `NamedMpkGzFileRecorder`'s `.mpk.gz`) as a burnpack file at `to`, which Burn 0.22's own
/// `Module::load_file` reads into the plain model: every tensor under its module path, with
/// the dtype and shape the record gives it (a half-precision record stays f16). The writer
/// holds one tensor at a time. Returns the number of tensors written.
///
/// No model is needed, and nothing is communicated; for a parallel model, `load_sharded`
/// reads the legacy record directly.
///
/// # Errors
///
/// What [`RecordSource::NamedMpk`] refuses to read, and a file that cannot be written;
/// each names the path.
pub fn convert_named_mpk(from: &Path, to: &Path) -> Result<usize, TpError> {
    crate::legacy_record::to_burnpack(from, to)
        .map_err(|e| TpError::Invalid(format!("{}: {e}", from.display())))
}
