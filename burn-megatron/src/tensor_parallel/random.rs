//! Dropout randomness that is the same or different across tensor-parallel ranks, as the
//! region requires (Megatron's CUDA RNG tracker).
//!
//! Outside tensor-parallel regions activations are duplicated on every TP rank, so their
//! dropout masks must agree: they come from the default stream, seeded with `seed` on every
//! rank. Inside a region (e.g. attention probabilities of this rank's heads) each rank holds
//! different data and draws from the model-parallel stream, seeded with
//! `seed + 2718 + tp_rank`. Both streams are ChaCha8 on the host and draw one 64-bit seed per
//! dropout; the mask is a hash of that seed and the element index, computed where the tensor
//! lives (`burn_megatron_kernels::dropout`): reproducible from the seed, the same on every
//! backend, independent of other threads, and never uploaded.

use burn::tensor::Tensor;
use burn_megatron_kernels::KernelError;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use std::sync::{Arc, Mutex};

/// Megatron's offset of the model-parallel seed.
pub const MODEL_PARALLEL_SEED_OFFSET: u64 = 2718;

/// Which stream a dropout draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RngRegion {
    /// Duplicated activations: the same mask on every TP rank.
    Default,
    /// Tensor-parallel activations: a different mask on each TP rank.
    TensorModelParallel,
}

#[derive(Debug)]
struct Streams {
    default: ChaCha8Rng,
    model_parallel: ChaCha8Rng,
}

/// One rank's dropout streams. Clones share the streams.
#[derive(Debug, Clone)]
pub struct RngTracker {
    streams: Arc<Mutex<Streams>>,
    seed: u64,
    tp_rank: usize,
}

impl RngTracker {
    /// The streams of tensor-parallel rank `tp_rank` for `seed`.
    pub fn new(seed: u64, tp_rank: usize) -> Self {
        Self {
            streams: Arc::new(Mutex::new(Streams {
                default: ChaCha8Rng::seed_from_u64(seed),
                model_parallel: ChaCha8Rng::seed_from_u64(Self::model_parallel_seed(seed, tp_rank)),
            })),
            seed,
            tp_rank,
        }
    }

    /// `seed + 2718 + tp_rank`, wrapping: every `u64` is a valid seed.
    pub fn model_parallel_seed(seed: u64, tp_rank: usize) -> u64 {
        seed.wrapping_add(MODEL_PARALLEL_SEED_OFFSET)
            .wrapping_add(tp_rank as u64)
    }

    /// The seed and tensor-parallel rank the tracker was built with.
    pub fn seed(&self) -> (u64, usize) {
        (self.seed, self.tp_rank)
    }

    /// An independent tracker whose streams start where this one's are now: what a
    /// recomputed region replays, so that its second forward draws the same masks as its
    /// first (Megatron's `CheckpointFunction` saves and restores the tracker's states).
    pub fn fork(&self) -> Self {
        let streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        // ChaCha's state is its key, stream and position.
        let copy = |r: &ChaCha8Rng| {
            let mut c = ChaCha8Rng::from_seed(r.get_seed());
            c.set_stream(r.get_stream());
            c.set_word_pos(r.get_word_pos());
            c
        };
        Self {
            streams: Arc::new(Mutex::new(Streams {
                default: copy(&streams.default),
                model_parallel: copy(&streams.model_parallel),
            })),
            seed: self.seed,
            tp_rank: self.tp_rank,
        }
    }

    /// A fresh seed from `region`'s stream, for a dropout whose mask a kernel derives from it
    /// (`burn_megatron_kernels::bias_dropout_add`): the same on every TP rank for
    /// [`RngRegion::Default`], different for [`RngRegion::TensorModelParallel`].
    pub fn next_seed(&self, region: RngRegion) -> u64 {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        match region {
            RngRegion::Default => streams.default.random(),
            RngRegion::TensorModelParallel => streams.model_parallel.random(),
        }
    }

    /// Inverted dropout of `x` with drop probability `prob`, its mask from a fresh seed of
    /// `region`'s stream. Applied only to tensors on an autodiff device (training), as Burn's
    /// `Dropout`. Errors unless `0 ≤ prob < 1`.
    pub fn dropout<const D: usize>(
        &self,
        x: Tensor<D>,
        prob: f64,
        region: RngRegion,
    ) -> Result<Tensor<D>, KernelError> {
        match self.dropout_seed(&x, prob, region) {
            Some(seed) => burn_megatron_kernels::dropout(x, prob as f32, seed),
            None => Ok(x),
        }
    }

    /// The seed [`dropout`](Self::dropout) would draw for `x`, drawn, or `None` where it
    /// would not drop (`prob` 0, or `x` not on an autodiff device): for a fused op that
    /// applies the dropout itself.
    pub fn dropout_seed<const D: usize>(
        &self,
        x: &Tensor<D>,
        prob: f64,
        region: RngRegion,
    ) -> Option<u64> {
        (prob != 0.0 && x.is_autodiff()).then(|| self.next_seed(region))
    }
}

#[cfg(test)]
mod tests;
