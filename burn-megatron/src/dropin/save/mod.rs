//! The plain model's record, written from a tensor-parallel one: what a user who trained at
//! TP 2 hands to code that knows only Burn.
//!
//! Each parameter is gathered over the tensor-parallel group when TP rank 0's burnpack
//! writer reaches it (a padded vocabulary cut to its real size), so that rank holds one
//! whole tensor at a time, not the model. The gathers are collectives in module order: the
//! other ranks run the same sequence, and rank 0 runs the rest of it when its writer stops
//! early, so a failed write is an error on every rank rather than a hang.

mod safetensors;
mod stages;

pub use safetensors::{SaveOptions, rotary_interleaved_to_half, save_safetensors};
pub use stages::{save_gathered_stages, save_safetensors_stages};

use super::slot::{Facts, col_weight, facts};
use crate::comm::tensor::all_gather;
use crate::comm::{CHECKPOINT_BARRIER_TIMEOUT, Comm, CommunicatorExt};
use crate::module_path::{PathVisitor, visit_paths};
use crate::tensor_parallel::{TpError, parallel_attrs};
use burn::module::{Module, Param, ParamGroup, ParamId};
use burn::tensor::kind::Basic;
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One parameter's whole tensor (a collective for a split one); its data only when asked
/// for, since only the writing rank needs it read back.
pub(crate) type Gather = Arc<dyn Fn(bool) -> Result<Option<TensorData>, String> + Send + Sync>;

/// A parameter as the plain model's record holds it.
pub(crate) struct Entry {
    pub(crate) path: String,
    pub(crate) id: u64,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) gather: Gather,
}

/// Every parameter, float, int and bool, in module order, as Burn's record collects them:
/// in the form its mapper saves (`transform_for_save`).
struct Collect<'a> {
    tp: &'a Comm,
    /// The parameters to collect (all of them, but for a group's record).
    group: &'a ParamGroup,
    /// What the layers' slots know (Burn's column layout).
    facts: HashMap<String, Facts>,
    entries: Vec<Entry>,
}

impl Collect<'_> {
    fn push(&mut self, path: &str, id: ParamId, dtype: DType, shape: Vec<usize>, gather: Gather) {
        let (path, id) = (path.to_string(), id.val());
        self.entries.push(Entry {
            path,
            id,
            dtype,
            shape,
            gather,
        });
    }

    /// A parameter every rank holds whole.
    fn whole<const D: usize, K: Basic + 'static>(
        &mut self,
        path: &str,
        id: ParamId,
        value: Tensor<D, K>,
    ) {
        let (shape, dtype) = (value.dims().to_vec(), value.dtype());
        let gather = move |keep: bool| Ok(keep.then(|| value.clone().into_data()));
        self.push(path, id, dtype, shape, Arc::new(gather));
    }
}

impl PathVisitor for Collect<'_> {
    fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
        // Outside the group: neither read nor gathered.
        if !self.group.matches(&p.id, Some(path)) {
            return;
        }
        let attrs = parallel_attrs(p.id);
        let value = p.transform_for_save().val();
        let Some(d) = attrs.split_dim() else {
            return self.whole(path, p.id, value);
        };
        let (mut shape, dtype) = (value.dims().to_vec(), value.dtype());
        shape[d] = attrs
            .unpadded_size
            .unwrap_or(shape[d] * self.tp.group().size());
        let (tp, real) = (self.tp.clone(), shape[d]);
        // A split linear of Burn's column layout: its shards have no mapper, and Burn's
        // record holds the whole weight `[out, in]`.
        let col = col_weight(&self.facts, path).is_some();
        if col {
            shape.reverse();
        }
        let gather = move |keep: bool| {
            let whole = all_gather(&*tp, value.clone(), d).map_err(|e| e.to_string())?;
            let whole = whole.narrow(d, 0, real);
            let whole = if col { whole.transpose() } else { whole };
            Ok(keep.then(|| whole.into_data()))
        };
        self.push(path, p.id, dtype, shape, Arc::new(gather));
    }

    fn visit_int<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D, Int>>) {
        if self.group.matches(&p.id, Some(path)) {
            self.whole(path, p.id, p.transform_for_save().val());
        }
    }

    fn visit_bool<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D, Bool>>) {
        if self.group.matches(&p.id, Some(path)) {
            self.whole(path, p.id, p.transform_for_save().val());
        }
    }
}

/// Writes the record the plain model (the same code, no plan applied) saves with
/// `Module::save_file`, from `model`'s shards on every rank of `tp`: a burnpack file at
/// `path` (`.bpk` appended when it has no extension, as Burn does; replaced atomically)
/// holding every parameter whole under its module path, in the form its mapper saves, a
/// padded vocabulary cut to its real size. Burn's `load_file` reads it into the plain model,
/// and [`load_sharded`](super::load_sharded) into a model split at any TP size.
///
/// Collective: every rank of `tp` calls it, and TP rank 0 writes. With data parallelism,
/// call it in one replica (the replicas hold the same weights). Rank 0 holds one whole
/// tensor at a time besides the model. A failed write or gather is an error on every rank.
pub fn save_gathered<M: Module>(
    model: &M,
    path: impl AsRef<Path>,
    tp: &Comm,
) -> Result<(), TpError> {
    save_gathered_group(model, path, tp, &ParamGroup::all())
}

/// [`save_gathered`] of the parameters `group` matches, by module path, as Burn's
/// `Module::into_record_group` collects them: what a run that trained a group writes when
/// the rest of the model is the record it started from, such as a LoRA or QLoRA fine-tune's
/// adapters (`ParamGroup::from_regex(r"\.lora\.")`). The rest is neither read nor gathered,
/// so a quantized base is never touched. [`load_sharded`](super::load_sharded) with
/// `with_allow_missing(true)` reads it back over the base, into a split model at any TP size
/// or into the plain one. Collective, as [`save_gathered`].
pub fn save_gathered_group<M: Module>(
    model: &M,
    path: impl AsRef<Path>,
    tp: &Comm,
    group: &ParamGroup,
) -> Result<(), TpError> {
    let path = path.as_ref();
    let entries = entries_in(model, tp, group);
    let written = match tp.group().rank() {
        0 => write(&entries, path),
        _ => gather_all(&entries),
    };
    agreed(written, path, tp)
}

/// This rank's part of a gathered write (`written`) as the outcome on every rank of `tp`: an
/// error anywhere is an error everywhere, naming `path`.
pub(super) fn agreed(written: Result<(), String>, path: &Path, tp: &Comm) -> Result<(), TpError> {
    // Rank 0 may still be writing the file after the last gather: the others wait for it as
    // for a checkpoint, not a collective's timeout.
    tp.barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT)?;
    let failed = tp.any_rank(written.is_err())?;
    match (written, failed) {
        (Err(e), _) => Err(TpError::Invalid(format!("{}: {e}", path.display()))),
        (Ok(()), false) => Ok(()),
        (Ok(()), true) => Err(TpError::Invalid(format!(
            "{}: not written: tensor-parallel rank 0 failed to write it, or a rank failed to \
             gather its shards",
            path.display()
        ))),
    }
}

/// `model`'s parameters as the plain model's record holds them, in module order, each with
/// its gather over `tp`.
pub(crate) fn entries<M: Module>(model: &M, tp: &Comm) -> Vec<Entry> {
    entries_in(model, tp, &ParamGroup::all())
}

/// [`entries`] of the parameters `group` matches.
fn entries_in<M: Module>(model: &M, tp: &Comm, group: &ParamGroup) -> Vec<Entry> {
    // The statistics' last update belongs in the record.
    crate::module_path::commit_running_states(model);
    let mut collect = Collect {
        tp,
        group,
        facts: facts(model),
        entries: Vec::new(),
    };
    visit_paths(model, &mut collect);
    collect.entries
}

/// A rank that does not write: every gather, failed or not, as the writer runs them; the
/// first error is kept.
pub(crate) fn gather_all(entries: &[Entry]) -> Result<(), String> {
    let mut first = Ok(());
    for e in entries {
        let this = (e.gather)(false).map(drop);
        if first.is_ok() {
            first = this;
        }
    }
    first
}

/// The writer's part: the file, each tensor gathered when the writer reaches it; then the
/// gathers the writer did not reach, which the other ranks are waiting in.
pub(crate) fn write(entries: &[Entry], path: &Path) -> Result<(), String> {
    let reached = Arc::new(AtomicUsize::new(0));
    let tensors = entries
        .iter()
        .map(|e| {
            let (gather, reached) = (e.gather.clone(), reached.clone());
            let bytes = e.shape.iter().product::<usize>() * e.dtype.size();
            burn_pack::Tensor::deferred(
                e.path.clone(),
                e.dtype,
                e.shape.clone(),
                Some(e.id),
                bytes,
                move || {
                    reached.fetch_add(1, Ordering::SeqCst);
                    let data = gather(true).map_err(burn_pack::Error::IoError)?;
                    let data = data.ok_or(burn_pack::Error::IoError("no data read".into()))?;
                    Ok(data.into_bytes())
                },
            )
        })
        .collect();
    let written = burn_pack::Writer::new(tensors)
        .write_to_file(path)
        .map_err(|e| e.to_string());
    let done = reached.load(Ordering::SeqCst).min(entries.len());
    for e in &entries[done..] {
        // The others' errors say why; a rank that fails here cannot write anyway.
        let _ = (e.gather)(false);
    }
    written
}
