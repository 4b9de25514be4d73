//! The name map between a GPT's global tensors and a Hugging Face checkpoint's, with the
//! transform each pair needs.

use super::super::hf_host::{HfError, Host, permute_rows, qkv_permutation};
use super::config::{HfArchitecture, HfGptConfig};

/// How a global tensor is made from its Hugging Face tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transform {
    /// The same values and shape (norms, biases, GPT-2's position table).
    Same,
    /// A linear weight: Hugging Face's `[out, in]` transposed to Burn's `[in, out]`
    /// (`conv1d`: GPT-2 already stores `[in, out]`).
    Linear { conv1d: bool },
    /// Query, key and value (three tensors, or GPT-2's one fused `[in, 3h]`), rows permuted
    /// into the per-group fused order; a weight is then transposed.
    Qkv { conv1d: bool, bias: bool },
    /// Vocabulary rows, padded with zeros.
    VocabRows,
    /// The output layer: vocabulary rows padded, then transposed to `[h, V]`.
    VocabLinear,
}

/// The Hugging Face tensors of one global tensor.
#[derive(Debug, Clone)]
pub(super) struct Spec {
    pub(super) hf: Vec<String>,
    pub(super) transform: Transform,
    pub(super) one_d: bool,
}

fn spec(hf: Vec<String>, transform: Transform, one_d: bool) -> Spec {
    Spec {
        hf,
        transform,
        one_d,
    }
}

/// The spec of the global tensor `ours` (a name as [`Gpt::global_param_name_at`] gives).
///
/// [`Gpt::global_param_name_at`]: super::super::Gpt::global_param_name_at
pub(super) fn spec_of(hf: &HfGptConfig, ours: &str) -> Result<Spec, HfError> {
    let gpt2 = hf.architecture == HfArchitecture::Gpt2;
    // Norm parameters sit under their variant (`input_layernorm.RmsNorm.gamma`).
    let name = ours.replace(".LayerNorm.", ".").replace(".RmsNorm.", ".");
    let unknown = || HfError::Unsupported(format!("{ours} has no Hugging Face counterpart"));
    let (base, layer) = if gpt2 {
        ("transformer", "transformer.h")
    } else {
        ("model", "model.layers")
    };
    let norm_tail = |tail: &str| match tail {
        "gamma" => Some("weight"),
        "beta" => Some("bias"),
        _ => None,
    };
    if let Some(rest) = name.strip_prefix("layers.") {
        let (i, rest) = rest.split_once('.').ok_or_else(unknown)?;
        let p = format!("{layer}.{i}");
        if let Some(moe) = rest.strip_prefix("moe.") {
            return moe_spec(hf, &p, moe).ok_or_else(unknown);
        }
        let (module, tail) = rest.rsplit_once('.').ok_or_else(unknown)?;
        let bias = tail == "bias";
        return Ok(match (module, gpt2) {
            ("input_layernorm" | "post_attention_layernorm", _) => {
                let hf_norm = match (module, gpt2) {
                    ("input_layernorm", true) => "ln_1",
                    (_, true) => "ln_2",
                    (m, false) => m,
                };
                let t = norm_tail(tail).ok_or_else(unknown)?;
                spec(vec![format!("{p}.{hf_norm}.{t}")], Transform::Same, true)
            }
            ("attention.query_key_value", false) => spec(
                ["q_proj", "k_proj", "v_proj"]
                    .iter()
                    .map(|q| format!("{p}.self_attn.{q}.{tail}"))
                    .collect(),
                Transform::Qkv {
                    conv1d: false,
                    bias,
                },
                bias,
            ),
            ("attention.query_key_value", true) => spec(
                vec![format!("{p}.attn.c_attn.{tail}")],
                Transform::Qkv { conv1d: true, bias },
                bias,
            ),
            (module, _) => {
                let hf_module = match (module, gpt2) {
                    ("attention.dense", false) => "self_attn.o_proj",
                    ("attention.dense", true) => "attn.c_proj",
                    ("mlp.dense_h_to_4h", false) => "mlp.up_proj",
                    ("mlp.dense_h_to_4h", true) => "mlp.c_fc",
                    ("mlp.dense_h_to_4h_gate", false) => "mlp.gate_proj",
                    ("mlp.dense_4h_to_h", false) => "mlp.down_proj",
                    ("mlp.dense_4h_to_h", true) => "mlp.c_proj",
                    _ => return Err(unknown()),
                };
                let transform = if bias {
                    Transform::Same
                } else {
                    Transform::Linear { conv1d: gpt2 }
                };
                spec(vec![format!("{p}.{hf_module}.{tail}")], transform, bias)
            }
        });
    }
    Ok(match name.as_str() {
        "embedding.word_embeddings.weight" => {
            let e = if gpt2 { "wte" } else { "embed_tokens" };
            spec(
                vec![format!("{base}.{e}.weight")],
                Transform::VocabRows,
                false,
            )
        }
        "embedding.position_embeddings.weight" if gpt2 => {
            spec(vec![format!("{base}.wpe.weight")], Transform::Same, false)
        }
        "head.output_layer.weight" => {
            spec(vec!["lm_head.weight".into()], Transform::VocabLinear, false)
        }
        n => {
            let tail = n.strip_prefix("head.final_layernorm.").and_then(norm_tail);
            let norm = if gpt2 { "ln_f" } else { "norm" };
            spec(
                vec![format!("{base}.{norm}.{}", tail.ok_or_else(unknown)?)],
                Transform::Same,
                true,
            )
        }
    })
}

/// A mixture-of-experts layer's tensor `name` (after `moe.`) in layer `p`: the router, an
/// expert under its global index, or Qwen2-MoE's shared expert and its gate.
fn moe_spec(hf: &HfGptConfig, p: &str, name: &str) -> Option<Spec> {
    let (moe, experts, [gate, up, down]) = match hf.architecture {
        HfArchitecture::Mixtral => (
            format!("{p}.block_sparse_moe"),
            "experts",
            ["w1", "w3", "w2"],
        ),
        HfArchitecture::Qwen2Moe => (
            format!("{p}.mlp"),
            "experts",
            ["gate_proj", "up_proj", "down_proj"],
        ),
        _ => return None,
    };
    let linear = Transform::Linear { conv1d: false };
    if name == "router" {
        return Some(spec(
            vec![format!("{moe}.gate.weight")],
            Transform::Same,
            false,
        ));
    }
    if name == "shared_expert.gate_weight" {
        return Some(spec(
            vec![format!("{moe}.shared_expert_gate.weight")],
            Transform::Same,
            false,
        ));
    }
    if let Some(shared) = name.strip_prefix("shared_expert.") {
        let hf_linear = match shared {
            "dense_h_to_4h.weight" => "up_proj",
            "dense_h_to_4h_gate.weight" => "gate_proj",
            "dense_4h_to_h.weight" => "down_proj",
            _ => return None,
        };
        let hf_name = format!("{moe}.shared_expert.{hf_linear}.weight");
        return Some(spec(vec![hf_name], linear, false));
    }
    let (e, ours) = name.strip_prefix("experts.")?.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let w = |n: &str| format!("{moe}.{experts}.{e}.{n}.weight");
    Some(match ours {
        "linear_fc1_gate" => spec(vec![w(gate)], linear, false),
        "linear_fc1" => spec(vec![w(up)], linear, false),
        "linear_fc2" => spec(vec![w(down)], linear, false),
        _ => return None,
    })
}

/// Hugging Face tensors a model does not take: buffers older checkpoints carry, and the
/// output layer's copy of tied embeddings.
pub(super) fn ignored(hf: &HfGptConfig, name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || name.ends_with(".attn.bias")
            && hf.architecture == HfArchitecture::Gpt2
            && !name.contains("c_attn")
        || name.ends_with(".attn.masked_bias")
        || name == "lm_head.weight" && hf.tie_word_embeddings
}

fn qkv_perm(hf: &HfGptConfig) -> Vec<usize> {
    qkv_permutation(hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
}

/// The global tensor (Burn's layout, a 1-d one as a column) of `target` dims from the
/// Hugging Face tensors `hosts` of `spec`.
pub(super) fn to_global(
    hf: &HfGptConfig,
    spec: &Spec,
    mut hosts: Vec<Host>,
    target: &[usize],
) -> Result<Host, HfError> {
    let first = hosts.remove(0);
    let pad_rows = |mut m: Host, rows: usize| -> Result<Host, HfError> {
        if m.rows != hf.vocab_size || m.rows > rows {
            return Err(HfError::Checkpoint(format!(
                "{}: {} vocabulary rows for config.json's vocab_size {} (padded to {rows})",
                spec.hf[0], m.rows, hf.vocab_size
            )));
        }
        m.values.resize(rows * m.cols, 0.0);
        m.rows = rows;
        Ok(m)
    };
    Ok(match spec.transform {
        Transform::Same => first,
        Transform::Linear { conv1d: true } => first,
        Transform::Linear { conv1d: false } => first.transpose(),
        Transform::VocabRows => pad_rows(first, target[0])?,
        Transform::VocabLinear => pad_rows(first, target[1])?.transpose(),
        Transform::Qkv { conv1d, bias } => {
            let stacked = if conv1d && !bias {
                first.transpose()
            } else if conv1d {
                first
            } else {
                let mut rows = first;
                for h in hosts {
                    if h.cols != rows.cols {
                        return Err(HfError::Checkpoint(format!(
                            "{}: query, key and value have {} and {} columns",
                            spec.hf[0], rows.cols, h.cols
                        )));
                    }
                    rows.values.extend(h.values);
                    rows.rows += h.rows;
                }
                rows
            };
            let perm = qkv_perm(hf);
            if stacked.rows != perm.len() {
                return Err(HfError::Checkpoint(format!(
                    "{}: {} query/key/value rows, {} heads and {} key/value heads of {} give {}",
                    spec.hf[0],
                    stacked.rows,
                    hf.num_attention_heads,
                    hf.num_key_value_heads,
                    hf.head_dim,
                    perm.len()
                )));
            }
            let fused = permute_rows(&stacked, &perm, false);
            if bias { fused } else { fused.transpose() }
        }
    })
}

/// The Hugging Face tensors `(name, matrix, 1-d)` of the global tensor `full` of `spec`,
/// the vocabulary trimmed to `hf.vocab_size`.
pub(super) fn from_global(
    hf: &HfGptConfig,
    spec: &Spec,
    full: &Host,
) -> Result<Vec<(String, Host, bool)>, HfError> {
    let one = |m: Host| Ok(vec![(spec.hf[0].clone(), m, spec.one_d)]);
    let vocab = hf.vocab_size;
    match spec.transform {
        Transform::Same | Transform::Linear { conv1d: true } => one(full.clone()),
        Transform::Linear { conv1d: false } => one(full.transpose()),
        Transform::VocabRows => one(full.rows(0..vocab.min(full.rows))),
        Transform::VocabLinear => {
            let t = full.transpose();
            one(t.rows(0..vocab.min(t.rows)))
        }
        Transform::Qkv { conv1d, bias } => {
            let rows = if bias { full.clone() } else { full.transpose() };
            let stacked = permute_rows(&rows, &qkv_perm(hf), true);
            if conv1d {
                return one(if bias { stacked } else { stacked.transpose() });
            }
            let (q, kv) = (
                hf.num_attention_heads * hf.head_dim,
                hf.num_key_value_heads * hf.head_dim,
            );
            let parts = [0..q, q..q + kv, q + kv..q + 2 * kv];
            Ok(spec
                .hf
                .iter()
                .zip(parts)
                .map(|(name, r)| (name.clone(), stacked.rows(r), bias))
                .collect())
        }
    }
}
