//! What the Llama's three forms share, untouched by the conversion: its config (llama-burn's
//! `LlamaConfig`, and the reader of a checkpoint's JSON config), its rotary encoding,
//! `repeat_kv`, the causal mask and the key/value cache.

use burn::config::Config;
use burn::nn::{RotaryEncoding, RotaryEncodingConfig};
use burn::tensor::{Bool, Device, Tensor, TensorData};

/// The model's sizes, as llama-burn's `LlamaConfig`.
#[derive(Config, Debug)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub max_seq_len: usize,
    /// RMSNorm's epsilon.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// RoPE's base.
    #[config(default = 10000.0)]
    pub rope_theta: f32,
    /// Llama 3's RoPE frequency scaling (Llama 3.1 and later).
    pub rope_scaling: Option<RopeScaling>,
}

/// Llama 3's RoPE frequency scaling, with Hugging Face's names: frequencies whose wavelength
/// exceeds `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those
/// under `original_max_position_embeddings / high_freq_factor` kept, and those between blended.
#[derive(Config, Debug)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

impl RopeScaling {
    fn scale(&self, frequencies: Tensor<1>) -> Tensor<1> {
        let device = frequencies.device();
        let old = self.original_max_position_embeddings as f32;
        let (low, high) = (self.low_freq_factor, self.high_freq_factor);
        let scaled: Vec<f32> = (frequencies.into_data().iter::<f32>())
            .map(|f| {
                let wavelength = 2.0 * std::f32::consts::PI / f;
                if wavelength < old / high {
                    f
                } else if wavelength > old / low {
                    f / self.factor
                } else {
                    let smooth = (old / wavelength - low) / (high - low);
                    (1.0 - smooth) * f / self.factor + smooth * f
                }
            })
            .collect();
        let n = scaled.len();
        Tensor::from_data(TensorData::new(scaled, [n]), &device)
    }
}

impl LlamaConfig {
    /// Burn's rotary encoding of each head's features, scaled as the config says.
    pub fn rope(&self, device: &Device) -> RotaryEncoding {
        let head_dim = self.d_model / self.n_heads;
        let config =
            RotaryEncodingConfig::new(self.max_seq_len, head_dim).with_theta(self.rope_theta);
        match self.rope_scaling.clone() {
            None => config.init(device),
            Some(s) => config.init_with_frequency_scaling(move |f| s.scale(f), device),
        }
    }
}

/// Llama's `repeat_kv`: `[b, kv_heads, s, d]` → `[b, kv_heads · n_rep, s, d]`.
pub fn repeat_kv(x: Tensor<4>, n_rep: usize) -> Tensor<4> {
    let [b, kv_heads, s, d] = x.dims();
    let x = x.unsqueeze_dim::<5>(2).repeat_dim(2, n_rep);
    x.reshape([b, kv_heads * n_rep, s, d])
}

/// `[1, 1, s, t]`, added to the scores of the last `s` of `t` positions: a large negative
/// number where a key lies after its query.
pub fn causal_mask(s: usize, t: usize, device: &Device) -> Tensor<4> {
    let after = Tensor::<2, Bool>::tril_mask([s, t], (t - s) as i64, device);
    Tensor::<2>::zeros([s, t], device)
        .mask_fill(after, -1e9)
        .unsqueeze()
}

/// One layer's keys and values so far, `[batch, kv_heads, max_seq_len, head_dim]` (llama-burn's
/// `cache.rs`, which the conversion does not touch).
pub struct KeyValueCache {
    key: Tensor<4>,
    value: Tensor<4>,
    pub len: usize,
}

impl KeyValueCache {
    pub fn new(
        batch: usize,
        kv_heads: usize,
        max_seq_len: usize,
        head_dim: usize,
        device: &Device,
    ) -> Self {
        let empty = || Tensor::zeros([batch, kv_heads, max_seq_len, head_dim], device);
        Self {
            key: empty(),
            value: empty(),
            len: 0,
        }
    }

    /// Appends `[b, kv_heads, s, d]` keys and values; all of them so far.
    pub fn forward(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let [b, h, s, d] = k.dims();
        let (at, end) = (self.len, self.len + s);
        self.key = self
            .key
            .clone()
            .slice_assign([0..b, 0..h, at..end, 0..d], k);
        self.value = self
            .value
            .clone()
            .slice_assign([0..b, 0..h, at..end, 0..d], v);
        self.len = end;
        let so_far = |t: &Tensor<4>| t.clone().slice([0..b, 0..h, 0..end, 0..d]);
        (so_far(&self.key), so_far(&self.value))
    }
}

/// The JSON file at `path` (a checkpoint's config), or why not, naming the file.
pub fn read_json(path: &std::path::Path) -> Result<serde_json::Value, String> {
    let error = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| error(&e))?;
    serde_json::from_str(&text).map_err(|e| error(&e))
}
