//! Hugging Face `BertForPreTraining` checkpoints (`config.json` + `model.safetensors`, HF
//! parameter names) loaded at any tensor-parallel size, each rank keeping its shard, and
//! exported back.
//!
//! The mapping is by name: HF's separate query/key/value become the fused per-head QKV
//! projection; HF `[out, in]` linear weights become Burn's `[in, out]`; the vocabulary is
//! padded to the padded size (zero embedding rows, MLM biases of −10⁴) and trimmed again on
//! export. The decoder weight is tied to the word embeddings (not stored, as HF saves it).

mod entries;
mod host;

use super::hf_host::{Host, host_of, permute_rows, qkv_permutation, read_hf_tensors, set_param};
use super::{Bert, BertConfig, ParallelAttentionConfig, ParallelMlpConfig, TransformerLayerConfig};
use crate::comm::{Comm, tensor::all_gather};
use crate::safetensors_io;
use crate::tensor_parallel::{PADDED_VOCAB_LOGIT, padded_vocab_size};
use burn::tensor::{Device, TensorData};
use entries::{Slot, Split, entries};
use host::shard;

pub use super::hf_host::HfError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// The fields of a Hugging Face BERT `config.json` that shape the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfBertConfig {
    /// Vocabulary size (unpadded).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// MLP inner size.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Token types.
    #[serde(default = "two")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "eps")]
    pub layer_norm_eps: f64,
    /// Activation; only `"gelu"` (the erf form) is supported.
    #[serde(default = "gelu")]
    pub hidden_act: String,
}

fn two() -> usize {
    2
}
fn eps() -> f64 {
    1e-12
}
fn gelu() -> String {
    "gelu".into()
}

impl HfBertConfig {
    /// Reads a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, HfError> {
        let io = |message: String| HfError::Io {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| io(e.to_string()))?;
        serde_json::from_str(&text).map_err(|e| io(e.to_string()))
    }

    /// The [`BertConfig`] of this checkpoint at tensor-parallel size `tp` (vocabulary padded
    /// to a multiple of 128 × tp, dropouts off: set them for training).
    pub fn to_bert_config(&self, tp: usize) -> Result<BertConfig, HfError> {
        if self.hidden_act != "gelu" {
            return Err(HfError::Unsupported(format!(
                "hidden_act {:?} (only \"gelu\", the erf form)",
                self.hidden_act
            )));
        }
        let attention =
            ParallelAttentionConfig::new(self.num_attention_heads).with_attention_dropout(0.0);
        let transformer = TransformerLayerConfig::new(
            self.hidden_size,
            attention,
            ParallelMlpConfig::new(self.intermediate_size),
        )
        .with_layernorm_epsilon(self.layer_norm_eps)
        .with_hidden_dropout(0.0);
        Ok(BertConfig::new(
            self.num_hidden_layers,
            self.max_position_embeddings,
            padded_vocab_size(self.vocab_size, 128, tp),
            transformer,
        )
        .with_num_tokentypes(self.type_vocab_size))
    }

    /// The HF config of `config`, whose real vocabulary has `vocab_size` entries.
    pub fn from_bert_config(config: &BertConfig, vocab_size: usize) -> Self {
        let t = &config.transformer;
        Self {
            vocab_size,
            hidden_size: t.hidden_size,
            num_hidden_layers: config.num_layers,
            num_attention_heads: t.attention.num_attention_heads,
            intermediate_size: t.mlp.ffn_hidden_size,
            max_position_embeddings: config.max_position_embeddings,
            type_vocab_size: config.num_tokentypes,
            layer_norm_eps: t.layernorm_epsilon,
            hidden_act: gelu(),
        }
    }
}

/// Loads HF-named weights into `model` (built from the matching config at any TP size):
/// each rank keeps its shard. Vocabulary rows beyond the checkpoint's (Megatron's padding to
/// a multiple of 128 × TP) get zero embeddings and an MLM bias of −10⁴, so the model's
/// softmax, loss and gradients are the checkpoint's.
pub fn load_hf_bert_weights(
    model: &mut Bert,
    safetensors: &[u8],
    tp: &Comm,
) -> Result<(), HfError> {
    let (tensors, _) = safetensors_io::read(safetensors).map_err(HfError::Checkpoint)?;
    load_hf_tensors(model, &tensors.into_iter().collect(), tp)
}

/// [`load_hf_bert_weights`] from tensors already read (see [`read_hf_tensors`]).
fn load_hf_tensors(
    model: &mut Bert,
    tensors: &HashMap<String, TensorData>,
    tp: &Comm,
) -> Result<(), HfError> {
    let get = |name: &str| -> Result<Host, HfError> {
        // Checkpoints from older transformers name LayerNorm parameters gamma / beta.
        let legacy = name
            .replace("LayerNorm.weight", "LayerNorm.gamma")
            .replace("LayerNorm.bias", "LayerNorm.beta");
        let data = tensors
            .get(name)
            .or_else(|| tensors.get(&legacy))
            .ok_or_else(|| HfError::Checkpoint(format!("missing tensor {name}")))?;
        host_of(name, data)
    };
    let (rank, size) = (tp.group().rank(), tp.group().size());
    let heads = model
        .layers
        .first()
        .map_or(1, |l| l.attention.heads_per_rank() * size);
    for e in entries(model)? {
        let mut full = if e.split == Split::Qkv {
            let base = e.name.replace(".qkv.", ".{}.");
            let parts = ["query", "key", "value"].map(|p| get(&base.replace("{}", p)));
            let [q, k, v] = parts;
            let (q, k, v) = (q?, k?, v?);
            let shape = |h: &Host| (h.rows, h.cols);
            if shape(&k) != shape(&q) || shape(&v) != shape(&q) || q.values.len() != q.rows * q.cols
            {
                return Err(HfError::Checkpoint(format!(
                    "{}: query {}×{}, key {}×{} and value {}×{} must have one shape",
                    base.replace(".{}", ""),
                    q.rows,
                    q.cols,
                    k.rows,
                    k.cols,
                    v.rows,
                    v.cols
                )));
            }
            if !q.rows.is_multiple_of(heads) {
                return Err(HfError::Checkpoint(format!(
                    "{}: {} query rows do not split into {heads} attention heads",
                    base.replace(".{}", ""),
                    q.rows
                )));
            }
            let stacked = Host {
                values: [q.values, k.values, v.values].concat(),
                rows: 3 * q.rows,
                cols: q.cols,
            };
            permute_rows(
                &stacked,
                &qkv_permutation(heads, heads, q.rows / heads),
                false,
            )
        } else {
            get(&e.name)?
        };
        let dims: Vec<usize> = match &e.slot {
            Slot::Two(p) => p.val().dims().to_vec(),
            Slot::One(p) => vec![p.val().dims()[0], 1],
        };
        if e.split == Split::Vocab {
            let padded = dims[0] * size;
            if full.rows > padded {
                return Err(HfError::Checkpoint(format!(
                    "{}: {} vocabulary rows exceed the model's padded {padded}",
                    e.name, full.rows
                )));
            }
            // Padded rows of the embedding are zeros; the padded MLM biases are so negative
            // that those classes get no probability: the loss and its gradients are the
            // checkpoint's own, not those of a softmax over extra zero logits.
            let fill = match e.slot {
                Slot::One(_) => PADDED_VOCAB_LOGIT,
                Slot::Two(_) => 0.0,
            };
            full.values.resize(padded * full.cols, fill);
            full.rows = padded;
        }
        let mut part = shard(&full, e.split, rank, size);
        if e.linear {
            part = part.transpose();
        }
        if [part.rows, part.cols] != [dims[0], dims[1]] {
            return Err(HfError::Checkpoint(format!(
                "{}: rank {rank}'s shard is {}×{}, the model expects {}×{}",
                e.name, part.rows, part.cols, dims[0], dims[1]
            )));
        }
        match e.slot {
            Slot::Two(p) => set_param(p, part.values, [part.rows, part.cols]),
            Slot::One(p) => set_param(p, part.values, [part.rows]),
        }
    }
    Ok(())
}

/// Reads `dir/config.json` and the weights (`model.safetensors`, or `pytorch_model.bin`: see
/// [`read_hf_tensors`]) and builds this rank's part of the model (dropouts off; the config
/// returned has the real vocabulary size).
pub fn load_hf_bert(
    dir: &Path,
    tp: &Comm,
    device: &Device,
) -> Result<(Bert, HfBertConfig), HfError> {
    let hf = HfBertConfig::from_file(&dir.join("config.json"))?;
    let config = hf.to_bert_config(tp.group().size())?;
    let tensors = read_hf_tensors(dir)?;
    let mut model = config
        .init(tp, device)
        .map_err(|e| HfError::Unsupported(e.to_string()))?;
    load_hf_tensors(&mut model, &tensors, tp)?;
    Ok((model, hf))
}

/// The full (gathered) HF-named tensors of `model`, vocabulary trimmed to `vocab_size`.
/// Collective: every rank of `tp` calls it.
pub fn hf_bert_state_dict(
    model: &Bert,
    vocab_size: usize,
    tp: &Comm,
) -> Result<Vec<(String, TensorData)>, HfError> {
    let size = tp.group().size();
    let heads = model
        .layers
        .first()
        .map_or(1, |l| l.attention.heads_per_rank() * size);
    let mut model = model.clone();
    let mut out = Vec::new();
    for e in entries(&mut model)? {
        let gather_dim = match (e.split, e.linear) {
            (Split::Dup, _) => None,
            (Split::In, _) | (_, false) => Some(0),
            (_, true) => Some(1),
        };
        let (data, dims, one_d) = match e.slot {
            Slot::Two(p) => {
                let t = match gather_dim {
                    Some(d) => all_gather(&**tp, p.val(), d)?,
                    None => p.val(),
                };
                let dims = t.dims();
                (t.into_data(), dims, false)
            }
            Slot::One(p) => {
                let t = match gather_dim {
                    Some(d) => all_gather(&**tp, p.val(), d)?,
                    None => p.val(),
                };
                let rows = t.dims()[0];
                (t.into_data(), [rows, 1], true)
            }
        };
        let values: Vec<f32> = data.iter::<f32>().collect();
        let mut full = Host {
            values,
            rows: dims[0],
            cols: dims[1],
        };
        if e.linear {
            full = full.transpose();
        }
        let emit = |name: String, m: Host, out: &mut Vec<(String, TensorData)>| {
            let shape = if one_d {
                vec![m.rows]
            } else {
                vec![m.rows, m.cols]
            };
            out.push((name, TensorData::new(m.values, shape)));
        };
        match e.split {
            Split::Vocab => {
                let rows = vocab_size.min(full.rows);
                emit(e.name, full.rows(0..rows), &mut out);
            }
            Split::Qkv => {
                let stacked = permute_rows(
                    &full,
                    &qkv_permutation(heads, heads, full.rows / 3 / heads),
                    true,
                );
                let h = full.rows / 3;
                for (j, p) in ["query", "key", "value"].iter().enumerate() {
                    emit(
                        e.name.replace(".qkv.", &format!(".{p}.")),
                        stacked.rows(j * h..(j + 1) * h),
                        &mut out,
                    );
                }
            }
            _ => emit(e.name, full, &mut out),
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Writes `dir/config.json` and `dir/model.safetensors` (f32, HF names) from TP rank 0.
/// Collective: every rank of the model's tensor-parallel group calls it.
pub fn save_hf_bert(model: &Bert, hf: &HfBertConfig, dir: &Path) -> Result<(), HfError> {
    let tp = model.tp();
    let tensors = hf_bert_state_dict(model, hf.vocab_size, tp)?;
    if tp.group().rank() != 0 {
        return Ok(());
    }
    let io = |path: &Path, message: String| HfError::Io {
        path: path.display().to_string(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e.to_string()))?;
    let mut json = serde_json::to_value(hf).map_err(|e| io(dir, e.to_string()))?;
    json["architectures"] = serde_json::json!(["BertForPreTraining"]);
    json["model_type"] = serde_json::json!("bert");
    let config = dir.join("config.json");
    let text = serde_json::to_string_pretty(&json).map_err(|e| io(&config, e.to_string()))?;
    std::fs::write(&config, text).map_err(|e| io(&config, e.to_string()))?;
    let weights = dir.join("model.safetensors");
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors_io::write(&tensors, meta, &weights).map_err(|e| io(&weights, e))
}
