//! Where a pretraining run's samples come from: the built-in generator, a corpus file, or
//! Megatron's indexed datasets (`--data-path PREFIX` or a weighted blend, `--split`,
//! `--data-cache-path`), with the number of samples per split Megatron asks for.

use super::args::TrainArgs;
use burn_megatron::data::megatron::{Blend, GPTDatasetConfig, MegatronSplit, PAD_TOKEN_ID};
use burn_megatron::data::megatron::{IndexedDataset, dataset_paths, split_matrix, split_range};
use burn_megatron::data::{GptCorpusDataset, GptSample};
use std::path::{Path, PathBuf};

/// What `--data-path` names.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// No `--data-path`: the procedural corpus.
    Synthetic,
    /// A `.jsonl` or text corpus, tokenized on the spot.
    Corpus(PathBuf),
    /// Megatron indexed datasets.
    Megatron(Blend),
}

fn is_dataset(prefix: &Path) -> bool {
    dataset_paths(prefix).0.is_file()
}

impl TrainArgs {
    /// Reads `--data-path`: one word that is a file is a corpus; otherwise Megatron
    /// prefixes (each with its `.idx` and `.bin`).
    pub fn data_source(&self) -> Result<DataSource, String> {
        let words = &self.data_path;
        match words.as_slice() {
            [] => return Ok(DataSource::Synthetic),
            [one] if Path::new(one).is_file() && !is_dataset(Path::new(one)) => {
                return Ok(DataSource::Corpus(PathBuf::from(one)));
            }
            _ => {}
        }
        let blend = Blend::parse(words).map_err(|e| e.to_string())?;
        for prefix in &blend.prefixes {
            let (idx, bin) = dataset_paths(prefix);
            if !idx.is_file() || !bin.is_file() {
                return Err(format!(
                    "--data-path {}: no such file (nor a Megatron dataset: {} and {})",
                    prefix.display(),
                    idx.display(),
                    bin.display()
                ));
            }
        }
        split_matrix(&self.split).map_err(|e| e.to_string())?;
        if self.vocab_file.is_none() && self.load.is_none() {
            return Err(
                "--data-path with Megatron datasets needs --tokenizer-model (or --vocab-file): \
                 the tokenizer the data was made with"
                    .into(),
            );
        }
        Ok(DataSource::Megatron(blend))
    }

    /// Megatron's samples per split for this run: `train_iters · global_batch`, and for
    /// validation and test what `--eval-interval`/`--eval-iters` will read (Megatron's
    /// `train_valid_test_num_samples`).
    pub fn megatron_sizes(&self) -> [Option<usize>; 3] {
        let g = self.global_batch_size;
        let evals = self
            .train_iters
            .checked_div(self.eval_interval)
            .map_or(0, |n| n + 1);
        [
            Some(self.train_iters * g),
            Some(evals * self.eval_iters * g),
            Some(self.eval_iters * g),
        ]
    }

    /// The sampling config of `--seq-length`, `--seed`, `--split`, `--data-cache-path`.
    pub fn megatron_config(&self) -> GPTDatasetConfig {
        GPTDatasetConfig::new(self.seq_length)
            .with_random_seed(self.seed)
            .with_split(self.split.clone())
            .with_path_to_cache(
                self.data_cache_path
                    .as_ref()
                    .map(|p| p.display().to_string()),
            )
    }
}

/// GPT samples of one split.
#[derive(Debug)]
pub enum GptData {
    /// Cut from a tokenized corpus.
    Stream(GptCorpusDataset),
    /// Megatron's, for a vocabulary of `vocab_size` tokens.
    Megatron {
        /// The split.
        data: MegatronSplit,
        /// Ids must be below this.
        vocab_size: usize,
    },
}

impl GptData {
    /// Samples available (a stream repeats its epoch; Megatron's hold the run's).
    pub fn len(&self) -> usize {
        match self {
            Self::Stream(d) => d.len(),
            Self::Megatron { data, .. } => data.len(),
        }
    }

    /// Sample `i`. A Megatron window's padding (past the end of the data) is input id 0
    /// and a negative label, which [`GptBatch`](burn_megatron::data::GptBatch) masks out
    /// of the loss, as Megatron's `GPTDataset` does.
    pub fn sample(&self, i: usize) -> Result<GptSample, String> {
        let (data, vocab_size) = match self {
            Self::Stream(d) => return Ok(d.sample(i)),
            Self::Megatron { data, vocab_size } => (data, vocab_size),
        };
        let window = data.sample(i).map_err(|e| e.to_string())?;
        if let Some(t) = window
            .iter()
            .find(|&&t| t >= *vocab_size as i64 || t < PAD_TOKEN_ID)
        {
            return Err(format!(
                "sample {i} holds token id {t}, outside the tokenizer's {vocab_size} tokens: \
                 was the data made with another tokenizer?"
            ));
        }
        let n = window.len() - 1;
        Ok(GptSample {
            ids: window[..n].iter().map(|&t| t.max(0)).collect(),
            labels: window[1..].to_vec(),
        })
    }
}

/// Documents of a Megatron dataset as token-id sentences, split by `--split` over documents
/// (as Megatron splits BERT data): train, validation.
pub fn megatron_documents(
    args: &TrainArgs,
    blend: &Blend,
) -> Result<[Vec<Vec<Vec<u32>>>; 2], String> {
    let matrix = split_matrix(&args.split).map_err(|e| e.to_string())?;
    let mut out = [Vec::new(), Vec::new()];
    for prefix in &blend.prefixes {
        let data = IndexedDataset::open(prefix).map_err(|e| e.to_string())?;
        for (split, docs) in out.iter_mut().enumerate() {
            let Some(bounds) = matrix[split] else {
                continue;
            };
            for d in split_range(bounds, data.num_documents()) {
                let sentences = data
                    .document(d)
                    .map(|s| {
                        let ids = data.get(s, 0, None).map_err(|e| e.to_string())?;
                        ids.into_iter()
                            .map(|t| {
                                u32::try_from(t)
                                    .map_err(|_| format!("{}: token id {t}", prefix.display()))
                            })
                            .collect::<Result<Vec<u32>, String>>()
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                docs.push(sentences);
            }
        }
    }
    Ok(out)
}
