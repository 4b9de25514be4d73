//! Hugging Face `BertForPreTraining` checkpoints (`config.json` + `model.safetensors`, HF
//! parameter names) loaded at any tensor-parallel size, each rank keeping its shard, and
//! exported back.
//!
//! The mapping is by name: HF's separate query/key/value become the fused per-head QKV
//! projection; HF `[out, in]` linear weights become Burn's `[in, out]`; the vocabulary is
//! padded with zero rows to the padded size and trimmed again on export. The decoder weight
//! is tied to the word embeddings (not stored, as HF saves it).

use super::{Bert, BertConfig, LayerNormPosition, Norm};
use crate::comm::{Comm, CommError, tensor::all_gather};
use crate::safetensors_io;
use crate::tensor_parallel::padded_vocab_size;
use burn::module::Param;
use burn::tensor::{Device, Tensor, TensorCreationOptions, TensorData};
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
        Ok(BertConfig::new(
            self.num_hidden_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.intermediate_size,
            self.max_position_embeddings,
            padded_vocab_size(self.vocab_size, 128, tp),
        )
        .with_num_tokentypes(self.type_vocab_size)
        .with_layernorm_epsilon(self.layer_norm_eps)
        .with_hidden_dropout(0.0)
        .with_attention_dropout(0.0))
    }

    /// The HF config of `config`, whose real vocabulary has `vocab_size` entries.
    pub fn from_bert_config(config: &BertConfig, vocab_size: usize) -> Self {
        Self {
            vocab_size,
            hidden_size: config.hidden_size,
            num_hidden_layers: config.num_layers,
            num_attention_heads: config.num_attention_heads,
            intermediate_size: config.ffn_hidden_size,
            max_position_embeddings: config.max_position_embeddings,
            type_vocab_size: config.num_tokentypes,
            layer_norm_eps: config.layernorm_epsilon,
            hidden_act: gelu(),
        }
    }
}

/// How a parameter is laid out relative to its HF tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Split {
    /// Duplicated on every rank.
    Dup,
    /// HF dim 0 (output features) split: column-parallel weights and biases.
    Out,
    /// HF dim 1 (input features) split: row-parallel weights.
    In,
    /// Vocabulary rows, padded.
    Vocab,
    /// The fused per-head QKV from HF's query, key and value.
    Qkv,
}

enum Slot<'a> {
    Two(&'a mut Param<Tensor<2>>),
    One(&'a mut Param<Tensor<1>>),
}

struct Entry<'a> {
    name: String,
    split: Split,
    /// An `[out, in]` HF linear weight, stored transposed in Burn.
    linear: bool,
    slot: Slot<'a>,
}

fn layernorm<'a>(
    out: &mut Vec<Entry<'a>>,
    prefix: &str,
    norm: &'a mut Norm,
) -> Result<(), HfError> {
    let Norm::LayerNorm(ln) = norm else {
        return Err(HfError::Unsupported(
            "RMSNorm layers have no BERT equivalent".into(),
        ));
    };
    out.push(entry(
        format!("{prefix}.weight"),
        Split::Dup,
        false,
        Slot::One(&mut ln.gamma),
    ));
    if let Some(beta) = ln.beta.as_mut() {
        out.push(entry(
            format!("{prefix}.bias"),
            Split::Dup,
            false,
            Slot::One(beta),
        ));
    }
    Ok(())
}

fn entry(name: String, split: Split, linear: bool, slot: Slot<'_>) -> Entry<'_> {
    Entry {
        name,
        split,
        linear,
        slot,
    }
}

fn linear<'a>(
    out: &mut Vec<Entry<'a>>,
    prefix: &str,
    split: Split,
    weight: &'a mut Param<Tensor<2>>,
    bias: Option<&'a mut Param<Tensor<1>>>,
) {
    out.push(entry(
        format!("{prefix}.weight"),
        split,
        true,
        Slot::Two(weight),
    ));
    if let Some(b) = bias {
        let bias_split = if split == Split::In {
            Split::Dup
        } else {
            split
        };
        out.push(entry(
            format!("{prefix}.bias"),
            bias_split,
            false,
            Slot::One(b),
        ));
    }
}

/// Every parameter of `model` with its HF name and layout.
fn entries(model: &mut Bert) -> Result<Vec<Entry<'_>>, HfError> {
    let mut out = Vec::new();
    let e = "bert.embeddings";
    let Bert {
        embeddings: Some(emb),
        layers,
        head: Some(m),
        ..
    } = model
    else {
        return Err(HfError::Unsupported(
            "a pipeline chunk: Hugging Face BERT import and export need the whole model".into(),
        ));
    };
    out.push(entry(
        format!("{e}.word_embeddings.weight"),
        Split::Vocab,
        false,
        Slot::Two(&mut emb.word_embeddings.weight),
    ));
    out.push(entry(
        format!("{e}.position_embeddings.weight"),
        Split::Dup,
        false,
        Slot::Two(&mut emb.position_embeddings.weight),
    ));
    out.push(entry(
        format!("{e}.token_type_embeddings.weight"),
        Split::Dup,
        false,
        Slot::Two(&mut emb.tokentype_embeddings.weight),
    ));
    out.push(entry(
        format!("{e}.LayerNorm.weight"),
        Split::Dup,
        false,
        Slot::One(&mut emb.embedding_layernorm.gamma),
    ));
    if let Some(beta) = emb.embedding_layernorm.beta.as_mut() {
        out.push(entry(
            format!("{e}.LayerNorm.bias"),
            Split::Dup,
            false,
            Slot::One(beta),
        ));
    }
    for (i, layer) in layers.iter_mut().enumerate() {
        if layer.layernorm_position() != LayerNormPosition::Post {
            return Err(HfError::Unsupported(
                "pre-LayerNorm layers (HF BERT is post-LN)".into(),
            ));
        }
        let p = format!("bert.encoder.layer.{i}");
        let qkv = &mut layer.attention.query_key_value;
        out.push(entry(
            format!("{p}.attention.self.qkv.weight"),
            Split::Qkv,
            true,
            Slot::Two(&mut qkv.weight),
        ));
        if let Some(b) = qkv.bias.as_mut() {
            out.push(entry(
                format!("{p}.attention.self.qkv.bias"),
                Split::Qkv,
                false,
                Slot::One(b),
            ));
        }
        let dense = &mut layer.attention.dense;
        linear(
            &mut out,
            &format!("{p}.attention.output.dense"),
            Split::In,
            &mut dense.weight,
            dense.bias.as_mut(),
        );
        layernorm(
            &mut out,
            &format!("{p}.attention.output.LayerNorm"),
            &mut layer.input_layernorm,
        )?;
        let up = &mut layer.mlp.dense_h_to_4h;
        linear(
            &mut out,
            &format!("{p}.intermediate.dense"),
            Split::Out,
            &mut up.weight,
            up.bias.as_mut(),
        );
        let down = &mut layer.mlp.dense_4h_to_h;
        linear(
            &mut out,
            &format!("{p}.output.dense"),
            Split::In,
            &mut down.weight,
            down.bias.as_mut(),
        );
        layernorm(
            &mut out,
            &format!("{p}.output.LayerNorm"),
            &mut layer.post_attention_layernorm,
        )?;
    }
    linear(
        &mut out,
        "bert.pooler.dense",
        Split::Dup,
        &mut m.pooler.weight,
        m.pooler.bias.as_mut(),
    );
    linear(
        &mut out,
        "cls.predictions.transform.dense",
        Split::Dup,
        &mut m.lm_dense.weight,
        m.lm_dense.bias.as_mut(),
    );
    out.push(entry(
        "cls.predictions.transform.LayerNorm.weight".into(),
        Split::Dup,
        false,
        Slot::One(&mut m.lm_layernorm.gamma),
    ));
    if let Some(beta) = m.lm_layernorm.beta.as_mut() {
        out.push(entry(
            "cls.predictions.transform.LayerNorm.bias".into(),
            Split::Dup,
            false,
            Slot::One(beta),
        ));
    }
    out.push(entry(
        "cls.predictions.bias".into(),
        Split::Vocab,
        false,
        Slot::One(&mut m.lm_bias),
    ));
    linear(
        &mut out,
        "cls.seq_relationship",
        Split::Dup,
        &mut m.binary_head.weight,
        m.binary_head.bias.as_mut(),
    );
    Ok(out)
}

/// A row-major host matrix.
#[derive(Debug, Clone, PartialEq)]
struct Host {
    values: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Host {
    fn transpose(&self) -> Host {
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

    fn rows(&self, range: std::ops::Range<usize>) -> Host {
        Host {
            values: self.values[range.start * self.cols..range.end * self.cols].to_vec(),
            rows: range.len(),
            cols: self.cols,
        }
    }

    fn cols(&self, range: std::ops::Range<usize>) -> Host {
        self.transpose().rows(range).transpose()
    }
}

/// HF's `[3h(, h)]` query/key/value stacked as `[q; k; v]` ⇄ the per-head fused order
/// `[head][q, k, v][head_dim]` (rows).
fn qkv_permutation(heads: usize, hidden: usize) -> Vec<usize> {
    let hn = hidden / heads;
    let mut perm = Vec::with_capacity(3 * hidden);
    for head in 0..heads {
        for j in 0..3 {
            perm.extend((0..hn).map(|d| j * hidden + head * hn + d));
        }
    }
    perm
}

fn permute_rows(m: &Host, perm: &[usize], inverse: bool) -> Host {
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

fn host_of(name: &str, data: &TensorData) -> Result<Host, HfError> {
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

fn set_param<const D: usize>(p: &mut Param<Tensor<D>>, values: Vec<f32>, shape: [usize; D]) {
    let old = p.val();
    let options = TensorCreationOptions::new(old.device()).with_dtype(old.dtype());
    let t = Tensor::<D>::from_data(TensorData::new(values, shape), options)
        .set_require_grad(old.is_require_grad());
    *p = p.clone().map(|_| t);
}

fn shard(full: &Host, split: Split, rank: usize, size: usize) -> Host {
    match split {
        Split::Dup => full.clone(),
        Split::Out | Split::Vocab | Split::Qkv => {
            let n = full.rows / size;
            full.rows(rank * n..(rank + 1) * n)
        }
        Split::In => {
            let n = full.cols / size;
            full.cols(rank * n..(rank + 1) * n)
        }
    }
}

/// The MLM output bias of vocabulary entries added by padding: `exp` of it underflows to 0
/// in f32, bf16 and f16 alike, so a padded entry never takes probability.
const PADDED_VOCAB_BIAS: f32 = -1e4;

/// Loads HF-named weights into `model` (built from the matching config at any TP size):
/// each rank keeps its shard. Vocabulary rows beyond the checkpoint's (Megatron's padding to
/// a multiple of 128 × TP) get zero embeddings and an MLM bias of −10⁴, so the model's
/// softmax, loss and gradients are the checkpoint's.
pub fn load_hf_weights(model: &mut Bert, safetensors: &[u8], tp: &Comm) -> Result<(), HfError> {
    let (tensors, _) = safetensors_io::read(safetensors).map_err(HfError::Checkpoint)?;
    let tensors: HashMap<String, TensorData> = tensors.into_iter().collect();
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
            permute_rows(&stacked, &qkv_permutation(heads, q.rows), false)
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
                Slot::One(_) => PADDED_VOCAB_BIAS,
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

/// Reads `dir/config.json` and `dir/model.safetensors` and builds this rank's part of the
/// model (dropouts off; the config returned has the real vocabulary size).
pub fn load_hf_bert(
    dir: &Path,
    tp: &Comm,
    device: &Device,
) -> Result<(Bert, HfBertConfig), HfError> {
    let hf = HfBertConfig::from_file(&dir.join("config.json"))?;
    let config = hf.to_bert_config(tp.group().size())?;
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).map_err(|e| HfError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let mut model = config
        .init(tp, device)
        .map_err(|e| HfError::Unsupported(e.to_string()))?;
    load_hf_weights(&mut model, &bytes, tp)?;
    Ok((model, hf))
}

/// The full (gathered) HF-named tensors of `model`, vocabulary trimmed to `vocab_size`.
/// Collective: every rank of `tp` calls it.
pub fn hf_state_dict(
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
                let stacked = permute_rows(&full, &qkv_permutation(heads, full.rows / 3), true);
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
/// Collective: every rank of `tp` calls it.
pub fn save_hf_bert(model: &Bert, hf: &HfBertConfig, dir: &Path, tp: &Comm) -> Result<(), HfError> {
    let tensors = hf_state_dict(model, hf.vocab_size, tp)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_permutation_interleaves_heads_and_inverts() {
        // 2 heads of size 2: rows [q0 q1 | q2 q3], etc.
        assert_eq!(
            qkv_permutation(2, 4),
            vec![0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
        );
        let m = Host {
            values: (0..24).map(|v| v as f32).collect(),
            rows: 12,
            cols: 2,
        };
        let p = qkv_permutation(2, 4);
        assert_eq!(permute_rows(&permute_rows(&m, &p, false), &p, true), m);
        assert_eq!(permute_rows(&m, &p, false).values[4..6], [8.0, 9.0]);
    }

    #[test]
    fn host_matrix_slicing() {
        let m = Host {
            values: (0..6).map(|v| v as f32).collect(),
            rows: 2,
            cols: 3,
        };
        assert_eq!(m.transpose().values, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(m.cols(1..3).values, vec![1.0, 2.0, 4.0, 5.0]);
        assert_eq!(m.rows(1..2).values, vec![3.0, 4.0, 5.0]);
    }
}
