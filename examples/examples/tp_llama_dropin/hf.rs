//! A Hugging Face Llama checkpoint (`config.json` with `model.safetensors`,
//! `pytorch_model.bin`, or the shards an `*.index.json` names) in the user's Llama: the config
//! as a [`LlamaConfig`], and the [`LoadOptions`] that bring the checkpoint's tensors to the
//! model's paths and layouts. The model's code does not change; each rank still reads only
//! its shards.

use super::llama::{LlamaConfig, RopeScaling, read_json};
use super::parallel;
use burn::tensor::Device;
use burn_megatron::comm::Comm;
use burn_megatron::dropin::{LoadOptions, RecordSource, SaveOptions, rotary_half_to_interleaved};
use burn_megatron::dropin::{rotary_interleaved_to_half, save_safetensors};
use burn_megatron::tensor_parallel::TpError;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A Hugging Face Llama checkpoint's directory, its `config.json` read.
pub struct Checkpoint {
    pub dir: PathBuf,
    /// The model's config. Its `max_seq_len` is `max_position_embeddings` (128k for Llama
    /// 3.1 and later): the rotary table and a generation cache take that many positions, so
    /// set it to the positions a run uses.
    pub config: LlamaConfig,
    /// Whether the output layer shares the embedding's table (no `lm_head.weight` saved).
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<i64>,
}

impl Checkpoint {
    // ANCHOR: options
    /// How the checkpoint's tensors meet the user's Llama: its names renamed to the model's
    /// paths, its linears read `[out, in]` and its norms' `weight` as `gamma` (the PyTorch
    /// adapter), each query and key head's features, stored as `rotate_half`'s two halves,
    /// paired as Burn's `RotaryEncoding` pairs them (the key projection has the key/value
    /// heads), where the checkpoint ties them (Llama 3.2's 1B and 3B), the output layer read
    /// from the embedding's table, and an older checkpoint's rotary buffers skipped.
    pub fn options(&self) -> Result<LoadOptions, TpError> {
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
        if self.tie_word_embeddings {
            options = options.with_tied("output.weight", "tok_embeddings.weight");
        }
        let (heads, kv_heads) = (self.config.n_heads, self.config.n_kv_heads);
        // What `transformers` before 4.31 saved beside each attention; the model computes it.
        let options = options.with_skipped(r"\.rotary_emb\.inv_freq$")?;
        options
            .with_transform(r"\.wq\.weight$", rotary_half_to_interleaved(heads))?
            .with_transform(r"\.wk\.weight$", rotary_half_to_interleaved(kv_heads))
    }
    // ANCHOR_END: options

    // ANCHOR: save_options
    /// The way back, for `save_safetensors`: the model's paths to Hugging Face's names,
    /// linears `[out, in]` and norms' `gamma` as `weight`, each query and key head's features
    /// back in `rotate_half`'s two halves. Where the checkpoint ties, the output layer is left
    /// out: `transformers` ties it to the embedding again (train it frozen, or untie it in
    /// `config.json` and leave this out).
    pub fn save_options(&self) -> Result<SaveOptions, TpError> {
        let renames = [
            (r"^tok_embeddings\.", "model.embed_tokens."),
            (r"^output\.", "lm_head."),
            (r"^(layers|norm)\.", "model.$1."),
            (r"\.attention\.w([qkvo])\.", ".self_attn.${1}_proj."),
            (r"\.feed_forward\.swiglu\.linear_inner\.", ".mlp.gate_proj."),
            (r"\.feed_forward\.swiglu\.linear_outer\.", ".mlp.up_proj."),
            (r"\.feed_forward\.w2\.", ".mlp.down_proj."),
            (r"\.attention_norm\.", ".input_layernorm."),
            (r"\.ffn_norm\.", ".post_attention_layernorm."),
        ];
        let mut options = SaveOptions::default().with_pytorch_adapter(true);
        for (pattern, replacement) in renames {
            options = options.with_key_remap(pattern, replacement)?;
        }
        if self.tie_word_embeddings {
            options = options.with_skipped(r"^output\.weight$")?;
        }
        let (heads, kv_heads) = (self.config.n_heads, self.config.n_kv_heads);
        options
            .with_transform(r"\.wq\.weight$", rotary_interleaved_to_half(heads))?
            .with_transform(r"\.wk\.weight$", rotary_interleaved_to_half(kv_heads))
    }
    // ANCHOR_END: save_options

    /// `model`'s weights as this checkpoint's `model.safetensors` in `dir` (with its
    /// `config.json`, copied): a Hugging Face checkpoint `transformers` loads. Collective over
    /// `tp`.
    pub fn save(&self, model: &parallel::Llama, dir: &Path, tp: &Comm) -> Result<(), TpError> {
        let io = |e: std::io::Error| TpError::Invalid(format!("{}: {e}", dir.display()));
        let config = self.dir.join("config.json");
        // Every rank goes on to the collective write, whatever the copy did.
        let copied = match tp.group().rank() {
            0 => std::fs::create_dir_all(dir)
                .and_then(|_| std::fs::copy(config, dir.join("config.json"))),
            _ => Ok(0),
        };
        let options = self.save_options()?;
        let saved = save_safetensors(model, dir.join("model.safetensors"), tp, &options);
        copied.map_err(io)?;
        saved
    }

    /// The model, split over `tp` as `parallel::Llama::load` splits it, with the checkpoint's
    /// weights.
    pub fn load(&self, tp: &Comm, device: &Device) -> Result<parallel::Llama, TpError> {
        let weights = RecordSource::from_hugging_face(&self.dir)?;
        parallel::Llama::load(&self.config, &weights, &self.options()?, tp, device)
    }

    /// `dir/config.json` read. What this Llama cannot hold is an error naming the setting:
    /// another model type, biases, another activation, a head width other than
    /// `hidden_size / num_attention_heads`, key/value heads that do not divide the heads, a
    /// RoPE other than the default or Llama 3's.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let path = dir.join("config.json");
        let json = read_json(&path)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config: config(&path, &json)?,
            tie_word_embeddings: json["tie_word_embeddings"].as_bool().unwrap_or(false),
            bos_token_id: json["bos_token_id"].as_i64(),
        })
    }
}

fn config(path: &Path, json: &Value) -> Result<LlamaConfig, String> {
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
    let kv_heads = (json["num_key_value_heads"].as_u64()).map_or(n_heads, |n| n as usize);
    if kv_heads == 0 || !n_heads.is_multiple_of(kv_heads) {
        return Err(at("num_key_value_heads") + " does not divide num_attention_heads");
    }
    Ok(LlamaConfig::new(
        count("vocab_size")?,
        d_model,
        n_heads,
        kv_heads,
        count("intermediate_size")?,
        count("num_hidden_layers")?,
        count("max_position_embeddings")?,
    )
    .with_norm_eps(number("rms_norm_eps")?)
    .with_rope_theta(theta as f32)
    .with_rope_scaling(scaling))
}
