//! A Hugging Face Llama checkpoint (`config.json` and `model.safetensors`, or shards named by
//! `model.safetensors.index.json`) in the user's Llama: the config as a [`LlamaConfig`], and
//! the [`LoadOptions`] that bring the checkpoint's tensors to the model's paths and layouts.
//! The model's code does not change; each rank still reads only its shards.

use super::llama::{LlamaConfig, RopeScaling};
use super::parallel;
use burn::tensor::Device;
use burn_megatron::comm::Comm;
use burn_megatron::dropin::{LoadOptions, rotary_half_to_interleaved};
use burn_megatron::tensor_parallel::TpError;
use serde_json::Value;
use std::path::{Path, PathBuf};

// ANCHOR: options
/// How a Hugging Face Llama's tensors meet the user's Llama: its names renamed to the model's
/// paths, its linears read `[out, in]` and its norms' `weight` as `gamma` (the PyTorch
/// adapter), each query and key head's features, stored as `rotate_half`'s two halves,
/// paired as Burn's `RotaryEncoding` pairs them (the key projection has the key/value
/// heads), and the output layer read from the embedding's table where the checkpoint ties
/// them (`tie_word_embeddings`, as Llama 3.2's 1B and 3B do: no `lm_head.weight` saved).
pub fn options(c: &LlamaConfig) -> Result<LoadOptions, TpError> {
    let renames = [
        (r"^model\.", ""),
        (r"^embed_tokens\.", "tok_embeddings."),
        (r"^lm_head\.", "output."),
        (r"\.self_attn\.([qkvo])_proj\.", ".attention.w$1."),
        (r"\.mlp\.gate_proj\.", ".feed_forward.swiglu.linear_inner."),
        (r"\.mlp\.up_proj\.", ".feed_forward.swiglu.linear_outer."),
        (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
        (r"\.input_layernorm\.", ".attention_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
    ];
    let mut options = LoadOptions::default().with_pytorch_adapter(true);
    for (pattern, replacement) in renames {
        options = options.with_key_remap(pattern, replacement)?;
    }
    let options = options.with_tied("output.weight", "tok_embeddings.weight");
    options
        .with_transform(r"\.wq\.weight$", rotary_half_to_interleaved(c.n_heads))?
        .with_transform(r"\.wk\.weight$", rotary_half_to_interleaved(c.n_kv_heads))
}
// ANCHOR_END: options

/// The model, split over `tp` as `parallel::Llama::load` splits it, with the weights of the
/// checkpoint in `dir`.
pub fn load(
    c: &LlamaConfig,
    dir: &Path,
    tp: &Comm,
    device: &Device,
) -> Result<parallel::Llama, TpError> {
    parallel::Llama::load(c, &checkpoint(dir), &options(c)?, tp, device)
}

/// The checkpoint's index where it is sharded, else its one file.
pub fn checkpoint(dir: &Path) -> PathBuf {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        index
    } else {
        dir.join("model.safetensors")
    }
}

/// `dir/config.json` as the model's config. What this Llama cannot hold is an error naming the
/// setting: another model type, biases, another activation, a head width other than
/// `hidden_size / num_attention_heads`, a RoPE other than the default or Llama 3's.
pub fn config(dir: &Path) -> Result<LlamaConfig, String> {
    let (path, json) = read_config(dir)?;
    let at = |key: &str| format!("{}: `{key}`", path.display());
    let number = |key: &str| {
        json[key]
            .as_f64()
            .ok_or_else(|| at(key) + " is not a number")
    };
    let count = |key: &str| {
        json[key]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| at(key) + " is not a count")
    };
    let flag = |key: &str| json[key].as_bool().unwrap_or(false);
    if json["model_type"].as_str().is_some_and(|t| t != "llama") {
        return Err(at("model_type") + " is not llama");
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(key) {
            return Err(at(key) + " is true: this Llama has no biases");
        }
    }
    if json["hidden_act"].as_str().is_some_and(|a| a != "silu") {
        return Err(at("hidden_act") + " is not silu: the feed-forward is SwiGLU");
    }
    let (d_model, n_heads) = (count("hidden_size")?, count("num_attention_heads")?);
    if json["head_dim"]
        .as_u64()
        .is_some_and(|d| d as usize * n_heads != d_model)
    {
        return Err(at("head_dim") + " is not hidden_size / num_attention_heads");
    }
    // transformers 5 nests RoPE's settings in `rope_parameters`; 4 keeps `rope_theta` at the
    // top and the scaling in `rope_scaling`.
    let rope = [&json["rope_parameters"], &json["rope_scaling"]]
        .into_iter()
        .find(|r| r.is_object());
    let theta = rope
        .and_then(|r| r["rope_theta"].as_f64())
        .or(json["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    let kind = rope.and_then(|r| r["rope_type"].as_str().or(r["type"].as_str()));
    let scaling = match kind {
        None | Some("default") => None,
        Some("llama3") => {
            let r = rope.expect("a RoPE kind comes from its settings");
            let value = |key: &str| r[key].as_f64().ok_or_else(|| at(key) + " is not a number");
            Some(RopeScaling::new(
                value("factor")? as f32,
                value("low_freq_factor")? as f32,
                value("high_freq_factor")? as f32,
                value("original_max_position_embeddings")? as usize,
            ))
        }
        Some(other) => return Err(at("rope_type") + &format!(" is {other}: not default or llama3")),
    };
    Ok(LlamaConfig::new(
        count("vocab_size")?,
        d_model,
        n_heads,
        json["num_key_value_heads"]
            .as_u64()
            .map_or(n_heads, |n| n as usize),
        count("intermediate_size")?,
        count("num_hidden_layers")?,
        count("max_position_embeddings")?,
    )
    .with_norm_eps(number("rms_norm_eps")?)
    .with_rope_theta(theta as f32)
    .with_rope_scaling(scaling))
}

/// `dir/config.json`'s `bos_token_id`, where it has one.
pub fn bos_token_id(dir: &Path) -> Result<Option<i64>, String> {
    Ok(read_config(dir)?.1["bos_token_id"].as_i64())
}

fn read_config(dir: &Path) -> Result<(PathBuf, Value), String> {
    let path = dir.join("config.json");
    let error = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let text = std::fs::read_to_string(&path).map_err(|e| error(&e))?;
    let json = serde_json::from_str(&text).map_err(|e| error(&e))?;
    Ok((path, json))
}
