//! A split model's weights written whole as another library reads them: a safetensors file
//! under that library's names and layouts (a Hugging Face checkpoint, for the user's own
//! Llama), the inverse of what [`LoadOptions`](crate::dropin::LoadOptions) reads.
//!
//! The gathers are collectives in module order, and safetensors writes its tensors in its
//! own order (by dtype and name): so TP rank 0 first appends each gathered tensor to a
//! scratch file beside the target, one at a time, then the safetensors crate writes the file
//! from views of the scratch file's map, and the scratch file goes.

use super::{Entry, agreed, entries_in, gather_all};
use crate::comm::Comm;
use crate::dropin::load::adapter::{owners, pytorch_norm_key};
use crate::dropin::load::rotary_pairs;
use crate::dropin::load::stored::transpose;
use crate::dropin::slot::{col_weight, facts};
use crate::safetensors_io;
use crate::tensor_parallel::TpError;
use burn::module::{Module, ParamGroup};
use burn::tensor::TensorData;
use regex::Regex;
use safetensors::tensor::TensorView;
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

type TransformFn = dyn Fn(TensorData) -> Result<TensorData, String> + Send + Sync;

/// How a model's parameters are named and laid out in the file [`save_safetensors`] writes:
/// the inverse of the [`LoadOptions`](crate::dropin::LoadOptions) that read them.
///
/// ```
/// use burn_megatron::dropin::SaveOptions;
/// // Burn's Llama paths back to Hugging Face's names, PyTorch's `[out, in]` linears.
/// let options = SaveOptions::default()
///     .with_key_remap(r"^tok_embeddings\.", "model.embed_tokens.").unwrap()
///     .with_pytorch_adapter(true);
/// assert!(SaveOptions::default().with_key_remap("(", "x").is_err());
/// # drop(options);
/// ```
#[derive(Clone, Default)]
pub struct SaveOptions {
    remaps: Vec<(Regex, String)>,
    pytorch_adapter: bool,
    transforms: Vec<(Regex, Arc<TransformFn>)>,
    skipped: Vec<Regex>,
    max_shard_bytes: Option<u64>,
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("remaps", &self.remaps)
            .field("pytorch_adapter", &self.pytorch_adapter)
            .field("transforms", &self.transforms.len())
            .field("skipped", &self.skipped)
            .field("max_shard_bytes", &self.max_shard_bytes)
            .finish()
    }
}

impl SaveOptions {
    /// Rename module paths to the file's names: every path goes through each `(pattern,
    /// replacement)` in order (`regex` syntax, `$1` for groups), after the PyTorch adapter's
    /// norm names.
    pub fn with_key_remap(mut self, pattern: &str, replacement: &str) -> Result<Self, TpError> {
        self.remaps.push((regex(pattern)?, replacement.to_string()));
        Ok(self)
    }

    /// Write as PyTorch stores a state dict (burn-store's `BurnToPyTorchAdapter`): every
    /// `Linear`'s 2-D weight `[out, in]` (a layer in Burn's column layout is already), and a
    /// norm's `gamma` and `beta` as `weight` and `bias`.
    pub fn with_pytorch_adapter(mut self, on: bool) -> Self {
        self.pytorch_adapter = on;
        self
    }

    /// Pass the tensors at module paths `pattern` matches through `transform`, whole, as the
    /// parameter holds them (Burn's `[in, out]` for a linear, in either layout), before the
    /// adapter:
    /// the inverse of a load transform, such as [`rotary_interleaved_to_half`] for a
    /// Hugging Face Llama's query and key. It must keep the shape and dtype.
    pub fn with_transform(
        mut self,
        pattern: &str,
        transform: impl Fn(TensorData) -> Result<TensorData, String> + Send + Sync + 'static,
    ) -> Result<Self, TpError> {
        self.transforms.push((regex(pattern)?, Arc::new(transform)));
        Ok(self)
    }

    /// Shard the checkpoint as `save_pretrained(max_shard_size=…)` does when it exceeds
    /// `bytes`: for `path` `dir/model.safetensors`, the files
    /// `dir/model-00001-of-0000N.safetensors` … of at most `bytes` each (a tensor larger than
    /// that alone in its file), tensors in module order, and their index
    /// `dir/model.safetensors.index.json` (its `weight_map`, `metadata.total_size`), which
    /// `transformers` and [`RecordSource::from_hugging_face`](crate::dropin::RecordSource::from_hugging_face)
    /// read. A file at `path` itself is removed (a reader would take it before the index), and
    /// so are the shards of an earlier save there that this one did not write (as
    /// `save_pretrained` removes them); a save into one file removes an earlier index and its
    /// shards. The Hugging Face Hub takes files of at most 50 GB.
    pub fn with_max_shard_bytes(mut self, bytes: u64) -> Self {
        self.max_shard_bytes = Some(bytes);
        self
    }

    /// Leave out the parameters at module paths `pattern` matches (neither gathered nor
    /// written): an output layer the file ties to the embedding, say.
    pub fn with_skipped(mut self, pattern: &str) -> Result<Self, TpError> {
        self.skipped.push(regex(pattern)?);
        Ok(self)
    }
}

impl SaveOptions {
    pub(super) fn max_shard_bytes(&self) -> Option<u64> {
        self.max_shard_bytes
    }

    pub(super) fn pytorch_adapter(&self) -> bool {
        self.pytorch_adapter
    }

    /// Whether the parameter at `path` is left out.
    pub(super) fn skips(&self, path: &str) -> bool {
        self.skipped.iter().any(|re| re.is_match(path))
    }
}

fn regex(pattern: &str) -> Result<Regex, TpError> {
    Regex::new(pattern).map_err(|e| TpError::Invalid(format!("pattern `{pattern}`: {e}")))
}

/// The inverse of [`rotary_half_to_interleaved`](crate::dropin::rotary_half_to_interleaved):
/// along the last dimension, in `n_heads` heads of `d` features, Burn's adjacent pairs back
/// to the two halves Hugging Face rotates (feature `i` of a head takes Burn's `2i`, `d/2 + i`
/// takes `2i + 1`).
///
/// ```
/// use burn::tensor::TensorData;
/// use burn_megatron::dropin::{rotary_half_to_interleaved, rotary_interleaved_to_half};
/// let hf = TensorData::new(vec![0f32, 1., 10., 11., 20., 21., 30., 31.], [1, 8]);
/// let burn = rotary_half_to_interleaved(2)(hf.clone()).unwrap();
/// assert_eq!(rotary_interleaved_to_half(2)(burn).unwrap(), hf);
/// ```
pub fn rotary_interleaved_to_half(
    n_heads: usize,
) -> impl Fn(TensorData) -> Result<TensorData, String> + Send + Sync + Clone + 'static {
    move |data: TensorData| rotary_pairs(data, n_heads, false)
}

/// Writes `model`'s parameters whole, from its shards on every rank of `tp`, as a
/// safetensors file at `path` under the names and layouts `options` give (replaced
/// atomically): what another library loads, such as `transformers` from a Hugging Face
/// checkpoint the model was loaded from. A padded vocabulary is cut to its real size.
///
/// Collective: every rank of `tp` calls it, TP rank 0 writes; with data parallelism, call it
/// in one replica (the replicas hold the same weights, and would write the same files). Rank
/// 0 holds one whole tensor at a time besides the model, and needs the file's size twice on
/// disk while it writes; the other ranks wait for it as for a checkpoint.
/// Errors on every rank: two parameters under one name, a transform's error or a changed
/// shape, a dtype safetensors cannot hold, a failed gather or write.
pub fn save_safetensors<M: Module>(
    model: &M,
    path: impl AsRef<Path>,
    tp: &Comm,
    options: &SaveOptions,
) -> Result<(), TpError> {
    let path = path.as_ref();
    let entries = entries_in(model, tp, &ParamGroup::all());
    let layouts = layouts(model, &entries, options.pytorch_adapter);
    let (entries, layouts): (Vec<Entry>, Vec<Layout>) = (entries.into_iter().zip(layouts))
        .filter(|(e, _)| !options.skips(&e.path))
        .unzip();
    let written = match tp.group().rank() {
        0 => write(&entries, &layouts, path, options).map(drop),
        _ => gather_all(&entries),
    };
    agreed(written, path, tp)
}

/// A parameter's layer type (for the PyTorch adapter), and whether it is a weight of Burn's
/// column layout (whose record is `[out, in]` already).
pub(super) type Layout = (Option<String>, bool);

/// Each entry's [`Layout`], from `model`, whose paths the entries have.
pub(super) fn layouts<M: Module>(model: &M, entries: &[Entry], adapter: bool) -> Vec<Layout> {
    let owners = match adapter {
        true => owners(model),
        false => HashMap::new(),
    };
    let facts = facts(model);
    (entries.iter())
        .map(|e| {
            let col = col_weight(&facts, &e.path).is_some();
            (owners.get(&e.path).cloned(), col)
        })
        .collect()
}

/// A tensor appended to the scratch file: its name, dtype, shape and byte range.
struct Placed {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// The writer's part: every gather in module order (all of them, failed or not, as the other
/// ranks run them), each tensor renamed, transformed and appended to the scratch file; then
/// the safetensors file from views of it. The names written, with their bytes.
pub(super) fn write(
    entries: &[Entry],
    layouts: &[Layout],
    path: &Path,
    options: &SaveOptions,
) -> Result<Vec<(String, usize)>, String> {
    let scratch = path.with_extension("safetensors.parts");
    let (mut placed, mut names, mut first_error) = (Vec::new(), BTreeSet::new(), None);
    // Without a scratch file the gathers still run, as the other ranks run them.
    let mut file = match std::fs::File::create(&scratch) {
        Ok(file) => Some(file),
        Err(e) => {
            first_error = Some(format!("{}: {e}", scratch.display()));
            None
        }
    };
    let mut at = 0;
    for (e, (owner, col)) in entries.iter().zip(layouts) {
        let data = (e.gather)(first_error.is_none());
        let Some(file) = file.as_mut().filter(|_| first_error.is_none()) else {
            continue;
        };
        let one = data.and_then(|d| d.ok_or_else(|| "no data read".to_string()));
        let one = one.and_then(|d| convert(e, d, owner.as_ref(), *col, options));
        let one = one.and_then(|(name, data)| {
            if !names.insert(name.clone()) {
                return Err(format!("two parameters are written as `{name}`"));
            }
            let dtype = safetensors_io::dtype(data.dtype())?;
            let shape = data.shape().to_vec();
            let bytes = data.into_bytes();
            file.write_all(&bytes).map_err(|e| e.to_string())?;
            let range = at..at + bytes.len();
            at = range.end;
            placed.push(Placed {
                name,
                dtype,
                shape,
                range,
            });
            Ok(())
        });
        if let Err(why) = one {
            first_error = Some(format!("{}: {why}", e.path));
        }
    }
    let synced = match (first_error, file) {
        (Some(e), _) => Err(e),
        (None, Some(file)) => file.sync_all().map_err(|e| e.to_string()),
        (None, None) => Err("no scratch file".to_string()),
    };
    let result = synced.and_then(|()| match shards(&placed, options.max_shard_bytes) {
        shards if shards.len() <= 1 => from_scratch(&scratch, &placed, path)
            .and_then(|()| remove_index(path))
            .and_then(|()| remove_stale_shards(path, &[])),
        shards => sharded(&scratch, &placed, &shards, path),
    });
    let _ = std::fs::remove_file(&scratch);
    result?;
    Ok(placed
        .into_iter()
        .map(|p| (p.name, p.range.len()))
        .collect())
}

/// `placed` cut, in order, into runs of at most `max` bytes (a larger tensor alone): their
/// ends. One run without a maximum.
fn shards(placed: &[Placed], max: Option<u64>) -> Vec<usize> {
    let Some(max) = max else {
        return vec![placed.len()];
    };
    let (mut ends, mut bytes) = (Vec::new(), 0u64);
    for (i, p) in placed.iter().enumerate() {
        let len = p.range.len() as u64;
        if i > 0 && bytes + len > max {
            ends.push(i);
            bytes = 0;
        }
        bytes += len;
    }
    ends.push(placed.len());
    ends
}

/// The shards ending at `ends`, named after `path`'s stem, then their index beside `path`
/// (written last, so that a reader finds it only over complete shards); `path` itself goes.
fn sharded(scratch: &Path, placed: &[Placed], ends: &[usize], path: &Path) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    remove_index(path)?;
    let (n, mut start) = (ends.len(), 0);
    let mut files = Vec::new();
    for (i, &end) in ends.iter().enumerate() {
        let name = shard_name(path, i, n);
        from_scratch(scratch, &placed[start..end], &dir.join(&name))?;
        let tensors = placed[start..end]
            .iter()
            .map(|p| (p.name.clone(), p.range.len()));
        files.push((name, tensors.collect()));
        start = end;
    }
    write_index(path, &files)
}

/// The index an earlier save left beside `path`, removed before new shards replace its files,
/// so that a save that fails part way leaves no index over a mix of old and new shards.
pub(super) fn remove_index(path: &Path) -> Result<(), String> {
    let file = (path.file_name().and_then(|s| s.to_str())).unwrap_or("model.safetensors");
    let index = path.with_file_name(format!("{file}.index.json"));
    match std::fs::remove_file(index) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
        _ => Ok(()),
    }
}

/// Shard `i` of `n` of the checkpoint at `path` (`model.safetensors`):
/// `model-0000{i+1}-of-0000{n}.safetensors`.
pub(super) fn shard_name(path: &Path, i: usize, n: usize) -> String {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    format!("{stem}-{:05}-of-{n:05}.safetensors", i + 1)
}

/// The index of the shards `files` (each file's name, and its tensors' names and bytes)
/// beside `path`, as `{path's name}.index.json`, written last so that a reader finds it only
/// over complete shards; a file at `path` itself goes (a reader would take it first), and so
/// do the shards of an earlier save that this one did not write.
pub(super) fn write_index(
    path: &Path,
    files: &[(String, Vec<(String, usize)>)],
) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let file = (path.file_name().and_then(|s| s.to_str())).unwrap_or("model.safetensors");
    let mut weight_map = serde_json::Map::new();
    let mut total = 0;
    for (name, tensors) in files {
        for (tensor, bytes) in tensors {
            if weight_map
                .insert(tensor.clone(), name.clone().into())
                .is_some()
            {
                return Err(format!("two parameters are written as `{tensor}`"));
            }
            total += bytes;
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    });
    let at = dir.join(format!("{file}.index.json"));
    let partial = dir.join(format!("{file}.index.json.partial"));
    safetensors_io::write_synced(&partial, index.to_string().as_bytes())?;
    std::fs::rename(&partial, &at).map_err(|e| e.to_string())?;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
        _ => Ok(()),
    }?;
    let kept: Vec<&str> = files.iter().map(|(name, _)| name.as_str()).collect();
    remove_stale_shards(path, &kept)
}

/// The shards of an earlier save at `path` (named as [`shard_name`] names them) that this save
/// did not write, removed as `save_pretrained` removes them: a reader that takes every
/// `model*.safetensors` file, or an index written later, finds only this save's. Other files
/// stay.
fn remove_stale_shards(path: &Path, kept: &[&str]) -> Result<(), String> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    // A stem that is not text names no shard of ours (shard_name would have written
    // "model-…", another checkpoint's name).
    let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
        return Ok(());
    };
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            continue;
        };
        let file = entry.file_type().is_ok_and(|t| t.is_file());
        if file && is_shard(name, stem) && !kept.contains(&name) {
            let file = dir.join(name);
            std::fs::remove_file(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        }
    }
    Ok(())
}

/// Whether `name` is `{stem}-NNNNN-of-MMMMM.safetensors`.
fn is_shard(name: &str, stem: &str) -> bool {
    let numbers = (name.strip_prefix(stem))
        .and_then(|n| n.strip_prefix('-'))
        .and_then(|n| n.strip_suffix(".safetensors"))
        .and_then(|n| n.split_once("-of-"));
    let five_digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    numbers.is_some_and(|(i, n)| five_digits(i) && five_digits(n))
}

/// The safetensors file at `path` (through a temporary name, then renamed) from the tensors
/// `placed` in the scratch file.
fn from_scratch(scratch: &Path, placed: &[Placed], path: &Path) -> Result<(), String> {
    let map = crate::mapped_file::map(scratch).map_err(|e| e.to_string())?;
    let views = placed
        .iter()
        .map(|p| {
            let bytes = map
                .get(p.range.clone())
                .ok_or("the scratch file is short")?;
            let view = TensorView::new(p.dtype, p.shape.clone(), bytes)
                .map_err(|e| format!("{}: {e}", p.name))?;
            Ok((p.name.clone(), view))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let partial = path.with_extension("safetensors.partial");
    let written = (safetensors::serialize_to_file(views, None, &partial))
        .map_err(|e| e.to_string())
        .and_then(|()| safetensors_io::sync(&partial))
        .and_then(|()| std::fs::rename(&partial, path).map_err(|e| e.to_string()));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// One gathered parameter under its file name, in the file's layout.
fn convert(
    e: &Entry,
    mut data: TensorData,
    owner: Option<&String>,
    col: bool,
    options: &SaveOptions,
) -> Result<(String, TensorData), String> {
    if let Some((_, f)) = options
        .transforms
        .iter()
        .find(|(re, _)| re.is_match(&e.path))
    {
        // As the parameter holds it: a column-layout weight's record is `[out, in]`.
        let flip = |data: TensorData| {
            let (s, dtype) = (data.shape().to_vec(), data.dtype());
            let bytes = transpose(&data.into_bytes(), s[0], s[1], dtype.size());
            TensorData::from_bytes_vec(bytes, vec![s[1], s[0]], dtype)
        };
        let col = col && e.shape.len() == 2;
        if col {
            data = flip(data);
        }
        let (shape, dtype) = (data.shape().to_vec(), data.dtype());
        data = f(data)?;
        if data.shape().to_vec() != shape || data.dtype() != dtype {
            return Err(format!(
                "the transform returned {:?} {:?} for {shape:?} {dtype:?}",
                data.shape().to_vec(),
                data.dtype()
            ));
        }
        if col {
            data = flip(data);
        }
    }
    let owner = owner.map(String::as_str);
    let mut name = pytorch_norm_key(owner, &e.path).unwrap_or_else(|| e.path.clone());
    let weight = e.path == "weight" || e.path.ends_with(".weight");
    if owner == Some("Struct:Linear") && weight && e.shape.len() == 2 && !col {
        let (rows, cols, elem) = (e.shape[0], e.shape[1], data.dtype().size());
        let dtype = data.dtype();
        let bytes = transpose(&data.into_bytes(), rows, cols, elem);
        data = TensorData::from_bytes_vec(bytes, vec![cols, rows], dtype);
    }
    for (re, to) in &options.remaps {
        name = re.replace_all(&name, to.as_str()).into_owned();
    }
    Ok((name, data))
}
