//! Megatron-Core's `BlendedDataset` and the part of `BlendedMegatronDatasetBuilder` that
//! turns `--data-path [w1] p1 [w2] p2 …` and `--split` into train / valid / test datasets.

use super::gpt::{GPTDataset, open_shared};
use super::{GPTDatasetConfig, Split, numpy_sum, split_matrix, split_range};
use crate::data::DataError;
use std::path::PathBuf;
use std::sync::Arc;

/// `--data-path`: dataset prefixes, with weights when blended.
#[derive(Debug, Clone, PartialEq)]
pub struct Blend {
    /// The `.bin`/`.idx` path prefixes.
    pub prefixes: Vec<PathBuf>,
    /// Their weights (unnormalised), or `None` for a single unweighted prefix.
    pub weights: Option<Vec<f64>>,
}

impl Blend {
    /// Parses Megatron's `--data-path` words: `PREFIX`, or `W1 P1 W2 P2 …`.
    pub fn parse(words: &[String]) -> Result<Self, DataError> {
        let bad = |m: String| DataError::Config(format!("--data-path: {m}"));
        match words {
            [] => Err(bad("no dataset prefix".into())),
            [prefix] => Ok(Self {
                prefixes: vec![PathBuf::from(prefix)],
                weights: None,
            }),
            _ if words.len() % 2 == 1 => Err(bad(format!(
                "{} words: give one prefix, or weight-prefix pairs",
                words.len()
            ))),
            _ => {
                let (mut prefixes, mut weights) = (Vec::new(), Vec::new());
                for pair in words.chunks(2) {
                    let w: f64 = pair[0].parse().map_err(|_| {
                        bad(format!(
                            "{:?} is not a weight (expected W1 P1 W2 P2 …)",
                            pair[0]
                        ))
                    })?;
                    if !(w.is_finite() && w > 0.0) {
                        return Err(bad(format!("weight {w} of {} must be positive", pair[1])));
                    }
                    weights.push(w);
                    prefixes.push(PathBuf::from(&pair[1]));
                }
                Ok(Self {
                    prefixes,
                    weights: Some(weights),
                })
            }
        }
    }
}

/// Megatron's `normalize`: `w / numpy.sum(w)`.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let sum = numpy_sum(weights);
    weights.iter().map(|w| w / sum).collect()
}

/// Samples drawn from several datasets in proportion to their weights (Megatron's
/// `BlendedDataset`): sample `i` comes from the dataset whose share so far lags its weight
/// the most (`build_blending_indices`).
#[derive(Debug)]
pub struct BlendedDataset {
    datasets: Vec<Arc<GPTDataset>>,
    weights: Vec<f64>,
    dataset_index: Vec<u16>,
    dataset_sample_index: Vec<u64>,
}

impl BlendedDataset {
    /// Blends `datasets` with `weights` (normalised here, as Megatron does) into `size`
    /// samples.
    pub fn new(
        datasets: Vec<Arc<GPTDataset>>,
        weights: &[f64],
        size: usize,
    ) -> Result<Self, DataError> {
        if datasets.len() != weights.len() || datasets.is_empty() || datasets.len() >= 32767 {
            return Err(DataError::Config(format!(
                "{} datasets with {} weights",
                datasets.len(),
                weights.len()
            )));
        }
        let weights = normalize(weights);
        let mut taken = vec![0u64; datasets.len()];
        let (mut dataset_index, mut dataset_sample_index) =
            (Vec::with_capacity(size), Vec::with_capacity(size));
        for i in 0..size {
            let at = (i as f64).max(1.0);
            let mut best = 0;
            let mut best_error = weights[0] * at - taken[0] as f64;
            for (d, w) in weights.iter().enumerate().skip(1) {
                let error = w * at - taken[d] as f64;
                if error > best_error {
                    (best, best_error) = (d, error);
                }
            }
            dataset_index.push(best as u16);
            dataset_sample_index.push(taken[best]);
            taken[best] += 1;
        }
        for (d, &n) in taken.iter().enumerate() {
            if n as usize > datasets[d].len() {
                return Err(DataError::Config(format!(
                    "{}: the blend takes {n} samples but the {} split has {}",
                    datasets[d].indexed().prefix().display(),
                    datasets[d].split().name(),
                    datasets[d].len()
                )));
            }
        }
        Ok(Self {
            datasets,
            weights,
            dataset_index,
            dataset_sample_index,
        })
    }

    /// The number of samples.
    pub fn len(&self) -> usize {
        self.dataset_index.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.dataset_index.is_empty()
    }

    /// The component datasets.
    pub fn datasets(&self) -> &[Arc<GPTDataset>] {
        &self.datasets
    }

    /// The normalised weights.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Which dataset sample `i` comes from, and its index there.
    pub fn source(&self, i: usize) -> Option<(usize, usize)> {
        Some((
            usize::from(*self.dataset_index.get(i)?),
            *self.dataset_sample_index.get(i)? as usize,
        ))
    }

    /// The tokens of sample `i`.
    pub fn sample(&self, i: usize) -> Result<Vec<i64>, DataError> {
        let (d, s) = self
            .source(i)
            .ok_or_else(|| DataError::Config(format!("sample {i} of {}", self.len())))?;
        self.datasets[d].sample(s)
    }
}

/// One split of a run's data: a single prefix's [`GPTDataset`], or a [`BlendedDataset`].
#[derive(Debug, Clone)]
pub enum MegatronSplit {
    /// One unweighted prefix.
    Single(Arc<GPTDataset>),
    /// Weighted prefixes.
    Blended(Arc<BlendedDataset>),
}

impl MegatronSplit {
    /// The number of samples.
    pub fn len(&self) -> usize {
        match self {
            Self::Single(d) => d.len(),
            Self::Blended(b) => b.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `sequence_length + 1` tokens of sample `i`.
    pub fn sample(&self, i: usize) -> Result<Vec<i64>, DataError> {
        match self {
            Self::Single(d) => d.sample(i),
            Self::Blended(b) => b.sample(i),
        }
    }

    /// The GPT datasets this split reads.
    pub fn datasets(&self) -> Vec<Arc<GPTDataset>> {
        match self {
            Self::Single(d) => vec![d.clone()],
            Self::Blended(b) => b.datasets().to_vec(),
        }
    }
}

/// `int(ceil(ceil(size · w) · (1 + surplus)))` per dataset (Megatron's
/// `_get_size_per_split_per_dataset`).
fn size_per_dataset(weights: &[f64], size: usize, surplus: f64) -> Vec<usize> {
    weights
        .iter()
        .map(|w| ((size as f64 * w).ceil() * (1.0 + surplus)).ceil() as usize)
        .collect()
}

/// Megatron's `BlendedMegatronDatasetBuilder(GPTDataset, sizes, …).build()`: the train,
/// valid and test datasets of `blend` under `config.split`, each with at least `sizes[i]`
/// samples (`None`: one epoch). A split of zero width, or (for one unweighted prefix) with
/// no document, is `None`.
///
/// ```no_run
/// use burn_megatron::data::megatron::{build_gpt_datasets, Blend, GPTDatasetConfig};
///
/// let words: Vec<String> = ["0.3", "a_text_document", "0.7", "b_text_document"]
///     .map(String::from).into();
/// let blend = Blend::parse(&words).unwrap();
/// let config = GPTDatasetConfig::new(1024).with_split("969,30,1".into());
/// let [train, valid, _test] =
///     build_gpt_datasets(&blend, &config, [Some(1000), Some(100), Some(10)]).unwrap();
/// let first = train.unwrap().sample(0).unwrap(); // 1025 tokens
/// ```
pub fn build_gpt_datasets(
    blend: &Blend,
    config: &GPTDatasetConfig,
    sizes: [Option<usize>; 3],
) -> Result<[Option<MegatronSplit>; 3], DataError> {
    let matrix = split_matrix(&config.split)?;
    let weights = blend.weights.as_deref().map(normalize);
    if let Some(w) = &weights
        && w.len() != blend.prefixes.len()
    {
        return Err(DataError::Config("one weight per prefix".into()));
    }
    let low_level = blend
        .prefixes
        .iter()
        .map(|p| open_shared(p))
        .collect::<Result<Vec<_>, _>>()?;
    let build_one =
        |d: usize, i: usize, size: Option<usize>| -> Result<Option<Arc<GPTDataset>>, DataError> {
            let Some(bounds) = matrix[i] else {
                return Ok(None);
            };
            let range = split_range(bounds, low_level[d].len());
            // A proportion too small to hold a document leaves the split empty (Megatron-Core
            // 0.16 would loop forever counting epochs of zero tokens).
            if range.is_empty() && blend.weights.is_none() {
                return Ok(None);
            }
            GPTDataset::build(low_level[d].clone(), range, size, Split::ALL[i], config)
                .map(|g| Some(Arc::new(g)))
        };
    let mut out: [Option<MegatronSplit>; 3] = [None, None, None];
    let Some(weights) = weights else {
        if blend.prefixes.len() != 1 {
            return Err(DataError::Config(
                "several prefixes need weights (W1 P1 W2 P2 …)".into(),
            ));
        }
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = build_one(0, i, sizes[i])?.map(MegatronSplit::Single);
        }
        return Ok(out);
    };
    for (i, slot) in out.iter_mut().enumerate() {
        if matrix[i].is_none() {
            continue;
        }
        let Some(size) = sizes[i] else {
            return Err(DataError::Config(
                "weighted blends need each split's number of samples".into(),
            ));
        };
        let target = size_per_dataset(&weights, size, 0.0);
        let buffer = size_per_dataset(&weights, size, config.mid_level_dataset_surplus);
        let datasets = (0..blend.prefixes.len())
            .map(|d| {
                build_one(d, i, Some(buffer[d]))?
                    .ok_or_else(|| DataError::Config("a split of zero width".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let blended = BlendedDataset::new(datasets, &weights, target.iter().sum())?;
        *slot = Some(MegatronSplit::Blended(Arc::new(blended)));
    }
    Ok(out)
}
