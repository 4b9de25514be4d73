//! Megatron-Core's data, read as Megatron reads it: indexed datasets (`.bin`/`.idx`,
//! memory-mapped), `GPTDataset`'s document, sample and shuffle indices (numpy's
//! `RandomState` reproduced bit for bit), `BlendedDataset`, the `--split` of documents into
//! train / valid / test, and the index cache (`--data-cache-path`). The same inputs give
//! the same samples in the same order as Megatron-Core 0.16; the tests hold this against
//! fixtures that megatron-core wrote (`tests/fixtures/megatron_data`).

mod blended;
mod cache;
mod gpt;
mod indexed;
mod numpy_rng;

pub use blended::{Blend, BlendedDataset, MegatronSplit, build_gpt_datasets, normalize};
pub use gpt::{GPTDataset, PAD_TOKEN_ID};
pub use indexed::{IndexedDataset, IndexedDatasetBuilder, TokenDType, dataset_paths};
pub use numpy_rng::NumpyRandomState;

use super::DataError;
use burn::config::Config;

/// Megatron's dataset splits, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Training.
    Train,
    /// Validation.
    Valid,
    /// Test.
    Test,
}

impl Split {
    /// The three splits, in `--split`'s order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    /// Megatron's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }
}

/// How GPT samples are cut (the fields of Megatron-Core's `GPTDatasetConfig` that change
/// which tokens a sample holds).
#[derive(Config, Debug)]
pub struct GPTDatasetConfig {
    /// Tokens per sample (`--seq-length`); each sample holds one more for the last label.
    pub sequence_length: usize,
    /// `--seed`: seeds numpy's `RandomState` (0 to 2³² − 1).
    #[config(default = 1234)]
    pub random_seed: u64,
    /// `--split`: the train / valid / test proportions of the documents.
    #[config(default = "String::from(\"969,30,1\")")]
    pub split: String,
    /// Samples of `sequence_length + 1` tokens (Megatron's default).
    #[config(default = true)]
    pub add_extra_token_to_sequence: bool,
    /// Whether validation drops a last partial sample (else it is padded).
    #[config(default = true)]
    pub drop_last_partial_validation_sequence: bool,
    /// Extra samples built per blended dataset, as a fraction.
    #[config(default = 0.005)]
    pub mid_level_dataset_surplus: f64,
    /// `--data-cache-path`: where built indices are kept (default: beside the data).
    #[config(default = "None")]
    pub path_to_cache: Option<String>,
}

/// numpy's `sum` of a float64 array (pairwise summation, so blend weights normalise to
/// the same bits).
pub(crate) fn numpy_sum(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 8 {
        values.iter().fold(0.0, |acc, v| acc + v)
    } else if n <= 128 {
        let mut r: [f64; 8] = values[..8].try_into().unwrap_or([0.0; 8]);
        let whole = n - n % 8;
        for chunk in values[8..whole].chunks_exact(8) {
            for (acc, v) in r.iter_mut().zip(chunk) {
                *acc += v;
            }
        }
        let mut sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for v in &values[whole..] {
            sum += v;
        }
        sum
    } else {
        let half = n / 2 - (n / 2) % 8;
        numpy_sum(&values[..half]) + numpy_sum(&values[half..])
    }
}

/// `--split "969,30,1"` as Megatron's split matrix: each split's `[begin, end)` fraction
/// of the documents, `None` where it is empty.
pub fn split_matrix(split: &str) -> Result<[Option<(f64, f64)>; 3], DataError> {
    let bad = |m: String| DataError::Config(format!("--split {split:?}: {m}"));
    let mut parts = Vec::new();
    for word in split
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|w| !w.is_empty())
    {
        parts.push(
            word.parse::<f64>()
                .map_err(|_| bad(format!("{word:?} is not a number")))?,
        );
    }
    if parts.len() > 3 {
        return Err(bad("at most three proportions (train, valid, test)".into()));
    }
    parts.resize(3, 0.0);
    if numpy_sum(&parts) <= 0.0 {
        return Err(bad("the proportions sum to zero".into()));
    }
    let parts = blended::normalize(&parts);
    let mut matrix = [None; 3];
    let mut begin = 0.0;
    for (slot, p) in matrix.iter_mut().zip(parts) {
        let end = begin + p;
        if end > begin {
            *slot = Some((begin, end));
        }
        begin = end;
    }
    Ok(matrix)
}

/// The elements `[begin, end)` of `n` that a split's fractions (a [`split_matrix`] row)
/// take, rounded as Python's `round` (half to even), as Megatron's builder does.
pub fn split_range((begin, end): (f64, f64), n: usize) -> std::ops::Range<usize> {
    let n = n as f64;
    (begin * n).round_ties_even() as usize..(end * n).round_ties_even() as usize
}

#[cfg(test)]
mod tests;
