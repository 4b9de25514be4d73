//! Hugging Face `config.json` of the causal-LM families a [`Gpt`](crate::models::Gpt)
//! represents: Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE and GPT-2, read in both of transformers' styles (rope
//! settings at the top level, or in transformers 5's `rope_parameters`).

use super::super::hf_host::HfError;
use super::super::{
    ActivationFunc, AttnMaskType, GptConfig, LayerNormPosition, NormKind, ParallelAttentionConfig,
    ParallelMlpConfig, PositionEmbeddingType, RopeScaling, TransformerLayerConfig,
};
use super::experts::HfExperts;
use crate::tensor_parallel::padded_vocab_size;
use serde_json::{Value, json};
use std::path::Path;

/// The Hugging Face model family, which fixes the tensor names and layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfArchitecture {
    /// `LlamaForCausalLM` (Llama 2 and 3).
    Llama,
    /// `MistralForCausalLM`: Llama's layout.
    Mistral,
    /// `Qwen2ForCausalLM`: Llama's layout with query/key/value biases.
    Qwen2,
    /// `GPT2LMHeadModel`: learned positions, LayerNorm, GeLU, biases, Conv1D weights.
    Gpt2,
    /// `MixtralForCausalLM`: Mistral's layout with a mixture of experts in every layer.
    Mixtral,
    /// `Qwen2MoeForCausalLM`: Qwen2's layout with a mixture of experts and a gated shared
    /// expert in every layer.
    Qwen2Moe,
}

impl HfArchitecture {
    fn from_model_type(t: &str) -> Result<Self, HfError> {
        Ok(match t {
            "llama" => Self::Llama,
            "mistral" => Self::Mistral,
            "qwen2" => Self::Qwen2,
            "gpt2" => Self::Gpt2,
            "mixtral" => Self::Mixtral,
            "qwen2_moe" => Self::Qwen2Moe,
            other => {
                return Err(HfError::Unsupported(format!(
                    "model_type {other:?} (a GPT reads llama, mistral, mixtral, qwen2, qwen2_moe and gpt2)"
                )));
            }
        })
    }

    /// `model_type` and the `architectures` entry.
    pub fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::Llama => ("llama", "LlamaForCausalLM"),
            Self::Mistral => ("mistral", "MistralForCausalLM"),
            Self::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Self::Gpt2 => ("gpt2", "GPT2LMHeadModel"),
            Self::Mixtral => ("mixtral", "MixtralForCausalLM"),
            Self::Qwen2Moe => ("qwen2_moe", "Qwen2MoeForCausalLM"),
        }
    }
}

/// What a Hugging Face causal-LM `config.json` says about the model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HfGptConfig {
    /// The family.
    pub architecture: HfArchitecture,
    /// Vocabulary size (unpadded).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP inner size.
    pub intermediate_size: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// The norms' epsilon.
    pub norm_eps: f64,
    /// RoPE base (Llama family).
    pub rope_theta: f64,
    /// RoPE frequency scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// The output layer is the word embeddings.
    pub tie_word_embeddings: bool,
    /// Biases on every linear layer (Llama's `attention_bias` and `mlp_bias` together;
    /// always on GPT-2).
    pub add_bias_linear: bool,
    /// Query/key/value biases alone (Qwen2).
    pub add_qkv_bias: bool,
    /// The MLP's activation.
    pub activation: ActivationFunc,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_id: Vec<u32>,
    /// The experts of a mixture-of-experts family (Mixtral, Qwen2-MoE).
    pub experts: Option<HfExperts>,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn usize_of(v: &Value, key: &str) -> Result<usize, HfError> {
    get(v, key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| HfError::Checkpoint(format!("config.json: {key} missing or not a number")))
}

fn f64_of(v: &Value, key: &str, default: f64) -> Result<f64, HfError> {
    match get(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .ok_or_else(|| HfError::Checkpoint(format!("config.json: {key} is not a number"))),
    }
}

fn bool_of(v: &Value, key: &str, default: bool) -> Result<bool, HfError> {
    match get(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| HfError::Checkpoint(format!("config.json: {key} is not a boolean"))),
    }
}

fn token_ids(v: &Value, key: &str) -> Vec<u32> {
    match get(v, key) {
        Some(Value::Array(ids)) => ids
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => Vec::new(),
    }
}

/// The rope base and scaling from `rope_parameters` (transformers 5) or from the top-level
/// `rope_theta` and `rope_scaling` (earlier files).
fn rope(v: &Value) -> Result<(f64, Option<RopeScaling>), HfError> {
    let params = get(v, "rope_parameters");
    let theta = match params.and_then(|p| get(p, "rope_theta")) {
        Some(_) => f64_of(params.expect("present"), "rope_theta", 10000.0)?,
        None => f64_of(v, "rope_theta", 10000.0)?,
    };
    let Some(scaling) = params.or_else(|| get(v, "rope_scaling")) else {
        return Ok((theta, None));
    };
    let kind = get(scaling, "rope_type")
        .or_else(|| get(scaling, "type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = || f64_of(scaling, "factor", 1.0);
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: f64_of(scaling, "low_freq_factor", 1.0)?,
            high_freq_factor: f64_of(scaling, "high_freq_factor", 4.0)?,
            original_max_position_embeddings: usize_of(
                scaling,
                "original_max_position_embeddings",
            )?,
        }),
        other => {
            return Err(HfError::Unsupported(format!(
                "rope scaling type {other:?} (supported: default, linear, llama3)"
            )));
        }
    };
    Ok((theta, scaling))
}

impl HfGptConfig {
    /// Reads a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, HfError> {
        let io = |message: String| HfError::Io {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| io(e.to_string()))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| io(e.to_string()))?;
        Self::from_json(&value)
    }

    /// Reads the fields of a parsed `config.json`; refuses what a [`Gpt`](super::super::Gpt)
    /// cannot represent, naming it.
    pub fn from_json(v: &Value) -> Result<Self, HfError> {
        let model_type = get(v, "model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| HfError::Checkpoint("config.json: model_type missing".into()))?;
        let architecture = HfArchitecture::from_model_type(model_type)?;
        if architecture == HfArchitecture::Gpt2 {
            return Self::gpt2(v);
        }
        let unsupported = |m: String| Err(HfError::Unsupported(m));
        let act = get(v, "hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return unsupported(format!(
                "hidden_act {act:?} for {model_type} (only \"silu\")"
            ));
        }
        let use_window = bool_of(v, "use_sliding_window", true)?;
        if let Some(w) = get(v, "sliding_window").filter(|_| use_window) {
            return unsupported(format!("sliding-window attention (sliding_window {w})"));
        }
        let (add_bias_linear, add_qkv_bias) = match architecture {
            HfArchitecture::Qwen2 | HfArchitecture::Qwen2Moe => (false, true),
            _ => {
                let attention = bool_of(v, "attention_bias", false)?;
                let mlp = bool_of(v, "mlp_bias", false)?;
                if attention != mlp {
                    return unsupported(format!(
                        "attention_bias {attention} with mlp_bias {mlp} (biases on all linear layers or none)"
                    ));
                }
                (attention, false)
            }
        };
        if f64_of(v, "partial_rotary_factor", 1.0)? != 1.0 {
            return unsupported("partial_rotary_factor other than 1".into());
        }
        let (hidden, heads) = (
            usize_of(v, "hidden_size")?,
            usize_of(v, "num_attention_heads")?,
        );
        let (rope_theta, rope_scaling) = rope(v)?;
        let experts = HfExperts::read(architecture, v)?;
        Ok(Self {
            architecture,
            vocab_size: usize_of(v, "vocab_size")?,
            hidden_size: hidden,
            intermediate_size: usize_of(v, "intermediate_size")?,
            num_hidden_layers: usize_of(v, "num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: get(v, "num_key_value_heads")
                .map_or(Ok(heads), |_| usize_of(v, "num_key_value_heads"))?,
            head_dim: get(v, "head_dim")
                .map_or(Ok(hidden / heads.max(1)), |_| usize_of(v, "head_dim"))?,
            max_position_embeddings: usize_of(v, "max_position_embeddings")?,
            norm_eps: f64_of(v, "rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: bool_of(v, "tie_word_embeddings", false)?,
            add_bias_linear,
            add_qkv_bias,
            activation: ActivationFunc::Silu,
            bos_token_id: token_ids(v, "bos_token_id").first().copied(),
            eos_token_id: token_ids(v, "eos_token_id"),
            experts,
        })
    }

    fn gpt2(v: &Value) -> Result<Self, HfError> {
        let unsupported = |m: String| Err(HfError::Unsupported(m));
        let activation = match get(v, "activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new")
        {
            "gelu_new" | "gelu_pytorch_tanh" => ActivationFunc::GeluTanh,
            "gelu" => ActivationFunc::Gelu,
            other => return unsupported(format!("GPT-2 activation_function {other:?}")),
        };
        if !bool_of(v, "scale_attn_weights", true)?
            || bool_of(v, "scale_attn_by_inverse_layer_idx", false)?
        {
            return unsupported("GPT-2 attention scaling other than 1/√head_dim".into());
        }
        let (hidden, heads) = (usize_of(v, "n_embd")?, usize_of(v, "n_head")?);
        Ok(Self {
            architecture: HfArchitecture::Gpt2,
            vocab_size: usize_of(v, "vocab_size")?,
            hidden_size: hidden,
            intermediate_size: get(v, "n_inner")
                .map_or(Ok(4 * hidden), |_| usize_of(v, "n_inner"))?,
            num_hidden_layers: usize_of(v, "n_layer")?,
            num_attention_heads: heads,
            num_key_value_heads: heads,
            head_dim: hidden / heads.max(1),
            max_position_embeddings: usize_of(v, "n_positions")?,
            norm_eps: f64_of(v, "layer_norm_epsilon", 1e-5)?,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: bool_of(v, "tie_word_embeddings", true)?,
            add_bias_linear: true,
            add_qkv_bias: false,
            activation,
            bos_token_id: token_ids(v, "bos_token_id").first().copied(),
            eos_token_id: token_ids(v, "eos_token_id"),
            experts: None,
        })
    }

    /// The [`GptConfig`] of this checkpoint at tensor-parallel size `tp` (vocabulary padded
    /// to a multiple of 128 × tp and masked beyond the real one; dropouts off: set them for
    /// training).
    pub fn to_gpt_config(&self, tp: usize) -> GptConfig {
        let gpt2 = self.architecture == HfArchitecture::Gpt2;
        let attention = ParallelAttentionConfig::new(self.num_attention_heads)
            .with_attn_mask_type(AttnMaskType::Causal)
            .with_num_query_groups(Some(self.num_key_value_heads))
            .with_kv_channels(Some(self.head_dim))
            .with_add_qkv_bias(self.add_qkv_bias)
            .with_attention_dropout(0.0);
        let mlp = ParallelMlpConfig::new(self.intermediate_size)
            .with_gated_linear_unit(!gpt2)
            .with_activation_func(self.activation);
        let transformer = TransformerLayerConfig::new(self.hidden_size, attention, mlp)
            .with_layernorm_position(LayerNormPosition::Pre)
            .with_normalization(if gpt2 {
                NormKind::LayerNorm
            } else {
                NormKind::RmsNorm
            })
            .with_layernorm_epsilon(self.norm_eps)
            .with_add_bias_linear(self.add_bias_linear)
            .with_hidden_dropout(0.0)
            .with_moe(self.experts.map(|e| e.moe_config()));
        GptConfig::new(
            self.num_hidden_layers,
            self.max_position_embeddings,
            padded_vocab_size(self.vocab_size, 128, tp),
            transformer,
        )
        .with_vocab_size(Some(self.vocab_size))
        .with_position_embedding_type(if gpt2 {
            PositionEmbeddingType::LearnedAbsolute
        } else {
            PositionEmbeddingType::Rope
        })
        .with_rotary_base(self.rope_theta)
        .with_rope_scaling(self.rope_scaling)
        .with_untie_embeddings_and_output_weights(!self.tie_word_embeddings)
    }

    /// The Hugging Face config of `config` (real vocabulary `vocab_size`): Llama, Qwen2 (QKV
    /// biases alone) or GPT-2 (learned positions), whichever it is; an error naming the
    /// switch that none of them has.
    pub fn from_gpt_config(config: &GptConfig, vocab_size: usize) -> Result<Self, HfError> {
        let unsupported = |m: &str| {
            Err(HfError::Unsupported(format!(
                "{m} has no Hugging Face equivalent here"
            )))
        };
        let t = &config.transformer;
        let (attention, mlp) = (&t.attention, &t.mlp);
        let heads = attention.num_attention_heads;
        let head_dim = config.head_dim();
        let architecture = match config.position_embedding_type {
            PositionEmbeddingType::Rope => {
                if t.normalization != NormKind::RmsNorm
                    || !mlp.gated_linear_unit
                    || mlp.activation_func != ActivationFunc::Silu
                {
                    return unsupported("RoPE without RMSNorm and SwiGLU");
                }
                if config.rotary_percent != 1.0 {
                    return unsupported("a rotary_percent other than 1");
                }
                if attention.add_qkv_bias && !t.add_bias_linear {
                    HfArchitecture::Qwen2
                } else {
                    HfArchitecture::Llama
                }
            }
            PositionEmbeddingType::LearnedAbsolute => {
                if t.normalization != NormKind::LayerNorm
                    || mlp.gated_linear_unit
                    || mlp.activation_func == ActivationFunc::Silu
                    || !t.add_bias_linear
                    || config.query_groups() != heads
                    || head_dim * heads != t.hidden_size
                {
                    return unsupported(
                        "learned positions without GPT-2's LayerNorm, GeLU, biases and one key/value head per head",
                    );
                }
                HfArchitecture::Gpt2
            }
        };
        let (architecture, experts) = match HfExperts::of(config)? {
            Some((family, experts)) => (family, Some(experts)),
            None => (architecture, None),
        };
        Ok(Self {
            architecture,
            vocab_size,
            hidden_size: t.hidden_size,
            intermediate_size: mlp.ffn_hidden_size,
            num_hidden_layers: config.num_layers,
            num_attention_heads: heads,
            num_key_value_heads: config.query_groups(),
            head_dim,
            max_position_embeddings: config.max_position_embeddings,
            norm_eps: t.layernorm_epsilon,
            rope_theta: config.rotary_base,
            rope_scaling: config.rope_scaling,
            tie_word_embeddings: !config.untie_embeddings_and_output_weights,
            add_bias_linear: t.add_bias_linear,
            add_qkv_bias: attention.add_qkv_bias,
            activation: mlp.activation_func,
            bos_token_id: None,
            eos_token_id: Vec::new(),
            experts,
        })
    }

    /// The `config.json` transformers reads (rope settings at the top level, which both
    /// transformers 4 and 5 read).
    pub fn to_json(&self) -> Value {
        let (model_type, architecture) = self.architecture.names();
        let mut v = if self.architecture == HfArchitecture::Gpt2 {
            json!({
                "n_embd": self.hidden_size,
                "n_inner": self.intermediate_size,
                "n_layer": self.num_hidden_layers,
                "n_head": self.num_attention_heads,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": match self.activation {
                    ActivationFunc::Gelu => "gelu",
                    _ => "gelu_new",
                },
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            })
        } else {
            let scaling = self.rope_scaling.map(|s| match s {
                RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                }),
            });
            let mut v = json!({
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": scaling,
                "hidden_act": "silu",
                "attention_dropout": 0.0,
            });
            if let Some(experts) = &self.experts {
                experts.write(self.architecture, &mut v);
            }
            if matches!(
                self.architecture,
                HfArchitecture::Qwen2 | HfArchitecture::Qwen2Moe
            ) {
                v["use_sliding_window"] = json!(false);
            } else {
                v["attention_bias"] = json!(self.add_bias_linear);
                v["mlp_bias"] = json!(self.add_bias_linear);
            }
            v
        };
        v["architectures"] = json!([architecture]);
        v["model_type"] = json!(model_type);
        v["vocab_size"] = json!(self.vocab_size);
        v["tie_word_embeddings"] = json!(self.tie_word_embeddings);
        v["torch_dtype"] = json!("float32");
        if let Some(bos) = self.bos_token_id {
            v["bos_token_id"] = json!(bos);
        }
        match self.eos_token_id.as_slice() {
            [] => {}
            [one] => v["eos_token_id"] = json!(one),
            many => v["eos_token_id"] = json!(many),
        }
        v
    }
}
