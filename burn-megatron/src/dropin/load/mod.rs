//! Shard-on-load: a record written by the plain model, read straight into this rank's shards.
//!
//! Burn refuses a record whose shapes differ from the module's, so without this every rank
//! would build and load the whole model and then split it: for an 8B model, 16 GB per rank
//! before the split. Here each parameter of the tensor-parallel model finds its tensor in the
//! file by module path, reads the part this rank holds (its place comes from the layer's
//! [`ParallelAttrs`](crate::tensor_parallel::ParallelAttrs)) and replaces the parameter with
//! it, one at a time, so a rank holds its shards plus at most one whole tensor (of a
//! model-parallel checkpoint, the parts of one tensor its shard overlaps).
//!
//! Burnpack and safetensors files are read through a memory map: a shard is copied out of
//! the file's pages, which are the kernel's page cache, not the rank's memory. A shard that
//! is a run of whole rows (row-parallel weights, vocabulary rows, biases, duplicated tensors)
//! touches only its own pages; a column shard touches its whole tensor's. A PyTorch
//! checkpoint is read a tensor at a time (pytorch-reader reads a tensor whole), each cut and
//! dropped before the next. The file must not change while it loads.

use super::slot::{Facts, col_weight, facts};
use crate::comm::Comm;
use crate::module_path::{PathMapper, map_paths};
use crate::safetensors_io;
use crate::shards::{Piece, assemble_padded};
use crate::tensor_parallel::{TpError, parallel_attrs};
use burn::module::{Module, Param};
use burn::tensor::{AllocationProperty, DType, Tensor, TensorCreationOptions, TensorData};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

pub(in crate::dropin) mod adapter;
mod options;
mod source;
pub(in crate::dropin) mod stored;

use super::{StageKey, StageKeys};
use adapter::{owners, pytorch_norm_key};
pub(in crate::dropin) use options::rotary_pairs;
pub use options::{LoadOptions, LoadReport, rotary_half_to_interleaved};
pub use source::{RecordSource, convert_named_mpk};
use source::{cut_parts, join_along, legacy_tensors, model_parallel_parts};
use source::{pytorch_tensors, safetensors_tensors};
use stored::{Bytes, Stored, Whole, stored_len, transformed, transpose};

/// `model` with every float parameter replaced by this rank's part of the tensor the record
/// at `source` holds under the parameter's module path: its split from the layer's parallel
/// attributes (a duplicated parameter is read whole), its dtype, device, id and
/// `require_grad` the model's. Nothing is communicated; every rank reads the file.
///
/// Errors, naming the path and the numbers: a tensor missing or unused (unless allowed), a
/// shape other than the parameter's global one, an unreadable file or dtype.
///
/// The model's parameters may be lazy (not yet initialised): they are never initialised.
/// The file must not change while it loads.
pub fn load_sharded<M: Module>(
    model: M,
    source: &RecordSource,
    tp: &Comm,
    options: &LoadOptions,
) -> Result<(M, LoadReport), TpError> {
    let file = |e: String| TpError::Invalid(format!("{}: {e}", source.path().display()));
    let (tp_rank, tp_size) = (tp.group().rank(), tp.group().size());
    // The map lives while this function runs; what is loaded is copied out of it.
    let mapped = |path: &Path| crate::mapped_file::map(path).map_err(|e| e.to_string());
    match source {
        RecordSource::Burnpack(path) => {
            // The pack over the map, not Burn's file reader: that one reads a tensor into a
            // buffer and copies it into an aligned one, twice its size for a moment.
            let shared = bytes::Bytes::from_owner(mapped(path).map_err(&file)?);
            let pack = burn::tensor::Bytes::from_shared(shared, AllocationProperty::File);
            let reader = burn_pack::Reader::from_bytes(pack).map_err(|e| file(format!("{e}")))?;
            let tensors = reader.into_tensors().map_err(|e| file(format!("{e}")))?;
            let stored = tensors
                .into_iter()
                .map(|t| {
                    let dims = t.shape.to_vec();
                    let bytes = t.to_bytes().map_err(|e| file(format!("{e}")))?;
                    let bytes = Bytes::Pack(bytes);
                    Ok((
                        t.name,
                        Stored {
                            dtype: t.dtype,
                            dims,
                            bytes,
                        },
                    ))
                })
                .collect::<Result<Vec<_>, TpError>>()?;
            load(model, stored, (tp_rank, tp_size), options)
        }
        RecordSource::Safetensors(path) => {
            let map = mapped(path).map_err(&file)?;
            let stored = safetensors_tensors(&map).map_err(&file)?;
            load(model, stored, (tp_rank, tp_size), options)
        }
        RecordSource::Pytorch {
            path,
            top_level_key,
        } => {
            let stored = pytorch_tensors(path, top_level_key.as_deref()).map_err(&file)?;
            load(model, stored, (tp_rank, tp_size), options)
        }
        RecordSource::NamedMpk(path) => {
            let buffer = crate::legacy_record::open(path).map_err(&file)?;
            let stored = legacy_tensors(&buffer).map_err(&file)?;
            load(model, stored, (tp_rank, tp_size), options)
        }
        RecordSource::Index(index) => {
            let dir = index.parent().unwrap_or(Path::new("."));
            let files = safetensors_io::index_files(index).map_err(&file)?;
            let (torch, maps): (Vec<_>, Vec<_>) = files
                .iter()
                .partition(|f| crate::pytorch_io::is_pytorch(Path::new(f.as_str())));
            let shard_error = |f: &str, e: String| file(format!("{f}: {e}"));
            let maps = maps
                .into_iter()
                .map(|f| Ok((f, mapped(&dir.join(f)).map_err(|e| shard_error(f, e))?)))
                .collect::<Result<Vec<_>, TpError>>()?;
            let mut stored = Vec::new();
            for (f, map) in &maps {
                stored.extend(safetensors_tensors(map).map_err(|e| shard_error(f, e))?);
            }
            for f in torch {
                stored.extend(pytorch_tensors(&dir.join(f), None).map_err(|e| shard_error(f, e))?);
            }
            load(model, stored, (tp_rank, tp_size), options)
        }
        RecordSource::ModelParallel(files) => {
            if files.is_empty() {
                return Err(file("a model-parallel checkpoint of no files".into()));
            }
            let named = |f: &Path, e: String| TpError::Invalid(format!("{}: {e}", f.display()));
            let maps = (files.iter())
                .filter(|f| !crate::pytorch_io::is_pytorch(f))
                .map(|f| Ok((f, mapped(f).map_err(|e| named(f, e))?)))
                .collect::<Result<Vec<_>, TpError>>()?;
            let mut per_file = Vec::with_capacity(files.len());
            for f in files {
                per_file.push(match maps.iter().find(|(m, _)| *m == f) {
                    Some((_, map)) => safetensors_tensors(map).map_err(|e| named(f, e))?,
                    None => pytorch_tensors(f, None).map_err(|e| named(f, e))?,
                });
            }
            let stored = model_parallel_parts(per_file, files).map_err(&file)?;
            load(model, stored, (tp_rank, tp_size), options)
        }
    }
}

fn load<M: Module>(
    model: M,
    stored: Vec<(String, Stored<'_>)>,
    tp: (usize, usize),
    options: &LoadOptions,
) -> Result<(M, LoadReport), TpError> {
    let mut by_path: BTreeMap<String, (String, Stored<'_>)> = BTreeMap::new();
    let (mut elsewhere, mut skipped) = (Vec::new(), Vec::new());
    // The sources of tied parameters that another pipeline stage holds.
    let mut taken = BTreeMap::new();
    // Whether any record key lies in a pipeline stage's layer stack.
    let mut stack = false;
    for (key, tensor) in stored {
        let path = options.remaps.iter().fold(key.clone(), |k, (re, to)| {
            re.replace_all(&k, to.as_str()).into_owned()
        });
        if options.skipped.iter().any(|re| re.is_match(&path)) {
            skipped.push(key);
            continue;
        }
        stack |= options.stage.as_ref().is_some_and(|s| s.in_stack(&path));
        let source = (options.tied.iter().any(|(_, s)| *s == path)).then(|| path.clone());
        let placed = match &options.stage {
            Some(stage) => stage
                .place(&path)
                .map_err(|e| TpError::Invalid(format!("{key}: {e}")))?,
            None => StageKey::Here(path),
        };
        let path = match placed {
            StageKey::Here(path) => path,
            StageKey::Elsewhere => {
                if let Some(source) = source {
                    taken.insert(source, (key.clone(), tensor));
                }
                elsewhere.push(key);
                continue;
            }
        };
        if let Some((other, _)) = by_path.get(&path) {
            return Err(TpError::Invalid(format!(
                "record tensors `{other}` and `{key}` both map to the module path `{path}`"
            )));
        }
        by_path.insert(path, (key, tensor));
    }
    if let Some(stage) = options.stage.as_ref().filter(|_| !stack) {
        return Err(TpError::Invalid(format!(
            "the record holds no `{}.N` tensors: the pipeline plan's layer stack names nothing \
             in it (rename record keys with `with_key_remap`)",
            stage.prefix
        )));
    }
    let mut loader = Loader {
        by_path,
        taken,
        borrowed: BTreeSet::new(),
        facts: facts(&model),
        owners: match options.pytorch_adapter {
            true => owners(&model),
            false => HashMap::new(),
        },
        tp,
        options,
        report: LoadReport::default(),
        error: None,
    };
    let model = map_paths(model, &mut loader);
    if let Some(e) = loader.error {
        return Err(e);
    }
    let mut report = loader.report;
    report.elsewhere = elsewhere;
    report.skipped = skipped;
    report.unused = (loader.by_path.into_values())
        .map(|(key, _)| key)
        .filter(|key| !loader.borrowed.contains(key))
        .collect();
    if !report.unused.is_empty() && !options.allow_unused {
        return Err(TpError::Invalid(format!(
            "the record holds tensors no parameter takes: {} (rename them with \
             `with_key_remap`, or allow them with `with_allow_unused`){}",
            report.unused.join(", "),
            options.stage.as_ref().map_or("", StageKeys::hint)
        )));
    }
    Ok((model, report))
}

struct Loader<'a, 'o> {
    /// The record's tensors no parameter has taken yet, by module path.
    by_path: BTreeMap<String, (String, Stored<'a>)>,
    /// The sources of tied parameters that no parameter of this stage's takes again: taken
    /// by their own, or held by another pipeline stage (views of the file, or handles), by
    /// whole-model path (a path is either this stage's or another's, never both).
    taken: BTreeMap<String, (String, Stored<'a>)>,
    /// Record keys a tied parameter read while their own parameter had not: used, even if
    /// no parameter of their own takes them.
    borrowed: BTreeSet<String>,
    /// What the layers' slots know (Burn's column layout).
    facts: HashMap<String, Facts>,
    /// The type of the layer that holds each parameter, by parameter path (for the PyTorch
    /// adapter).
    owners: HashMap<String, String>,
    tp: (usize, usize),
    options: &'o LoadOptions,
    report: LoadReport,
    error: Option<TpError>,
}

impl PathMapper for Loader<'_, '_> {
    fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return p;
        }
        if let Some(why) = self.options.stage.as_ref().and_then(|s| s.misplaced(path)) {
            self.error = Some(TpError::Invalid(format!("{path}: {why}")));
            return p;
        }
        let owner = self.owners.get(path).map(String::as_str);
        let own = [Some(path.to_string()), pytorch_norm_key(owner, path)];
        let (options, stage) = (self.options, self.options.stage.as_ref());
        let whole_model = |p: &str| stage.map_or_else(|| p.to_string(), |s| s.global_name(p));
        // Each entry found with its whole-model path, and where it goes back if a tied
        // parameter borrowed it before its own parameter took it.
        let found = own.into_iter().flatten().find_map(|k| {
            let entry = self.by_path.remove(&k)?;
            Some((whole_model(&k), entry, None))
        });
        // A tied parameter borrows its source's entry, which goes back where it was found,
        // so that the source's own parameter still finds it. Both are named as in the whole
        // model; on a pipeline stage the source may be this stage's (by its name here) or
        // another's.
        let global = whole_model(path);
        let tied = options.tied.iter().find(|(p, _)| *p == global);
        let found = found.or_else(|| {
            let (_, source) = tied?;
            // Not yet taken by its own parameter of this stage, or kept.
            let here = match stage.map(|s| s.place(source)) {
                None => Some(source.clone()),
                Some(Ok(StageKey::Here(local))) => Some(local),
                Some(Ok(StageKey::Elsewhere)) => None,
                Some(Err(_)) => return None,
            };
            let pending =
                here.and_then(|local| Some((local.clone(), self.by_path.remove(&local)?)));
            let found = match pending {
                Some((local, entry)) => {
                    self.borrowed.insert(entry.0.clone());
                    (source.clone(), entry, Some(local))
                }
                None => (source.clone(), self.taken.remove(source)?, None),
            };
            self.report.tied.push((global.clone(), source.clone()));
            Some(found)
        });
        let Some((record_path, (key, stored), pending)) = found else {
            match self.options.allow_missing {
                true => self.report.missing.push(path.to_string()),
                false => {
                    let source = tied.map_or(String::new(), |(_, s)| format!(", nor `{s}`"));
                    self.error = Some(TpError::Invalid(format!(
                        "{path}: not in the record{source} (rename record keys with \
                         `with_key_remap`, or allow it with `with_allow_missing`)"
                    )))
                }
            }
            return p;
        };
        // Stored `[out, in]`: as the options say, or as Burn's column layout writes it. A
        // whole layer of that layout reads it as stored, and its mapper transposes it; a
        // split one's shards have no mapper.
        let col = col_weight(&self.facts, path);
        let options = self.options.transposed.iter().any(|re| re.is_match(path));
        let weight = path == "weight" || path.ends_with(".weight");
        let torch_linear = owner == Some("Struct:Linear") && weight && D == 2;
        let adapter = torch_linear && col.is_none();
        let mapped = col == Some(false);
        let transposed = options || adapter || col == Some(true);
        let transform = (self.options.transforms.iter())
            .find(|(re, _)| re.is_match(path))
            .map(|(_, f)| f);
        // Burn's QLoRA quantizes the base in place: loading a float tensor into it would
        // replace the quantized weight (or fail on its dtype).
        if p.is_initialized() && matches!(p.val().dtype(), DType::QFloat(_)) {
            self.error = Some(TpError::Invalid(format!(
                "{path}: a quantized parameter: load the float weights before quantizing \
                 (`apply_qlora`), not into them (skip it with `with_skipped`)"
            )));
            return p;
        }
        // A model-parallel checkpoint's parts: whole in every file (the first read), or
        // joined as the parameter holds the tensor, whole for a transform, else only the
        // parts this rank's shard overlaps read.
        let shard = match &stored.bytes {
            Bytes::Parts(parts) => {
                let place = self.place(&p, transposed, mapped);
                let shapes = place.map(|place| [place.global, place.real]);
                match shapes.and_then(|shapes| join_along(parts, &shapes)) {
                    Err(e) => Err(e),
                    Ok(None) => self.read(&p, &parts[0], transform, transposed, mapped),
                    Ok(Some((along, dims))) => match transform {
                        Some(_) => {
                            let zeros = vec![0; dims.len()];
                            let whole = cut_parts(parts, along, &dims, &zeros, &dims);
                            whole.and_then(|(bytes, _)| {
                                let dtype = parts[0].dtype;
                                let bytes = Bytes::Owned(bytes);
                                let whole = Stored { dtype, dims, bytes };
                                self.read(&p, &whole, transform, transposed, mapped)
                            })
                        }
                        None => {
                            let whole = Whole::Parts { parts, along, dims };
                            self.shard(&p, whole, transposed, mapped)
                        }
                    },
                }
            }
            _ => self.read(&p, &stored, transform, transposed, mapped),
        };
        // A borrowed entry goes back among those not taken yet, for its own parameter; a
        // taken one a tie names is kept for the tied parameters; the rest goes now, before
        // the shard is copied in.
        match pending {
            Some(local) => drop(self.by_path.insert(local, (key, stored))),
            None if self.options.tied.iter().any(|(_, s)| *s == record_path) => {
                drop(self.taken.insert(record_path, (key, stored)));
            }
            None => {}
        }
        match shard {
            Ok(data) => {
                self.report.loaded.push(path.to_string());
                self.report.shard_bytes += data.as_bytes().len() as u64;
                // A lazy parameter takes the device's float dtype, as its initialiser would.
                let options = TensorCreationOptions::new(p.lazy_device());
                let tensor = match p.is_initialized() {
                    true => {
                        let dtype = p.val().dtype();
                        Tensor::<D>::from_data(data.convert_dtype(dtype), options.with_dtype(dtype))
                    }
                    false => Tensor::<D>::from_data(data, options),
                };
                let id = p.id;
                if let Some(stage) = &self.options.stage {
                    stage.tie(path, id);
                }
                p.transform_for_load(tensor, id)
            }
            Err(e) => {
                self.error = Some(TpError::Invalid(format!("{path}: {e}")));
                p
            }
        }
    }
}

impl Loader<'_, '_> {
    /// This rank's box of `stored`, through `transform` first if given.
    fn read<const D: usize>(
        &mut self,
        p: &Param<Tensor<D>>,
        stored: &Stored<'_>,
        transform: Option<&options::Transform>,
        transposed: bool,
        mapped: bool,
    ) -> Result<TensorData, String> {
        match transform {
            Some(f) => {
                let whole = transformed(stored, transposed, f)?;
                let largest = &mut self.report.largest_whole_tensor_bytes;
                *largest = (*largest).max(stored_len(stored));
                // The whole tensor goes before the shard is copied in.
                self.shard(p, Whole::One(&whole), false, mapped)
            }
            None => self.shard(p, Whole::One(stored), transposed, mapped),
        }
    }

    /// Where this rank's part of `p` lies in the whole tensor, in the record's order of
    /// dimensions (reversed when stored `[out, in]`).
    fn place<const D: usize>(
        &self,
        p: &Param<Tensor<D>>,
        transposed: bool,
        mapped: bool,
    ) -> Result<Place, String> {
        if transposed && D != 2 {
            return Err(not_a_matrix(D));
        }
        let mut local = p.lazy_shape().to_vec();
        // A mapped parameter Burn has not drawn yet has the stored layout's shape; drawn, the
        // layer's.
        if mapped && p.is_initialized() {
            local.reverse();
        }
        let attrs = parallel_attrs(p.id);
        let (global, offset) = attrs.placement(&local, self.tp.0, self.tp.1);
        let mut real = global.clone();
        if let Some((d, n)) = attrs.padding() {
            real[d] = n;
        }
        let stored = |v: &[usize]| {
            let mut v = v.to_vec();
            if transposed {
                v.reverse();
            }
            v
        };
        Ok(Place {
            global: stored(&global),
            real: stored(&real),
            at: stored(&offset),
            size: stored(&local),
            local,
        })
    }

    /// This rank's box of `stored`, as the parameter `p` holds it.
    fn shard<const D: usize>(
        &mut self,
        p: &Param<Tensor<D>>,
        stored: Whole<'_, '_>,
        transposed: bool,
        mapped: bool,
    ) -> Result<TensorData, String> {
        let Place {
            global,
            real,
            at,
            size,
            local,
        } = self.place(p, transposed, mapped)?;
        // A padded vocabulary: a plain record holds the real extent, and the padding is
        // zeros; a record padded as the model is (a Megatron checkpoint's) is read as it is.
        let want = if stored.dims() == global {
            global
        } else {
            real
        };
        if stored.dims() != want {
            let layout = if transposed {
                " (stored transposed)"
            } else {
                ""
            };
            return Err(format!(
                "the record holds shape {:?}, the model's global shape is {want:?}{layout} \
                 (this rank holds {local:?})",
                stored.dims()
            ));
        }
        let (elem, dtype) = (stored.dtype().size(), stored.dtype());
        let stored = match stored {
            Whole::One(stored) => stored,
            Whole::Parts { parts, along, .. } => {
                let (bytes, read) = cut_parts(parts, along, &want, &at, &size)?;
                // The parts read for this tensor, together.
                let largest = &mut self.report.largest_whole_tensor_bytes;
                *largest = (*largest).max(read as u64);
                let bytes = match transposed {
                    true => transpose(&bytes, size[0], size[1], elem),
                    false => bytes,
                };
                return Ok(TensorData::from_bytes_vec(bytes, local, dtype));
            }
        };
        let row: usize = want.iter().skip(1).product::<usize>() * elem;
        let rows_only = (1..want.len()).all(|d| at[d] == 0 && size[d] == want[d]);
        let whole = stored.bytes()?;
        // Read whole: a tensor read from the file (not a view of a map), or a column shard.
        if matches!(whole, Cow::Owned(_)) || !(rows_only || want.is_empty()) {
            let largest = &mut self.report.largest_whole_tensor_bytes;
            *largest = (*largest).max(whole.len() as u64);
        }
        let bytes = if want.is_empty() {
            whole[..elem].to_vec()
        } else if rows_only {
            // The rows the record holds, then zeros for padding rows past its end.
            let end = (at[0] + size[0]).min(want[0]);
            let mut bytes = whole[at[0].min(end) * row..end * row].to_vec();
            bytes.resize(size[0] * row, 0);
            bytes
        } else {
            let zeros = vec![0; want.len()];
            let piece = Piece {
                offset: &zeros,
                shape: &want,
                bytes: &whole,
            };
            // Past the record's extent lies the padding of a padded vocabulary: zeros.
            assemble_padded(&at, &size, &[piece], elem, &want)?
        };
        let bytes = match transposed {
            true => transpose(&bytes, size[0], size[1], elem),
            false => bytes,
        };
        Ok(TensorData::from_bytes_vec(bytes, local, dtype))
    }
}

/// Where a rank's part of a parameter lies, in the record's order of dimensions: the whole
/// tensor's shape, the same with a padded vocabulary's real extent, this rank's box (its
/// first index and shape); and the rank's shape as the parameter holds it.
struct Place {
    global: Vec<usize>,
    real: Vec<usize>,
    at: Vec<usize>,
    size: Vec<usize>,
    local: Vec<usize>,
}

fn not_a_matrix(dims: usize) -> String {
    format!("matches `with_transposed` but has {dims} dimensions, not 2")
}
