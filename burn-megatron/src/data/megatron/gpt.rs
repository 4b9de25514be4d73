//! Megatron-Core's `GPTDataset`: one split of one indexed dataset, cut into samples of
//! `sequence_length + 1` tokens that run across document boundaries, in Megatron's order.
//!
//! Three indices, built exactly as `gpt_dataset.py` and `helpers.cpp` build them, from one
//! [`NumpyRandomState`] consumed in the same order:
//! - the **document index**: the split's documents repeated once per epoch and shuffled
//!   (the last epoch shuffled apart when it is used for less than 80 % of its samples);
//! - the **sample index**: where each sample starts (a position in the document index and a
//!   token offset), walking the documents in that order (`build_sample_idx`);
//! - the **shuffle index**: a permutation of the samples (again with the last epoch apart).

use super::cache::CacheEntry;
use super::indexed::IndexedDataset;
use super::numpy_rng::NumpyRandomState;
use super::{GPTDatasetConfig, Split};
use crate::data::DataError;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Megatron's `_PAD_TOKEN_ID`: fills a sample cut short at the end of the data.
pub const PAD_TOKEN_ID: i64 = -1;

/// One split of one indexed dataset, sampled as Megatron's `GPTDataset` samples it.
#[derive(Debug)]
pub struct GPTDataset {
    dataset: Arc<IndexedDataset>,
    split: Split,
    indices: Range<usize>,
    num_samples: Option<usize>,
    sequence_length: usize,
    extra: usize,
    num_epochs: usize,
    tokens_per_epoch: u64,
    document_index: Vec<i32>,
    sample_index: Vec<i64>,
    shuffle_index: Vec<i64>,
}

fn config_err(m: String) -> DataError {
    DataError::Config(m)
}

impl GPTDataset {
    /// Builds (or loads from the cache) the indices of `split`, whose documents are the
    /// sequences `indices` of `dataset`, with at least `num_samples` samples (all of one
    /// epoch if `None`).
    pub fn build(
        dataset: Arc<IndexedDataset>,
        indices: Range<usize>,
        num_samples: Option<usize>,
        split: Split,
        config: &GPTDatasetConfig,
    ) -> Result<Self, DataError> {
        let name = dataset.prefix().display().to_string();
        if indices.end > dataset.len() || indices.is_empty() {
            return Err(config_err(format!(
                "{name}: the {} split holds documents {indices:?} of {}; it needs at least one",
                split.name(),
                dataset.len()
            )));
        }
        let seed = u32::try_from(config.random_seed).map_err(|_| {
            config_err(format!(
                "seed {} is outside numpy's RandomState range 0..2^32",
                config.random_seed
            ))
        })?;
        if config.sequence_length < 2 {
            return Err(config_err("sequence_length must be at least 2".into()));
        }
        let tokens_per_epoch: u64 = indices
            .clone()
            .map(|i| dataset.sequence_length(i) as u64)
            .sum();
        let extra = usize::from(config.add_extra_token_to_sequence);
        if tokens_per_epoch <= extra as u64 + 1 {
            return Err(config_err(format!(
                "{name}: the {} split has {tokens_per_epoch} tokens, too few for one sample",
                split.name()
            )));
        }
        let seq = config.sequence_length as u64;
        let num_epochs = match num_samples {
            None => 1,
            Some(n) => (n as u64 * seq + extra as u64)
                .div_ceil(tokens_per_epoch)
                .max(1) as usize,
        };
        let mut data = Self {
            dataset,
            split,
            indices,
            num_samples,
            sequence_length: config.sequence_length,
            extra,
            num_epochs,
            tokens_per_epoch,
            document_index: Vec::new(),
            sample_index: Vec::new(),
            shuffle_index: Vec::new(),
        };
        let cache = data.cache_entry(config);
        if let Some(c) = cache.as_ref().filter(|c| c.hit())
            && data.load(c)
        {
            return Ok(data);
        }
        data.build_indices(seed, config)?;
        if let Some(c) = cache {
            c.store(
                "document_index",
                &data.document_index,
                &[data.document_index.len()],
            )?;
            c.store(
                "sample_index",
                &data.sample_index,
                &[data.sample_index.len() / 2, 2],
            )?;
            c.store(
                "shuffle_index",
                &data.shuffle_index,
                &[data.shuffle_index.len()],
            )?;
            c.commit()?;
        }
        Ok(data)
    }

    fn cache_entry(&self, config: &GPTDatasetConfig) -> Option<CacheEntry> {
        let dir = match &config.path_to_cache {
            Some(dir) => PathBuf::from(dir),
            // Megatron's default: beside the data, under the prefix.
            None => self
                .dataset
                .prefix()
                .join("cache")
                .join("GPTDataset_indices"),
        };
        let description = serde_json::json!({
            "class": "GPTDataset",
            "format": 1,
            "dataset_path": self.dataset.prefix().display().to_string(),
            "sequences": self.dataset.len(),
            "tokens_per_epoch": self.tokens_per_epoch,
            "num_samples": self.num_samples,
            "index_split": self.split.name(),
            "documents": [self.indices.start, self.indices.end],
            "random_seed": config.random_seed,
            "sequence_length": config.sequence_length,
            "split": config.split,
            "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
            "drop_last_partial_validation_sequence": config.drop_last_partial_validation_sequence,
        });
        Some(CacheEntry::new(
            &dir,
            "GPTDataset",
            self.split.name(),
            serde_json::to_string_pretty(&description).ok()?,
        ))
    }

    fn load(&mut self, cache: &CacheEntry) -> bool {
        let (Some((d, _)), Some((s, shape)), Some((sh, _))) = (
            cache.load::<i32>("document_index"),
            cache.load::<i64>("sample_index"),
            cache.load::<i64>("shuffle_index"),
        ) else {
            return false;
        };
        if shape.len() != 2 || shape[1] != 2 {
            return false;
        }
        (self.document_index, self.sample_index, self.shuffle_index) = (d, s, sh);
        true
    }

    fn build_indices(&mut self, seed: u32, config: &GPTDatasetConfig) -> Result<(), DataError> {
        let (seq, extra) = (self.sequence_length as i64, self.extra as i64);
        let (epochs, tokens) = (self.num_epochs as i64, self.tokens_per_epoch as i64);
        let mut separate_final_epoch = false;
        let mut samples_sans_final_epoch = 0;
        if let Some(n) = self.num_samples.filter(|_| epochs > 1) {
            samples_sans_final_epoch = ((epochs - 1) * tokens - extra) / seq;
            let from_final_epoch = n as i64 - samples_sans_final_epoch;
            let per_epoch = (tokens - extra) / seq;
            // Megatron's threshold: `int(0.80 * num_samples_per_epoch)`.
            separate_final_epoch = from_final_epoch < (0.80 * per_epoch as f64) as i64;
        }
        let mut rng = NumpyRandomState::new(seed);
        let documents: Vec<i32> = self.indices.clone().map(|i| i as i32).collect();
        let shuffled_epochs = |epochs: usize, rng: &mut NumpyRandomState| {
            let mut index: Vec<i32> = documents.repeat(epochs);
            rng.shuffle(&mut index);
            index
        };
        self.document_index = if separate_final_epoch {
            let mut first = shuffled_epochs(self.num_epochs - 1, &mut rng);
            first.extend(shuffled_epochs(1, &mut rng));
            first
        } else {
            shuffled_epochs(self.num_epochs, &mut rng)
        };
        let drop_last = self.split != Split::Valid || config.drop_last_partial_validation_sequence;
        self.sample_index = self.build_sample_index(drop_last)?;
        let total = self.sample_index.len() / 2 - 1;
        let first = if separate_final_epoch {
            samples_sans_final_epoch as usize
        } else {
            total
        };
        let mut shuffle: Vec<i64> = (0..first as i64).collect();
        rng.shuffle(&mut shuffle);
        let mut last: Vec<i64> = (first as i64..total as i64).collect();
        rng.shuffle(&mut last);
        shuffle.extend(last);
        self.shuffle_index = shuffle;
        Ok(())
    }

    /// `helpers.cpp`'s `build_sample_idx`, flattened to `[position, offset]` pairs.
    fn build_sample_index(&self, drop_last: bool) -> Result<Vec<i64>, DataError> {
        let (seq, extra) = (self.sequence_length as i64, self.extra as i64);
        let flat_tokens = self.num_epochs as i64 * self.tokens_per_epoch as i64 - extra;
        let num_samples = if drop_last {
            flat_tokens / seq
        } else {
            // `ceil(float(...) / seq_length)` in single precision, as the C++ computes it.
            (flat_tokens as f32 / seq as f32).ceil() as i64
        };
        let length = |position: usize| {
            self.dataset
                .sequence_length(self.document_index[position] as usize) as i64
        };
        let mut index = Vec::with_capacity(2 * (num_samples as usize + 1));
        let (mut position, mut offset) = (0usize, 0i64);
        index.extend([0, 0]);
        for _ in 0..num_samples {
            let mut remaining = seq + extra;
            while remaining != 0 {
                let document_length = length(position) - offset;
                remaining -= document_length;
                if remaining <= 0 {
                    offset += remaining + document_length - extra;
                    remaining = 0;
                } else if position == self.document_index.len() - 1 {
                    offset = length(position) - extra;
                    break;
                } else {
                    position += 1;
                    offset = 0;
                }
            }
            index.extend([position as i64, offset]);
        }
        Ok(index)
    }

    /// The sample count (Megatron's `len`): every sample of the epochs built, at least the
    /// number asked for.
    pub fn len(&self) -> usize {
        self.shuffle_index.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.shuffle_index.is_empty()
    }

    /// The split.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The underlying indexed dataset.
    pub fn indexed(&self) -> &IndexedDataset {
        &self.dataset
    }

    /// The split's documents (sequence indices of the indexed dataset).
    pub fn documents(&self) -> Range<usize> {
        self.indices.clone()
    }

    /// Epochs of the split the samples span.
    pub fn num_epochs(&self) -> usize {
        self.num_epochs
    }

    /// Tokens in one epoch of the split.
    pub fn tokens_per_epoch(&self) -> u64 {
        self.tokens_per_epoch
    }

    /// The document, sample and shuffle indices (the sample index as flat pairs).
    pub fn indices(&self) -> (&[i32], &[i64], &[i64]) {
        (
            &self.document_index,
            &self.sample_index,
            &self.shuffle_index,
        )
    }

    /// The `sequence_length + 1` tokens of sample `idx` (Megatron's
    /// `_query_document_sample_shuffle_indices`), padded with [`PAD_TOKEN_ID`] if the data
    /// ends first.
    pub fn sample(&self, idx: usize) -> Result<Vec<i64>, DataError> {
        let corrupt = |what: &str| DataError::Format {
            path: self.dataset.prefix().display().to_string(),
            message: format!(
                "the {} split's cached indices are inconsistent ({what} of sample {idx}); \
                     delete the cache to rebuild them",
                self.split.name()
            ),
        };
        let s = *self
            .shuffle_index
            .get(idx)
            .ok_or_else(|| config_err(format!("sample {idx} of {}", self.len())))?;
        let pair = |k: i64| -> Option<(usize, usize)> {
            let k = usize::try_from(k).ok()?;
            let p = self.sample_index.get(2 * k..2 * k + 2)?;
            Some((usize::try_from(p[0]).ok()?, usize::try_from(p[1]).ok()?))
        };
        let ((beg, beg_offset), (end, end_offset)) = pair(s)
            .zip(pair(s + 1))
            .ok_or_else(|| corrupt("sample index"))?;
        let document = |p: usize| -> Result<usize, DataError> {
            let d = *self
                .document_index
                .get(p)
                .ok_or_else(|| corrupt("document index"))?;
            usize::try_from(d)
                .ok()
                .filter(|d| self.indices.contains(d))
                .ok_or_else(|| corrupt("document"))
        };
        let mut tokens = Vec::with_capacity(self.sequence_length + self.extra);
        if beg > end {
            return Err(corrupt("sample bounds"));
        }
        for p in beg..=end {
            let offset = if p == beg { beg_offset } else { 0 };
            let length = if p < end {
                None
            } else {
                Some(
                    (end_offset + self.extra)
                        .checked_sub(offset)
                        .ok_or_else(|| corrupt("offsets"))?,
                )
            };
            self.dataset
                .get_into(document(p)?, offset, length, &mut tokens)?;
        }
        tokens.resize(self.sequence_length + self.extra, PAD_TOKEN_ID);
        Ok(tokens)
    }
}

/// Opens each prefix once (`Arc`ed: the splits share it).
pub(super) fn open_shared(prefix: &Path) -> Result<Arc<IndexedDataset>, DataError> {
    IndexedDataset::open(prefix).map(Arc::new)
}
