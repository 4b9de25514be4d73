//! Initialisation that does not depend on the tensor-parallel size.
//!
//! Every rank generates the *full* master weight on the host from the layer's seed and keeps
//! only its slice, so a layer split over 4 ranks starts from exactly the weights it would
//! have on one (Megatron's CPU initialisation). The stream is ChaCha8, whose output is fixed
//! for a given seed on every platform.

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};

/// How a parameter's master values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum MasterInit {
    /// Normal with the given mean and standard deviation (Megatron's `init_method_normal`).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Uniform on `[low, high)`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Uniform on `±1/√fan_in`: what `burn::nn::Linear` and PyTorch's `nn.Linear` use.
    KaimingUniform,
    /// Every value equal to the constant.
    Constant(f64),
}

impl MasterInit {
    /// Zeros (biases).
    pub const ZEROS: MasterInit = MasterInit::Constant(0.0);

    /// Megatron's `scaled_init_method_normal`, for the layers' output projections of a
    /// model of `num_layers`: a normal's standard deviation divided by `√(2·num_layers)`.
    /// Megatron scales nothing else, so any other kind is returned as it is.
    ///
    /// ```
    /// use burn_megatron::tensor_parallel::MasterInit;
    /// let init = MasterInit::Normal { mean: 0.0, std: 0.02 }.scaled_for_layers(2);
    /// assert_eq!(init, MasterInit::Normal { mean: 0.0, std: 0.01 });
    /// assert_eq!(MasterInit::KaimingUniform.scaled_for_layers(2), MasterInit::KaimingUniform);
    /// ```
    pub fn scaled_for_layers(self, num_layers: usize) -> MasterInit {
        match self {
            MasterInit::Normal { mean, std } => MasterInit::Normal {
                mean,
                std: std / (2.0 * num_layers.max(1) as f64).sqrt(),
            },
            other => other,
        }
    }

    /// Refuses a distribution that cannot be drawn from (a negative or non-finite standard
    /// deviation, an empty or inverted uniform range, a non-finite value), naming it. Every
    /// layer config checks its initialisers at `init`, before drawing.
    ///
    /// ```
    /// use burn_megatron::tensor_parallel::MasterInit;
    /// assert!(MasterInit::Normal { mean: 0.0, std: -0.02 }.check().is_err());
    /// assert!(MasterInit::Uniform { low: 1.0, high: 0.5 }.check().is_err());
    /// assert!(MasterInit::KaimingUniform.check().is_ok());
    /// ```
    pub fn check(&self) -> Result<(), super::TpError> {
        let ok = match *self {
            MasterInit::Normal { mean, std } => mean.is_finite() && std.is_finite() && std >= 0.0,
            MasterInit::Uniform { low, high } => low.is_finite() && high.is_finite() && low < high,
            MasterInit::KaimingUniform => true,
            MasterInit::Constant(c) => c.is_finite(),
        };
        if ok {
            Ok(())
        } else {
            Err(super::TpError::Invalid(format!(
                "cannot initialise from {self:?}: a normal needs a finite std ≥ 0, a uniform finite low < high"
            )))
        }
    }

    /// `count` values from the stream seeded with `seed`; `fan_in` is used by
    /// [`KaimingUniform`](Self::KaimingUniform).
    ///
    /// # Panics
    ///
    /// On a distribution [`check`](Self::check) refuses.
    ///
    /// ```
    /// use burn_megatron::tensor_parallel::MasterInit;
    /// let a = MasterInit::Normal { mean: 0.0, std: 0.02 }.values(6, 3, 7);
    /// assert_eq!(a, MasterInit::Normal { mean: 0.0, std: 0.02 }.values(6, 3, 7));
    /// ```
    pub fn values(&self, count: usize, fan_in: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let sample = |d: &dyn Fn(&mut ChaCha8Rng) -> f64, rng: &mut ChaCha8Rng| {
            (0..count).map(|_| d(rng) as f32).collect::<Vec<f32>>()
        };
        match *self {
            MasterInit::Normal { mean, std } => {
                let d = Normal::new(mean, std).expect("checked by MasterInit::check at init");
                sample(&|r| d.sample(r), &mut rng)
            }
            MasterInit::Uniform { low, high } => {
                let d = Uniform::new(low, high).expect("checked by MasterInit::check at init");
                sample(&|r| d.sample(r), &mut rng)
            }
            MasterInit::KaimingUniform => {
                let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
                let d = Uniform::new(-bound, bound).expect("a positive bound");
                sample(&|r| d.sample(r), &mut rng)
            }
            MasterInit::Constant(c) => vec![c as f32; count],
        }
    }
}

/// A seed for the parameter at `path` (e.g. `"encoder.layers.3.mlp.fc1.weight"`) derived
/// from a model seed: stable, and the same on every rank and at every parallel layout.
pub fn derive_seed(seed: u64, path: &str) -> u64 {
    // FNV-1a over the path, mixed with the seed by SplitMix64's finaliser.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = seed ^ h;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rows `[start, start + len)` of a row-major `[rows, cols]` matrix.
pub(crate) fn slice_rows(full: &[f32], cols: usize, start: usize, len: usize) -> Vec<f32> {
    full[start * cols..(start + len) * cols].to_vec()
}

/// Columns `[start, start + len)` of a row-major `[rows, cols]` matrix.
pub(crate) fn slice_cols<T: Copy>(full: &[T], cols: usize, start: usize, len: usize) -> Vec<T> {
    full.chunks(cols)
        .flat_map(|row| row[start..start + len].iter().copied())
        .collect()
}

#[cfg(test)]
mod tests;
