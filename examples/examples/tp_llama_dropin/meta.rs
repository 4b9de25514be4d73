//! A Llama checkpoint in Meta's own format, as Meta's download script writes it and
//! llama-burn's `import` feature reads it: `params.json` beside `consolidated.00.pth`, or, for
//! the models Meta saved over several model-parallel ranks (Llama 3 70B: eight), one
//! `consolidated.NN.pth` per rank. Meta's names are llama-burn's, and its query and key
//! projections pair each head's features as Burn's `RotaryEncoding` does, so the options
//! only rename the SwiGLU's two inputs and read PyTorch's layout. A model-parallel checkpoint
//! loads at any TP size that divides the key/value heads: each rank reads the parts of each
//! tensor its shard overlaps, joined as the model holds the tensor.

use super::llama::{LlamaConfig, RopeScaling, read_json};
use super::parallel;
use burn::tensor::Device;
use burn_megatron::comm::Comm;
use burn_megatron::data::GptTokenizer;
use burn_megatron::dropin::{LoadOptions, RecordSource};
use burn_megatron::tensor_parallel::TpError;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A Meta Llama checkpoint's directory, its `params.json` read.
pub struct Checkpoint {
    pub dir: PathBuf,
    /// The model's config. params.json gives no context length: `max_seq_len` is 8192 (the
    /// one Llama 3's RoPE scaling assumes); set it to the positions a run uses.
    pub config: LlamaConfig,
}

impl Checkpoint {
    // ANCHOR: options
    /// How Meta's tensors meet the user's Llama: the SwiGLU's `w1` and `w3` under the names
    /// Burn's `SwiGlu` gives them, linears `[out, in]` and norms' `weight` as `gamma` (the
    /// PyTorch adapter), and Llama 2's precomputed `rope.freqs` skipped (the model computes
    /// them).
    pub fn options() -> Result<LoadOptions, TpError> {
        LoadOptions::default()
            .with_pytorch_adapter(true)
            .with_key_remap(
                r"\.feed_forward\.w1\.",
                ".feed_forward.swiglu.linear_inner.",
            )?
            .with_key_remap(
                r"\.feed_forward\.w3\.",
                ".feed_forward.swiglu.linear_outer.",
            )?
            .with_skipped(r"^rope\.freqs$")
    }
    // ANCHOR_END: options

    /// The model, split over `tp` as `parallel::Llama::load` splits it, with the checkpoint's
    /// weights (joined from its model-parallel files where there are several).
    pub fn load(&self, tp: &Comm, device: &Device) -> Result<parallel::Llama, TpError> {
        let weights = RecordSource::from_meta(&self.dir)?;
        parallel::Llama::load(&self.config, &weights, &Self::options()?, tp, device)
    }

    /// `dir/params.json` read. Meta's Llama 3 files do not give the RoPE scaling factor (Meta's
    /// reference code fixes 8; Hugging Face's configs give 32 for Llama 3.2 1B and 3B, 8 for
    /// the other 3.1 and later models): with `use_scaled_rope`, it is params.json's
    /// `rope_scaling_factor` where present, else `scaling_factor`, else an error (and
    /// `rope_high_freq_factor` where present, else Meta's 4). `rope_theta` defaults to
    /// Llama 2's 10000 (every Llama 3 params.json gives it). Other errors name the setting: a
    /// count that is missing, heads that do not divide the width, key/value heads that do not
    /// divide the heads. Llama 2's `vocab_size` of -1 means the tokenizer's size: that of
    /// `dir/tokenizer.model` (an error without it).
    pub fn open(dir: &Path, scaling_factor: Option<f32>) -> Result<Self, String> {
        let path = dir.join("params.json");
        let json = read_json(&path)?;
        let at = |key: &str| format!("{}: `{key}`", path.display());
        let count = |key: &str| {
            json[key]
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| at(key) + " is not a positive count")
        };
        let vocab_size = match json["vocab_size"].as_i64() {
            Some(-1) => GptTokenizer::from_file(&dir.join("tokenizer.model"))
                .map(|t| t.vocab_size())
                .map_err(|e| at("vocab_size") + &format!(" is -1, the tokenizer's size: {e}"))?,
            _ => count("vocab_size")?,
        };
        let (d_model, n_heads) = (count("dim")?, count("n_heads")?);
        if !d_model.is_multiple_of(n_heads) {
            return Err(at("n_heads") + " does not divide `dim`");
        }
        let n_kv_heads = match json.get("n_kv_heads") {
            Some(Value::Null) | None => n_heads,
            Some(_) => count("n_kv_heads")?,
        };
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(at("n_kv_heads") + " does not divide `n_heads`");
        }
        let scaling = match json["use_scaled_rope"].as_bool().unwrap_or(false) {
            false => None,
            true => {
                let factor = json["rope_scaling_factor"].as_f64().map(|f| f as f32);
                let factor = factor.or(scaling_factor).ok_or_else(|| {
                    at("use_scaled_rope")
                        + " without `rope_scaling_factor`: give the factor (Hugging Face's \
                           configs: 32 for Llama 3.2 1B and 3B, 8 for the other 3.1 and later)"
                })?;
                let high = json["rope_high_freq_factor"].as_f64().unwrap_or(4.0);
                // Meta's `apply_scaling`: its other constants are fixed in code.
                Some(RopeScaling::new(factor, 1.0, high as f32, 8192))
            }
        };
        let config = LlamaConfig::new(
            vocab_size,
            d_model,
            n_heads,
            n_kv_heads,
            ffn_hidden(&json, d_model, count("multiple_of")?)?,
            count("n_layers")?,
            8192,
        )
        .with_norm_eps(json["norm_eps"].as_f64().unwrap_or(1e-5))
        .with_rope_theta(json["rope_theta"].as_f64().unwrap_or(10000.0) as f32)
        .with_rope_scaling(scaling);
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
        })
    }
}

/// Meta's feed-forward width: two thirds of 4 × `dim`, times `ffn_dim_multiplier` where
/// given, rounded up to a multiple of `multiple_of`.
fn ffn_hidden(json: &Value, d_model: usize, multiple_of: usize) -> Result<usize, String> {
    let mut hidden = 2 * 4 * d_model / 3;
    match &json["ffn_dim_multiplier"] {
        Value::Null => {}
        m => {
            let m = m
                .as_f64()
                .ok_or("params.json: `ffn_dim_multiplier` is not a number")?;
            hidden = (m * hidden as f64) as usize;
        }
    }
    Ok(hidden.div_ceil(multiple_of) * multiple_of)
}
