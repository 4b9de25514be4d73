//! The mixture of experts of Hugging Face's MoE causal LMs: Mixtral (`block_sparse_moe`,
//! top-k weights renormalised) and Qwen2-MoE (`mlp.experts`, `norm_topk_prob`, a shared
//! expert behind a sigmoid gate), read from and written to `config.json`, and mapped to
//! [`MoeConfig`].

use super::super::GptConfig;
use super::super::hf_host::HfError;
use super::config::HfArchitecture;
use crate::moe::{MoeConfig, ScoreFunction};
use serde_json::{Value, json};

/// A Hugging Face model's experts (every layer is a mixture of experts).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HfExperts {
    /// Experts per layer (`num_local_experts` / `num_experts`).
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's inner size (Mixtral's `intermediate_size`, Qwen2-MoE's
    /// `moe_intermediate_size`).
    pub ffn: usize,
    /// Qwen2-MoE's shared expert's inner size (`shared_expert_intermediate_size`); it is
    /// always gated.
    pub shared_ffn: Option<usize>,
    /// The top-k weights renormalised to sum to 1 (always in Mixtral; Qwen2-MoE's
    /// `norm_topk_prob`): Megatron's softmax after the top-k, else before it.
    pub norm_topk_prob: bool,
}

fn count(v: &Value, key: &str) -> Result<usize, HfError> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| HfError::Checkpoint(format!("config.json: {key} missing or not a number")))
}

impl HfExperts {
    /// The experts `config.json` describes for `architecture` (`None` for a dense one).
    pub(super) fn read(architecture: HfArchitecture, v: &Value) -> Result<Option<Self>, HfError> {
        let unsupported = |m: String| Err(HfError::Unsupported(m));
        if let Some(j) = v.get("router_jitter_noise").and_then(Value::as_f64)
            && j != 0.0
        {
            return unsupported(format!("router_jitter_noise {j} (only 0)"));
        }
        Ok(match architecture {
            HfArchitecture::Mixtral => Some(Self {
                num_experts: count(v, "num_local_experts")?,
                top_k: count(v, "num_experts_per_tok")?,
                ffn: count(v, "intermediate_size")?,
                shared_ffn: None,
                norm_topk_prob: true,
            }),
            HfArchitecture::Qwen2Moe => {
                let step = v.get("decoder_sparse_step").and_then(Value::as_u64);
                let dense = v
                    .get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .is_some_and(|l| !l.is_empty());
                if step.is_some_and(|s| s != 1) || dense {
                    return unsupported(
                        "Qwen2-MoE with dense layers (decoder_sparse_step other than 1, or \
                         mlp_only_layers)"
                            .into(),
                    );
                }
                let shared = count(v, "shared_expert_intermediate_size")?;
                Some(Self {
                    num_experts: count(v, "num_experts")?,
                    top_k: count(v, "num_experts_per_tok")?,
                    ffn: count(v, "moe_intermediate_size")?,
                    shared_ffn: (shared > 0).then_some(shared),
                    norm_topk_prob: v
                        .get("norm_topk_prob")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                })
            }
            _ => None,
        })
    }

    /// The layers' [`MoeConfig`]. Hugging Face's `router_aux_loss_coef` weighs its own
    /// loss (pooled over layers, k times Megatron's per layer), so it is not carried over:
    /// set `moe_aux_loss_coeff` for training.
    pub(super) fn moe_config(&self) -> MoeConfig {
        MoeConfig::new(self.num_experts)
            .with_moe_router_topk(self.top_k)
            .with_moe_router_pre_softmax(!self.norm_topk_prob)
            .with_moe_ffn_hidden_size(Some(self.ffn))
            .with_moe_shared_expert_intermediate_size(self.shared_ffn)
            .with_moe_shared_expert_gate(self.shared_ffn.is_some())
    }

    /// The Hugging Face family and experts of `config`'s mixture of experts, or an error
    /// naming why neither Mixtral nor Qwen2-MoE represents it.
    pub(super) fn of(config: &GptConfig) -> Result<Option<(HfArchitecture, Self)>, HfError> {
        let Some(moe) = &config.transformer.moe else {
            return Ok(None);
        };
        let unsupported = |m: &str| {
            Err(HfError::Unsupported(format!(
                "{m} has no Hugging Face equivalent here"
            )))
        };
        if moe.moe_router_score_function != ScoreFunction::Softmax
            || moe.moe_router_topk_scaling_factor.is_some_and(|f| f != 0.0)
            || moe.moe_expert_capacity_factor.is_some()
            || config.moe_layer_freq != 1
        {
            return unsupported(
                "a mixture of experts other than softmax routing without scaling or capacity \
                 in every layer",
            );
        }
        let experts = Self {
            num_experts: moe.num_experts,
            top_k: moe.moe_router_topk,
            ffn: moe
                .moe_ffn_hidden_size
                .unwrap_or(config.transformer.mlp.ffn_hidden_size),
            shared_ffn: moe.moe_shared_expert_intermediate_size,
            norm_topk_prob: !moe.moe_router_pre_softmax,
        };
        let t = &config.transformer;
        let qwen = t.attention.add_qkv_bias && !t.add_bias_linear;
        Ok(Some(
            match (qwen, experts.shared_ffn, moe.moe_shared_expert_gate) {
                (false, None, _) if experts.norm_topk_prob => (HfArchitecture::Mixtral, experts),
                (true, Some(_), true) => (HfArchitecture::Qwen2Moe, experts),
                _ => {
                    return unsupported(
                        "experts other than Mixtral's (top-k renormalised, no shared expert, no \
                     query/key/value biases) or Qwen2-MoE's (a gated shared expert, \
                     query/key/value biases)",
                    );
                }
            },
        ))
    }

    /// Adds these experts' keys to a `config.json` of `architecture`.
    pub(super) fn write(&self, architecture: HfArchitecture, v: &mut Value) {
        v["num_experts_per_tok"] = json!(self.top_k);
        v["router_aux_loss_coef"] = json!(0.0);
        v["output_router_logits"] = json!(false);
        if architecture == HfArchitecture::Qwen2Moe {
            v["num_experts"] = json!(self.num_experts);
            v["moe_intermediate_size"] = json!(self.ffn);
            v["shared_expert_intermediate_size"] = json!(self.shared_ffn.unwrap_or(0));
            v["norm_topk_prob"] = json!(self.norm_topk_prob);
            v["decoder_sparse_step"] = json!(1);
            v["mlp_only_layers"] = json!([]);
        } else {
            v["num_local_experts"] = json!(self.num_experts);
            v["intermediate_size"] = json!(self.ffn);
            v["sliding_window"] = Value::Null;
        }
    }
}
