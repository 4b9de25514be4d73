//! A module's parameters as global tensors: collected for saving (global name, global shape,
//! this rank's offset), and restored from whatever shards a checkpoint holds.

use super::check::set_file;
use super::index::{CheckpointIndex, TensorEntry};
use super::{CheckpointError, io};
use crate::module_path::{PathMapper, PathVisitor, map_paths, visit_paths};
use crate::safetensors_io;
use crate::shards::{Piece, assemble_padded};
use crate::tensor_parallel::{copy_parallel_attrs, parallel_attrs, real_part};
use burn::module::{Module, Param, ParamId};
use burn::tensor::{DType, Tensor, TensorCreationOptions, TensorData};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Where this rank's slice of a parameter sits in the global tensor.
pub(super) struct Placement {
    pub(super) global_shape: Vec<usize>,
    pub(super) offset: Vec<usize>,
    /// The shape of the part of this rank's slice inside the global tensor: the slice's own,
    /// but for a padded vocabulary, whose padding is not saved (the global shape is the real
    /// one), so that layouts that pad it differently load each other's checkpoints.
    pub(super) stored: Vec<usize>,
    /// The dimension a padded vocabulary pads (`global_shape` holds its real extent).
    pub(super) padded_dim: Option<usize>,
}

/// Whether the tensor `saved` holds the one placed as `want`: the same global shape, or,
/// along the dimension the model pads, a longer one that an older checkpoint padded (it
/// states no padded dimension; its padding is not read). A checkpoint that states its real
/// extent must match the model's.
fn same_tensor(saved: &TensorEntry, want: &Placement) -> bool {
    let (s, g) = (&saved.global_shape, &want.global_shape);
    let older_padding = |d| Some(d) == want.padded_dim && saved.padded_dim.is_none() && s[d] > g[d];
    s.len() == g.len() && (0..s.len()).all(|d| s[d] == g[d] || older_padding(d))
}

/// The placement of a parameter of local `dims` with id `id` on tensor-parallel rank
/// `tp_rank` of `tp`: tensor-parallel shards are contiguous slices along their partition
/// dim, in rank order (the layers slice one full initialisation).
pub(super) fn placement(id: ParamId, dims: &[usize], tp_rank: usize, tp: usize) -> Placement {
    let attrs = parallel_attrs(id);
    let (mut global_shape, offset) = attrs.placement(dims, tp_rank, tp);
    let mut stored = dims.to_vec();
    let padded_dim = attrs.padding().filter(|&(d, _)| d < dims.len());
    if let Some((d, real)) = padded_dim {
        global_shape[d] = real;
        stored[d] = real_part(Some(real), offset[d], dims[d]);
    }
    Placement {
        global_shape,
        offset,
        stored,
        padded_dim: padded_dim.map(|(d, _)| d),
    }
}

impl Placement {
    /// `data` (this rank's slice) cut to the part a checkpoint holds; `None` when the slice
    /// is all vocabulary padding.
    pub(super) fn stored_part(&self, data: TensorData) -> Option<TensorData> {
        let dims = data.shape().to_vec();
        if self.stored == dims {
            return Some(data);
        }
        let d = (0..dims.len()).find(|&d| self.stored[d] != dims[d])?;
        if self.stored.contains(&0) {
            return None;
        }
        // A prefix along `d`: the first `stored[d]` of each run of `dims[d]` blocks.
        let (dtype, elem) = (data.dtype(), data.dtype().size());
        let block = dims[d + 1..].iter().product::<usize>() * elem;
        let (run, keep) = (dims[d] * block, self.stored[d] * block);
        let mut kept = Vec::with_capacity(self.stored.iter().product::<usize>() * elem);
        for r in data.as_bytes().chunks(run) {
            kept.extend_from_slice(&r[..keep]);
        }
        Some(TensorData::from_bytes_vec(kept, self.stored.clone(), dtype))
    }
}

/// Whether this rank writes parameter `id`'s tensors: each is written once, a tied weight by
/// its first copy, a duplicated one by TP rank 0, an expert's by every rank whose `share`
/// has the experts (their TP ranks hold different experts), the rest where it has the
/// dense ones.
pub(super) fn written_here(id: ParamId, tp_rank: usize, share: super::SaveShare) -> bool {
    let attrs = parallel_attrs(id);
    if attrs.expert {
        return share.experts && !attrs.shared;
    }
    share.dense && !attrs.shared && (attrs.tensor_model_parallel || tp_rank == 0)
}

/// One tensor to write: its global name, data and placement.
pub(super) struct Collected {
    pub(super) name: String,
    pub(super) data: TensorData,
    pub(super) placement: Placement,
}

struct Collect<'a> {
    names: &'a dyn Fn(&str) -> String,
    tp: (usize, usize),
    share: super::SaveShare,
    trainable_only: bool,
    out: Vec<Collected>,
}

impl PathVisitor for Collect<'_> {
    fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
        let value = p.val();
        let skip = self.trainable_only && !value.is_require_grad();
        if !written_here(p.id, self.tp.0, self.share) || skip {
            return;
        }
        let placement = placement(p.id, &value.dims(), self.tp.0, self.tp.1);
        let Some(data) = placement.stored_part(value.into_data()) else {
            return;
        };
        self.out.push(Collected {
            name: (self.names)(path),
            data,
            placement,
        });
    }
}

/// The tensors of `module` this rank writes, sorted by global name. `trainable_only` leaves
/// out frozen parameters (optimizer state exists only for the trained ones).
pub(super) fn collect<M: Module>(
    module: &M,
    names: &dyn Fn(&str) -> String,
    tp: (usize, usize),
    share: super::SaveShare,
    trainable_only: bool,
) -> Vec<Collected> {
    let mut c = Collect {
        names,
        tp,
        share,
        trainable_only,
        out: Vec::new(),
    };
    visit_paths(module, &mut c);
    c.out.sort_by(|a, b| a.name.cmp(&b.name));
    c.out
}

/// Writes `tensors` of `set` into its file in `dir` ([`set_file`]); returns their index entries.
pub(super) fn write_set(
    dir: &Path,
    set: &str,
    tensors: &[Collected],
) -> Result<Vec<TensorEntry>, CheckpointError> {
    let file = set_file(set);
    let path = dir.join(&file);
    let named: Vec<(String, TensorData)> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.data.clone()))
        .collect();
    // No metadata: the index holds it, and the bytes depend on the state alone.
    safetensors_io::write(&named, HashMap::new(), &path).map_err(|e| io(&path, e))?;
    Ok(tensors
        .iter()
        .map(|t| TensorEntry {
            set: set.to_string(),
            name: t.name.clone(),
            file: file.clone(),
            global_shape: t.placement.global_shape.clone(),
            offset: t.placement.offset.clone(),
            shape: t.data.shape().to_vec(),
            padded_dim: t.placement.padded_dim,
        })
        .collect())
}

/// Parsed files, each read (and checked) once per load.
pub(super) struct Files<'a> {
    index: &'a CheckpointIndex,
    parsed: HashMap<PathBuf, BTreeMap<String, TensorData>>,
}

impl<'a> Files<'a> {
    pub(super) fn new(index: &'a CheckpointIndex) -> Self {
        Self {
            index,
            parsed: HashMap::new(),
        }
    }

    fn tensor(
        &mut self,
        dir: &Path,
        file: &str,
        name: &str,
    ) -> Result<&TensorData, CheckpointError> {
        let path = dir.join(file);
        if !self.parsed.contains_key(&path) {
            let bytes = self.index.read_file(dir, file)?;
            let (tensors, _) = safetensors_io::read(&bytes)
                .map_err(|e| io(&path, format!("not a safetensors file: {e}")))?;
            self.parsed
                .insert(path.clone(), tensors.into_iter().collect());
        }
        self.parsed[&path].get(name).ok_or_else(|| {
            io(
                &path,
                format!("no tensor {name}, though the index lists it"),
            )
        })
    }

    /// The dtype `set` was saved in (its first tensor's), or `None` when the checkpoint has
    /// no such set.
    pub(super) fn saved_dtype(&mut self, set: &str) -> Result<Option<DType>, CheckpointError> {
        let index = self.index;
        let shards = index.shards(set);
        let Some((name, found)) = shards.iter().next() else {
            return Ok(None);
        };
        let (dir, entry) = found[0];
        Ok(Some(self.tensor(dir, &entry.file, name)?.dtype()))
    }

    /// This rank's slice of `set`'s global tensor `name`, placed as `want` with `shape`.
    pub(super) fn slice(
        &mut self,
        set: &str,
        name: &str,
        want: &Placement,
        shape: &[usize],
    ) -> Result<TensorData, CheckpointError> {
        self.slice_in(set, name, name, want, shape)
    }

    /// [`Self::slice`] of a tensor stored under `key` in its files.
    pub(super) fn slice_in(
        &mut self,
        set: &str,
        key: &str,
        name: &str,
        want: &Placement,
        shape: &[usize],
    ) -> Result<TensorData, CheckpointError> {
        let index = self.index;
        let shards = index.shards(set);
        let mismatch =
            |reason: String| CheckpointError::Mismatch(format!("{set} tensor {name}: {reason}"));
        let Some(found) = shards.get(name) else {
            return Err(mismatch(format!(
                "not in the checkpoint at {} (saved at {})",
                index.dir.display(),
                index.layout()
            )));
        };
        let mut datas = Vec::new();
        for (dir, entry) in found {
            if !same_tensor(entry, want) {
                let hint = if want.padded_dim.is_none() {
                    " (a vocabulary padded to another size? A model that does not state its \
                     real vocabulary, as BERT, must pad it the same way at both layouts: \
                     --make-vocab-size-divisible-by × TP)"
                } else {
                    ""
                };
                return Err(mismatch(format!(
                    "saved with global shape {:?} in {}, the model's is {:?}{hint}",
                    entry.global_shape,
                    dir.join(&entry.file).display(),
                    want.global_shape
                )));
            }
            let data = self.tensor(dir, &entry.file, key)?;
            if data.shape().to_vec() != entry.shape {
                return Err(io(
                    &dir.join(&entry.file),
                    format!(
                        "{name} has shape {:?}, the index says {:?}",
                        data.shape().to_vec(),
                        entry.shape
                    ),
                ));
            }
            datas.push((entry, data.clone()));
        }
        let dtype = datas[0].1.dtype();
        if datas.iter().any(|(_, d)| d.dtype() != dtype) {
            return Err(mismatch("its shards were saved in different dtypes".into()));
        }
        let pieces: Vec<Piece<'_>> = datas
            .iter()
            .map(|(e, d)| Piece {
                offset: &e.offset,
                shape: &e.shape,
                bytes: d.as_bytes(),
            })
            .collect();
        // Past the saved global shape lies a padded vocabulary's padding: zeros.
        let bytes = assemble_padded(
            &want.offset,
            shape,
            &pieces,
            dtype.size(),
            &want.global_shape,
        )
        .map_err(mismatch)?;
        Ok(TensorData::from_bytes_vec(bytes, shape.to_vec(), dtype))
    }
}

/// Replaces every float parameter of a module with its slice of `set`, keeping dtype, device
/// and `require_grad`; the first error is kept. With `ids` (by local module path),
/// parameters take the ids they were saved with (and their parallel attributes move along).
pub(super) struct Restore<'a, 'b> {
    pub(super) files: &'b mut Files<'a>,
    pub(super) set: &'b str,
    pub(super) names: &'b dyn Fn(&str) -> String,
    pub(super) tp: (usize, usize),
    pub(super) trainable_only: bool,
    pub(super) ids: Option<&'b BTreeMap<String, u64>>,
    pub(super) error: Option<CheckpointError>,
}

impl Restore<'_, '_> {
    /// `module` restored, or the first error.
    pub(super) fn apply<M: Module>(mut self, module: M) -> Result<M, CheckpointError> {
        let module = map_paths(module, &mut self);
        self.error.map_or(Ok(module), Err)
    }
}

impl PathMapper for Restore<'_, '_> {
    fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, old, mapper) = p.consume();
        if self.error.is_some() || (self.trainable_only && !old.is_require_grad()) {
            return Param::from_mapped_value(id, old, mapper);
        }
        let name = (self.names)(path);
        let dims = old.dims();
        let want = placement(id, &dims, self.tp.0, self.tp.1);
        let data = match self.files.slice(self.set, &name, &want, &dims) {
            Ok(d) => d,
            Err(e) => {
                self.error = Some(e);
                return Param::from_mapped_value(id, old, mapper);
            }
        };
        let dtype: DType = old.dtype();
        let options = TensorCreationOptions::new(old.device()).with_dtype(dtype);
        let t = Tensor::<D>::from_data(data.convert_dtype(dtype), options)
            .set_require_grad(old.is_require_grad());
        let new_id = match self.ids.and_then(|ids| ids.get(path)) {
            Some(&saved) => {
                let saved = ParamId::from(saved);
                copy_parallel_attrs(id, saved);
                saved
            }
            None => id,
        };
        Param::from_mapped_value(new_id, t, mapper)
    }
}

/// Every float parameter's id by local module path.
pub(super) fn ids<M: Module>(module: &M) -> BTreeMap<String, u64> {
    struct Ids(BTreeMap<String, u64>);
    impl PathVisitor for Ids {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            self.0.insert(path.to_string(), p.id.val());
        }
    }
    let mut v = Ids(BTreeMap::new());
    visit_paths(module, &mut v);
    v.0
}
