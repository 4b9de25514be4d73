//! BERT pretraining samples: sentence pairs with a sentence-order label, 15 % of tokens
//! masked (80 % `[MASK]`, 10 % random, 10 % kept), padded to the sequence length.
//!
//! Every sample is a pure function of (seed, global sample index), and every global batch
//! is a fixed range of sample indices that data-parallel ranks split into disjoint
//! contiguous shards — so a run sees the same global batch at every parallel layout.

use super::{BertTokenizer, DataError, Document};
use burn::config::Config;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use rand::rngs::ChaCha8Rng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::sync::Mutex;

/// How samples are built.
#[derive(Config, Debug)]
pub struct BertDatasetConfig {
    /// Tokens per sample, `[CLS]` and both `[SEP]` included.
    pub seq_length: usize,
    /// Fraction of tokens predicted.
    #[config(default = 0.15)]
    pub masked_lm_prob: f64,
    /// Probability of a sample shorter than `seq_length` (as Megatron and BERT).
    #[config(default = 0.1)]
    pub short_seq_prob: f64,
    /// Seed of segmentation, shuffling and masking.
    #[config(default = 1234)]
    pub seed: u64,
}

/// One sample, host-side.
#[derive(Debug, Clone, PartialEq)]
pub struct BertSample {
    /// Token ids.
    pub ids: Vec<i64>,
    /// Segment ids: 0 for the first sentence span, 1 for the second.
    pub types: Vec<i64>,
    /// True at padded positions.
    pub padding: Vec<bool>,
    /// The original token where a position is predicted, 0 elsewhere.
    pub labels: Vec<i64>,
    /// 1 where a position is predicted.
    pub loss_mask: Vec<f32>,
    /// Sentence-order label: 1 when the two spans were swapped.
    pub is_random: i64,
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    doc: usize,
    start: usize,
    end: usize,
}

/// Sentence-pair samples over a tokenized corpus.
#[derive(Debug)]
pub struct BertDataset {
    docs: Vec<Vec<Vec<u32>>>,
    segments: Vec<Segment>,
    config: BertDatasetConfig,
    special: [u32; 4],
    cls_sep_mask: [u32; 3],
    vocab_size: usize,
    epoch_order: Mutex<(usize, Vec<usize>)>,
}

/// An independent stream per (seed, purpose, index): SplitMix64 finalisers over the three.
fn rng_for(seed: u64, stream: u64, index: u64) -> ChaCha8Rng {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    ChaCha8Rng::seed_from_u64(mix(mix(mix(seed) ^ stream) ^ index))
}

impl BertDataset {
    /// Tokenizes `docs` and cuts them into segments of at least two sentences.
    pub fn new(
        docs: &[Document],
        tokenizer: &BertTokenizer,
        config: BertDatasetConfig,
    ) -> Result<Self, DataError> {
        let docs = docs
            .iter()
            .map(|d| d.iter().map(|s| tokenizer.encode(s)).collect())
            .collect::<Result<Vec<Vec<Vec<u32>>>, _>>()?;
        Self::from_token_documents(docs, tokenizer, config)
    }

    /// Segments over already tokenized documents (sentences of token ids, e.g. Megatron's
    /// BERT-format indexed datasets: sentences as sequences, documents as documents).
    pub fn from_token_documents(
        docs: Vec<Vec<Vec<u32>>>,
        tokenizer: &BertTokenizer,
        config: BertDatasetConfig,
    ) -> Result<Self, DataError> {
        if config.seq_length < 8 {
            return Err(DataError::Config(format!(
                "seq_length {} is too short for a sentence pair (at least 8)",
                config.seq_length
            )));
        }
        let vocab = tokenizer.vocab_size();
        if let Some(t) = docs
            .iter()
            .flatten()
            .flatten()
            .find(|&&t| t as usize >= vocab)
        {
            return Err(DataError::Config(format!(
                "token id {t} is outside the tokenizer's {vocab} tokens: was the data made \
                 with another tokenizer?"
            )));
        }
        let max_tokens = config.seq_length - 3;
        let mut segments = Vec::new();
        for (doc, sentences) in docs.iter().enumerate() {
            let mut rng = rng_for(config.seed, 1, doc as u64);
            let target = |rng: &mut ChaCha8Rng| {
                if rng.random::<f64>() < config.short_seq_prob {
                    rng.random_range(2..=max_tokens)
                } else {
                    max_tokens
                }
            };
            let (mut start, mut len, mut goal) = (0, 0, target(&mut rng));
            for (i, s) in sentences.iter().enumerate() {
                len += s.len();
                let last = i + 1 == sentences.len();
                if (len >= goal || last) && i + 1 - start >= 2 {
                    segments.push(Segment {
                        doc,
                        start,
                        end: i + 1,
                    });
                    (start, len, goal) = (i + 1, 0, target(&mut rng));
                }
            }
        }
        if segments.is_empty() {
            return Err(DataError::Config(
                "the corpus has no document with two sentences".into(),
            ));
        }
        let special = [tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask];
        let vocab_size = tokenizer.vocab_size();
        // The 10 % random replacement draws until it meets an ordinary token.
        if (0..vocab_size as u32).all(|t| special.contains(&t)) {
            return Err(DataError::Config(format!(
                "the vocabulary's {vocab_size} tokens are all special ([PAD] [CLS] [SEP] [MASK]): \
                 no token to replace a masked one with"
            )));
        }
        Ok(Self {
            docs,
            segments,
            special,
            cls_sep_mask: [tokenizer.cls, tokenizer.sep, tokenizer.mask],
            vocab_size,
            epoch_order: Mutex::new((usize::MAX, Vec::new())),
            config,
        })
    }

    /// Segments per epoch.
    pub fn len(&self) -> usize {
        self.segments.len()
    }

    /// Whether there are no segments (never: [`BertDataset::new`] rejects that).
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    fn segment(&self, index: usize) -> Segment {
        let (epoch, pos) = (index / self.len(), index % self.len());
        let mut order = self.epoch_order.lock().unwrap_or_else(|e| e.into_inner());
        if order.0 != epoch {
            let mut perm: Vec<usize> = (0..self.len()).collect();
            perm.shuffle(&mut rng_for(self.config.seed, 2, epoch as u64));
            *order = (epoch, perm);
        }
        self.segments[order.1[pos]]
    }

    /// Sample `index` of the endless, epoch-shuffled stream.
    pub fn sample(&self, index: usize) -> BertSample {
        let seg = self.segment(index);
        let mut rng = rng_for(self.config.seed, 3, index as u64);
        let sentences = &self.docs[seg.doc][seg.start..seg.end];
        let split = rng.random_range(1..sentences.len());
        let mut a: Vec<u32> = sentences[..split].concat();
        let mut b: Vec<u32> = sentences[split..].concat();
        let is_random = rng.random::<bool>();
        if is_random {
            std::mem::swap(&mut a, &mut b);
        }
        // Trim the longer span, from a random end, until the pair fits.
        while a.len() + b.len() > self.config.seq_length - 3 {
            let longer = if a.len() > b.len() { &mut a } else { &mut b };
            if rng.random::<bool>() {
                longer.remove(0);
            } else {
                longer.pop();
            }
        }
        let [cls, sep, mask] = self.cls_sep_mask;
        let mut ids: Vec<u32> = Vec::with_capacity(self.config.seq_length);
        ids.push(cls);
        ids.extend(&a);
        ids.push(sep);
        let types_a = ids.len();
        ids.extend(&b);
        ids.push(sep);
        let used = ids.len();

        let mut candidates: Vec<usize> = (0..used)
            .filter(|&i| !self.special.contains(&ids[i]))
            .collect();
        candidates.shuffle(&mut rng);
        let predict = ((used as f64 * self.config.masked_lm_prob).round() as usize)
            .max(1)
            .min(candidates.len());
        let (mut labels, mut loss_mask) = (vec![0i64; used], vec![0f32; used]);
        for &i in &candidates[..predict] {
            labels[i] = i64::from(ids[i]);
            loss_mask[i] = 1.0;
            let r = rng.random::<f64>();
            if r < 0.8 {
                ids[i] = mask;
            } else if r >= 0.9 {
                ids[i] = loop {
                    let t = rng.random_range(0..self.vocab_size as u32);
                    if !self.special.contains(&t) {
                        break t;
                    }
                };
            }
        }
        let pad_to = |mut v: Vec<i64>, fill: i64| {
            v.resize(self.config.seq_length, fill);
            v
        };
        loss_mask.resize(self.config.seq_length, 0.0);
        BertSample {
            ids: pad_to(
                ids.iter().map(|&t| i64::from(t)).collect(),
                i64::from(self.special[0]),
            ),
            types: pad_to((0..used).map(|i| i64::from(i >= types_a)).collect(), 0),
            padding: (0..self.config.seq_length).map(|i| i >= used).collect(),
            labels: pad_to(labels, 0),
            loss_mask,
            is_random: i64::from(is_random),
        }
    }
}

/// A micro-batch as tensors, in the shapes [`crate::models::Bert`] takes.
#[derive(Debug, Clone)]
pub struct BertBatch {
    /// `[b, s]` token ids.
    pub ids: Tensor<2, Int>,
    /// `[b, s]` segment ids.
    pub types: Tensor<2, Int>,
    /// `[b, s]` true at padding.
    pub padding: Tensor<2, Bool>,
    /// `[b, s]` MLM labels.
    pub labels: Tensor<2, Int>,
    /// `[b, s]` 1 where predicted.
    pub loss_mask: Tensor<2>,
    /// `[b]` sentence-order labels.
    pub is_random: Tensor<1, Int>,
}

impl BertBatch {
    /// Stacks `samples` (all of one length) on `device`.
    pub fn new(samples: &[BertSample], device: &Device) -> Self {
        let (b, s) = (samples.len(), samples.first().map_or(0, |x| x.ids.len()));
        let ints = |f: fn(&BertSample) -> &Vec<i64>| {
            let v: Vec<i64> = samples.iter().flat_map(|x| f(x).iter().copied()).collect();
            Tensor::<2, Int>::from_data(TensorData::new(v, [b, s]), device)
        };
        let padding: Vec<bool> = samples.iter().flat_map(|x| x.padding.clone()).collect();
        let mask: Vec<f32> = samples.iter().flat_map(|x| x.loss_mask.clone()).collect();
        let is_random: Vec<i64> = samples.iter().map(|x| x.is_random).collect();
        Self {
            ids: ints(|x| &x.ids),
            types: ints(|x| &x.types),
            padding: Tensor::from_data(TensorData::new(padding, [b, s]), device),
            labels: ints(|x| &x.labels),
            loss_mask: Tensor::from_data(TensorData::new(mask, [b, s]), device),
            is_random: Tensor::from_data(TensorData::new(is_random, [b]), device),
        }
    }
}
