//! Rotary position embeddings (RoPE), rotate-half form: Megatron-Core's
//! `rotary_interleaved = false`, which is also Hugging Face's Llama convention, so Llama
//! checkpoints load without permuting their query and key rows.
//!
//! The first `rotary_dim` channels of each head are rotated (`rotary_percent` of the head;
//! the rest pass through): with `x = [x₁, x₂]` split in halves,
//! `rope(x) = [x₁·cos − x₂·sin, x₂·cos + x₁·sin]`, angle `position · inv_freq[i]`.

use crate::tensor_parallel::TpError;
use burn::config::Config;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron_kernels::apply_rotary;

/// How the inverse frequencies are rescaled for contexts longer than training's
/// (Hugging Face's `rope_scaling` / `rope_parameters`).
#[derive(Config, Debug, Copy, PartialEq)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3's: long wavelengths divided by `factor`, short ones kept, a smooth blend
    /// between `original_max_position_embeddings / high_freq_factor` and `/ low_freq_factor`.
    Llama3 {
        /// The divisor of long wavelengths.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are divided.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was first trained at.
        original_max_position_embeddings: usize,
    },
}

/// Rotary embeddings of one model: `rotary_dim` channels per head at base `rotary_base`.
#[derive(Config, Debug)]
pub struct RotaryEmbeddingConfig {
    /// Channels per head (`kv_channels`).
    pub head_dim: usize,
    /// Megatron's `--rotary-base` (Hugging Face's `rope_theta`).
    #[config(default = 10000.0)]
    pub rotary_base: f64,
    /// Megatron's `--rotary-percent`: the fraction of each head that is rotated.
    #[config(default = 1.0)]
    pub rotary_percent: f64,
    /// Frequency scaling, if any.
    #[config(default = "None")]
    pub scaling: Option<RopeScaling>,
}

/// The inverse frequencies of a model, ready to give the cos/sin tables of any positions.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f32>,
}

/// The cos and sin tables of one forward, `[s, b, 1, rotary_dim]` (or `[s, 1, 1, …]` when
/// every sample sits at the same positions), broadcast over the heads.
#[derive(Debug, Clone)]
pub struct RotaryTables {
    cos: Tensor<4>,
    sin: Tensor<4>,
}

impl RotaryEmbeddingConfig {
    /// Checks the shape and computes the (scaled) inverse frequencies, in f32 as
    /// `transformers` computes them.
    pub fn init(&self) -> Result<RotaryEmbedding, TpError> {
        let bad = |m: String| Err(TpError::Invalid(m));
        if !(self.rotary_percent > 0.0 && self.rotary_percent <= 1.0) {
            return bad(format!(
                "rotary_percent must be in (0, 1], got {}",
                self.rotary_percent
            ));
        }
        // Megatron's rounding: int(kv_channels · rotary_percent).
        let dim = (self.head_dim as f64 * self.rotary_percent) as usize;
        if dim == 0 || !dim.is_multiple_of(2) {
            return bad(format!(
                "the rotated channels per head (head dim {} × rotary_percent {} = {dim}) must be even and at least 2",
                self.head_dim, self.rotary_percent
            ));
        }
        if !(self.rotary_base.is_finite() && self.rotary_base > 1.0) {
            return bad(format!(
                "rotary_base must be finite and above 1, got {}",
                self.rotary_base
            ));
        }
        let base = self.rotary_base as f32;
        let mut inv_freq: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        match self.scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                check_factor(factor)?;
                inv_freq.iter_mut().for_each(|f| *f /= factor as f32);
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                check_factor(factor)?;
                if !(low_freq_factor > 0.0 && high_freq_factor > low_freq_factor) {
                    return bad(format!(
                        "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got {low_freq_factor} and {high_freq_factor}"
                    ));
                }
                let original = original_max_position_embeddings as f32;
                let (low, high) = (low_freq_factor as f32, high_freq_factor as f32);
                let factor = factor as f32;
                let (low_wavelen, high_wavelen) = (original / low, original / high);
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    *f = if wavelen < high_wavelen {
                        *f
                    } else if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        let smooth = (original / wavelen - low) / (high - low);
                        (1.0 - smooth) * *f / factor + smooth * *f
                    };
                }
            }
        }
        Ok(RotaryEmbedding { inv_freq })
    }
}

fn check_factor(factor: f64) -> Result<(), TpError> {
    if factor.is_finite() && factor >= 1.0 {
        Ok(())
    } else {
        Err(TpError::Invalid(format!(
            "rope scaling factor must be finite and at least 1, got {factor}"
        )))
    }
}

impl RotaryEmbedding {
    /// The rotated channels per head.
    pub fn rotary_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// The inverse frequencies (after scaling).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The tables for positions `offset..offset + s` of every sample.
    pub fn tables(&self, s: usize, offset: usize, device: &Device) -> RotaryTables {
        let positions: Vec<usize> = (offset..offset + s).collect();
        self.build(&positions, s, 1, device)
    }

    /// The tables for `positions[b][i]`, the position of token `i` of sample `b` (all rows
    /// the same length `s`): what left-padded batches need.
    pub fn tables_for(&self, positions: &[Vec<usize>], device: &Device) -> RotaryTables {
        let b = positions.len();
        let s = positions.first().map_or(0, Vec::len);
        // [s, b] order, the activations' layout.
        let flat: Vec<usize> = (0..s)
            .flat_map(|i| positions.iter().map(move |row| row[i]))
            .collect();
        self.build(&flat, s, b, device)
    }

    fn build(&self, positions: &[usize], s: usize, b: usize, device: &Device) -> RotaryTables {
        let dim = self.rotary_dim();
        let (mut cos, mut sin) = (
            Vec::with_capacity(s * b * dim),
            Vec::with_capacity(s * b * dim),
        );
        for &p in positions {
            // The angle in f32, then cos/sin of it, as transformers computes them.
            let angles = self.inv_freq.iter().map(|f| p as f32 * f);
            let (c, sn): (Vec<f32>, Vec<f32>) = angles.map(|a| (a.cos(), a.sin())).unzip();
            for _ in 0..2 {
                cos.extend_from_slice(&c);
                sin.extend_from_slice(&sn);
            }
        }
        let table = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [s, b, 1, dim]), device);
        RotaryTables {
            cos: table(cos),
            sin: table(sin),
        }
    }
}

impl RotaryTables {
    /// Rotates the first `rotary_dim` channels of `x` (`[s, b, heads, head_dim]`): the fused
    /// [`apply_rotary`] (one pass per direction on the CPU, one kernel on GPUs), in `x`'s
    /// dtype with the tables rounded to it.
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        apply_rotary(x, self.cos.clone(), self.sin.clone()).expect(
            "the tables are [s, b or 1, 1, rotary_dim] for the activations they were built for, \
             rotary_dim even and at most the head dim (checked at init)",
        )
    }

    /// Sequence length and batch of the tables (`b` is 1 when shared by every sample).
    pub fn dims(&self) -> [usize; 2] {
        let [s, b, ..] = self.cos.dims();
        [s, b]
    }
}

#[cfg(test)]
mod tests;
