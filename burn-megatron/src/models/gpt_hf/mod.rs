//! Hugging Face causal-LM checkpoints (Llama, Mistral, Qwen2, GPT-2, and the
//! mixture-of-experts Mixtral and Qwen2-MoE) in and out of a [`Gpt`] at any tensor- and
//! expert-parallel size.
//!
//! The interop is a name map plus the few layout transforms between a Hugging Face tensor
//! and the model's *global* tensor (the one a checkpoint saves): `[out, in]` linear weights
//! transposed to Burn's `[in, out]` (GPT-2's Conv1D weights already are), query, key and
//! value fused per query group, the vocabulary padded. Which slice of a global tensor a
//! rank holds is the model's own parallel attributes' business, as for checkpoints, so the
//! same map serves every TP size and pipeline stage.

mod config;
mod experts;
mod names;

pub use config::{HfArchitecture, HfGptConfig};
pub use experts::HfExperts;

use super::Gpt;
use super::hf_host::{HfError, Host, host_of, read_hf_tensors};
use crate::comm::{Comm, tensor::all_gather};
use crate::module_path::{PathMapper, PathVisitor, map_paths, visit_paths};
use crate::moe::global_expert_name;
use crate::safetensors_io;
use crate::tensor_parallel::parallel_attrs;
use burn::module::Param;
use burn::tensor::{Device, Tensor, TensorCreationOptions, TensorData};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

fn io(path: &Path, message: impl ToString) -> HfError {
    HfError::Io {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

/// Loads a Hugging Face causal LM: `dir/config.json` and its safetensors, into this rank's
/// part of the whole model (dropouts off; set them for training). Every rank of `tp` calls
/// it and keeps its shard.
///
/// ```no_run
/// # use burn_megatron::models::{load_hf_gpt, save_hf_gpt};
/// # fn f(ctx: &burn_megatron::launch::RankContext) -> Result<(), Box<dyn std::error::Error>> {
/// let (model, hf) = load_hf_gpt("Llama-3.2-1B".as_ref(), &ctx.groups.tp, &ctx.device)?;
/// // ... fine-tune ...
/// save_hf_gpt(&model, &hf, "out".as_ref())?; // gathers over TP; TP rank 0 writes
/// # Ok(()) }
/// ```
#[doc(alias = "load_hf_llama")]
pub fn load_hf_gpt(dir: &Path, tp: &Comm, device: &Device) -> Result<(Gpt, HfGptConfig), HfError> {
    let hf = HfGptConfig::from_file(&dir.join("config.json"))?;
    let config = hf.to_gpt_config(tp.group().size());
    let model = config
        .init(tp, device)
        .map_err(|e| HfError::Unsupported(e.to_string()))?;
    let model = load_hf_gpt_weights(model, &hf, &read_hf_tensors(dir)?)?;
    Ok((model, hf))
}

/// Replaces the weights of `chunk` (a whole model or one pipeline chunk, at any TP size,
/// built from `hf.to_gpt_config`) with this rank's slices of the checkpoint `tensors`.
/// Errors name a tensor that is missing, misshapen, or left over (one the model has no
/// place for).
pub fn load_hf_gpt_weights(
    chunk: Gpt,
    hf: &HfGptConfig,
    tensors: &HashMap<String, TensorData>,
) -> Result<Gpt, HfError> {
    let (first, first_expert) = (chunk.first_layer(), chunk.first_expert());
    let mut loader = Loader {
        hf,
        tensors,
        names: Box::new(move |p| {
            global_expert_name(&Gpt::global_param_name_at(&[first], p), first_expert)
        }),
        tp: (chunk.tp().group().rank(), chunk.tp().group().size()),
        used: Vec::new(),
        error: None,
    };
    let chunk = map_paths(chunk, &mut loader);
    if let Some(e) = loader.error {
        return Err(e);
    }
    // A whole model must use every tensor; a pipeline chunk only its own, an expert-parallel
    // rank only its experts.
    if chunk.embedding.is_some() && chunk.head.is_some() {
        let others = other_ranks_experts(&chunk, hf);
        let mut left: Vec<&String> = tensors
            .keys()
            .filter(|k| !loader.used.contains(k) && !names::ignored(hf, k) && !others.contains(*k))
            .collect();
        left.sort();
        if !left.is_empty() {
            return Err(HfError::Unsupported(format!(
                "the checkpoint has tensors this model has no place for: {left:?}"
            )));
        }
    }
    Ok(chunk)
}

/// The Hugging Face names of the experts other expert-parallel ranks hold.
fn other_ranks_experts(chunk: &Gpt, hf: &HfGptConfig) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for (l, layer) in chunk.layers.iter().enumerate() {
        let Some(moe) = &layer.moe else { continue };
        let mine = moe.first_expert()..moe.first_expert() + moe.local_experts.len();
        for e in (0..moe.config().num_experts).filter(|e| !mine.contains(e)) {
            for linear in ["linear_fc1_gate", "linear_fc1", "linear_fc2"] {
                let ours = format!(
                    "layers.{}.moe.experts.{e}.{linear}",
                    chunk.first_layer() + l
                );
                if let Ok(spec) = names::spec_of(hf, &ours) {
                    out.extend(spec.hf);
                }
            }
        }
    }
    out
}

struct Loader<'a> {
    hf: &'a HfGptConfig,
    tensors: &'a HashMap<String, TensorData>,
    names: Box<dyn Fn(&str) -> String>,
    tp: (usize, usize),
    used: Vec<String>,
    error: Option<HfError>,
}

impl Loader<'_> {
    /// The global tensor `ours` of `global` dims, from its Hugging Face tensors.
    fn global(&mut self, ours: &str, global: &[usize]) -> Result<Host, HfError> {
        let spec = names::spec_of(self.hf, ours)?;
        let mut hosts = Vec::new();
        for name in &spec.hf {
            let data = self
                .tensors
                .get(name)
                .ok_or_else(|| HfError::Checkpoint(format!("missing tensor {name}")))?;
            hosts.push(host_of(name, data)?);
            self.used.push(name.clone());
        }
        names::to_global(self.hf, &spec, hosts, global)
    }
}

impl PathMapper for Loader<'_> {
    fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return p;
        }
        let ours = (self.names)(path);
        let value = p.val();
        let dims = value.dims();
        let attrs = parallel_attrs(p.id);
        let (global, _) = attrs.placement(&dims, self.tp.0, self.tp.1);
        let shard = self.global(&ours, &global).and_then(|full| {
            slice_shard(&full, &ours, &dims, &global, attrs.split_dim(), self.tp.0)
        });
        match shard {
            Ok(values) => {
                let options = TensorCreationOptions::new(value.device()).with_dtype(value.dtype());
                let t = Tensor::<D>::from_data(TensorData::new(values, dims), options)
                    .set_require_grad(value.is_require_grad());
                p.map(|_| t)
            }
            Err(e) => {
                self.error = Some(e);
                p
            }
        }
    }
}

/// This rank's slice of `full` (the `global`-shaped tensor in Burn's layout, a 1-d one as a
/// column) for a parameter of local `dims` split along `partition`.
fn slice_shard(
    full: &Host,
    name: &str,
    dims: &[usize],
    global: &[usize],
    partition: Option<usize>,
    rank: usize,
) -> Result<Vec<f32>, HfError> {
    let have = if dims.len() == 1 {
        vec![full.rows * full.cols]
    } else {
        vec![full.rows, full.cols]
    };
    if have != global || (dims.len() == 1 && full.cols != 1) {
        return Err(HfError::Checkpoint(format!(
            "{name}: the checkpoint gives {have:?}, the model's global tensor is {global:?}"
        )));
    }
    Ok(match (partition, dims.len()) {
        (Some(0), _) => full.rows(rank * dims[0]..(rank + 1) * dims[0]).values,
        (Some(1), 2) => full.cols(rank * dims[1]..(rank + 1) * dims[1]).values,
        _ => full.values.clone(),
    })
}

/// The full (gathered) global tensors of `model`, by global name, in Burn's layout.
/// Collective: every rank of the model's TP group calls it.
fn gather_global(model: &Gpt) -> Result<BTreeMap<String, Host>, HfError> {
    struct Gather<'a> {
        tp: &'a Comm,
        names: Box<dyn Fn(&str) -> String>,
        out: BTreeMap<String, Host>,
        error: Option<HfError>,
    }
    impl PathVisitor for Gather<'_> {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            let attrs = parallel_attrs(p.id);
            // Experts are gathered over their own group, below.
            if attrs.expert {
                return;
            }
            let value = p.val().detach();
            // Every rank gathers the same parameters in the same order, errors or not.
            let full = match attrs.split_dim() {
                Some(d) => all_gather(&**self.tp, value, d).map_err(HfError::from),
                None => Ok(value),
            };
            match full {
                Ok(t) => {
                    let dims = t.dims();
                    let values: Vec<f32> = t.into_data().iter::<f32>().collect();
                    let (rows, cols) = if D == 1 {
                        (dims[0], 1)
                    } else {
                        (dims[0], dims[1])
                    };
                    self.out
                        .insert((self.names)(path), Host { values, rows, cols });
                }
                Err(e) => {
                    self.error.get_or_insert(e);
                }
            }
        }
    }
    let mut g = Gather {
        tp: model.tp(),
        names: {
            let first = model.first_layer();
            Box::new(move |p| Gpt::global_param_name_at(&[first], p))
        },
        out: BTreeMap::new(),
        error: None,
    };
    visit_paths(model, &mut g);
    if let Some(e) = g.error {
        return Err(e);
    }
    let mut out = g.out;
    for (l, layer) in model.layers.iter().enumerate() {
        let Some(moe) = &layer.moe else { continue };
        let experts = moe
            .gather_experts()
            .map_err(|e| HfError::Unsupported(e.to_string()))?;
        for (e, weights) in experts.into_iter().enumerate() {
            for (name, t) in weights {
                let [rows, cols] = t.dims();
                let values: Vec<f32> = t.into_data().iter::<f32>().collect();
                let key = format!("layers.{}.moe.experts.{e}.{name}", model.first_layer() + l);
                out.insert(key, Host { values, rows, cols });
            }
        }
    }
    Ok(out)
}

/// The Hugging Face tensors of a whole `model`, vocabulary trimmed to `hf.vocab_size`.
/// Collective: every rank of the model's TP group calls it.
pub fn hf_gpt_state_dict(
    model: &Gpt,
    hf: &HfGptConfig,
) -> Result<Vec<(String, TensorData)>, HfError> {
    if model.embedding.is_none() || model.head.is_none() {
        return Err(HfError::Unsupported(
            "a Hugging Face export needs the whole model (one pipeline stage)".into(),
        ));
    }
    let global = gather_global(model)?;
    let mut out = Vec::new();
    for (ours, full) in &global {
        let spec = names::spec_of(hf, ours)?;
        for (name, host, one_d) in names::from_global(hf, &spec, full)? {
            let shape = if one_d {
                vec![host.rows]
            } else {
                vec![host.rows, host.cols]
            };
            out.push((name, TensorData::new(host.values, shape)));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Writes `dir/config.json` and `dir/model.safetensors` (f32, Hugging Face names) from TP
/// rank 0. Collective: every rank of the model's TP group calls it.
#[doc(alias = "save_hf_llama")]
pub fn save_hf_gpt(model: &Gpt, hf: &HfGptConfig, dir: &Path) -> Result<(), HfError> {
    let tensors = hf_gpt_state_dict(model, hf)?;
    if model.tp().group().rank() != 0 {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let config = dir.join("config.json");
    let text = serde_json::to_string_pretty(&hf.to_json()).map_err(|e| io(&config, e))?;
    std::fs::write(&config, text).map_err(|e| io(&config, e))?;
    let weights = dir.join("model.safetensors");
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors_io::write(&tensors, meta, &weights).map_err(|e| io(&weights, e))
}
