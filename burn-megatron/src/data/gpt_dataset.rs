//! GPT pretraining data: a byte-level BPE tokenizer (trained on the corpus, any Hugging Face
//! `tokenizer.json`, or a tiktoken file such as Meta's Llama 3 `tokenizer.model`), and
//! causal-LM samples cut from the documents concatenated with an end-of-document token
//! between them, as Megatron's GPT dataset does.
//!
//! Sample `i` of the epoch is the `seq_length + 1` tokens of window `order[i]`, `order` a
//! seeded shuffle of the windows: the inputs are its first `seq_length` tokens, the labels
//! its last `seq_length` (each position's next token). A run therefore sees the same samples
//! at every parallel layout ([`BatchLayout`](super::BatchLayout) splits each global batch).
//! Megatron's exact document/sample index (its `.bin/.idx` files and `numpy` shuffles) is a
//! separate reader.

use super::{DataError, Document};
use burn::config::Config;
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand::seq::SliceRandom;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The end-of-document token of a trained tokenizer (GPT-2's).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// End-of-document tokens looked for in a loaded `tokenizer.json`, in order: GPT-2's,
/// Llama 3's, Llama 2's / Mistral's, Gemma's.
const EOD_CANDIDATES: [&str; 4] = [END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>"];

/// A file's bytes, and its name for errors.
fn read(path: &Path) -> Result<(Vec<u8>, String), DataError> {
    let name = path.display().to_string();
    let bytes = match path.is_file() {
        true => std::fs::read(path).map_err(|e| e.to_string()),
        false => Err("no such file".to_string()),
    };
    bytes
        .map(|b| (b, name.clone()))
        .map_err(|message| DataError::Io {
            path: name,
            message,
        })
}

/// A byte-level tokenizer with its end-of-document id.
#[derive(Debug, Clone)]
pub struct GptTokenizer {
    inner: Tokenizer,
    /// The end-of-document token.
    pub eod: u32,
}

fn tok_err(what: &str) -> impl Fn(tokenizers::Error) -> DataError + '_ {
    move |e| DataError::Tokenizer(format!("{what}: {e}"))
}

impl GptTokenizer {
    /// Loads a Hugging Face `tokenizer.json`; a tiktoken BPE file, read as Meta's Llama 3
    /// `tokenizer.model` (its pattern [`LLAMA3_PATTERN`], its 256
    /// [`llama3_special_tokens`] after the ranks); or a SentencePiece BPE model, Llama 2's
    /// `tokenizer.model` (as the Hugging Face BPE that encodes as SentencePiece does; unigram
    /// models are refused). The end-of-document token is the first of `<|endoftext|>`,
    /// `<|end_of_text|>`, `</s>`, `<eos>` the tokenizer has.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let (bytes, name) = read(path)?;
        if tiktoken::looks_like_tiktoken(&bytes) {
            let specials = llama3_special_tokens();
            let inner = tiktoken::tokenizer(&bytes, &name, LLAMA3_PATTERN, &specials)?;
            return Self::with_eod(inner, &name);
        }
        let json = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        if !json && sentencepiece::looks_like_sentencepiece(&bytes) {
            return Self::with_eod(sentencepiece::tokenizer(&bytes, &name)?, &name);
        }
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| {
            DataError::Tokenizer(format!(
                "{name}: neither a tokenizer.json ({e}), nor a tiktoken BPE file (Llama 3's \
                 tokenizer.model), nor a SentencePiece model (Llama 2's)"
            ))
        })?;
        Self::with_eod(inner, &name)
    }

    /// Loads a tiktoken BPE file (each line a token's bytes in base64 and its rank), splitting
    /// text by the regular expression `pattern`, with `special_tokens` numbered from the
    /// first id after the ranks, as Meta's Llama 3 tokenizer numbers its own. The pattern must
    /// match all of any text (Llama 3's does): tiktoken drops what it does not match, a
    /// Hugging Face tokenizer keeps it.
    ///
    /// The result is the Hugging Face byte-level BPE that encodes as tiktoken does
    /// (`transformers` converts these files so); [`save`](Self::save) writes it as a
    /// `tokenizer.json`. Special tokens in the text are encoded as themselves.
    ///
    /// ```no_run
    /// use burn_megatron::data::{GptTokenizer, LLAMA3_PATTERN, llama3_special_tokens};
    /// # fn main() -> Result<(), burn_megatron::data::DataError> {
    /// // What `from_file` does with Meta's Llama 3 `tokenizer.model`.
    /// let path = std::path::Path::new("Llama3.2-1B/tokenizer.model");
    /// let tokenizer = GptTokenizer::from_tiktoken(path, LLAMA3_PATTERN, &llama3_special_tokens())?;
    /// assert_eq!(tokenizer.token_id("<|begin_of_text|>"), Some(128000));
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_tiktoken(
        path: &Path,
        pattern: &str,
        special_tokens: &[String],
    ) -> Result<Self, DataError> {
        let (bytes, name) = read(path)?;
        let inner = tiktoken::tokenizer(&bytes, &name, pattern, special_tokens)?;
        Self::with_eod(inner, &name)
    }

    fn with_eod(inner: Tokenizer, name: &str) -> Result<Self, DataError> {
        let eod = EOD_CANDIDATES
            .iter()
            .find_map(|t| inner.token_to_id(t))
            .ok_or_else(|| {
                DataError::Tokenizer(format!(
                    "{name}: no end-of-document token (one of {EOD_CANDIDATES:?})"
                ))
            })?;
        Ok(Self { inner, eod })
    }

    /// Trains a byte-level BPE of at most `vocab_size` tokens (the 256 bytes and
    /// `<|endoftext|>` included) on `docs`. Training is deterministic: the same corpus gives
    /// the same tokenizer in every process.
    pub fn train(docs: &[Document], vocab_size: usize) -> Result<Self, DataError> {
        let mut tokenizer = Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        let trainer = BpeTrainer::builder()
            .vocab_size(vocab_size)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
            .build();
        let mut trainer = TrainerWrapper::BpeTrainer(trainer);
        let texts = docs.iter().map(|d| d.join(" "));
        tokenizer
            .train(&mut trainer, texts)
            .map_err(tok_err("training"))?;
        let eod = tokenizer
            .token_to_id(END_OF_TEXT)
            .ok_or_else(|| DataError::Tokenizer("training lost <|endoftext|>".into()))?;
        Ok(Self {
            inner: tokenizer,
            eod,
        })
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<(), DataError> {
        let name = path.display().to_string();
        self.inner.save(path, false).map_err(tok_err(&name))
    }

    /// The vocabulary size (special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token`, if the tokenizer has it: a special token such as
    /// `<|begin_of_text|>`, or a token of the vocabulary as the vocabulary writes it (a
    /// byte-level BPE's ` the` is `Ġthe`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The ids of `text`. A special token's text in it (`<|end_of_text|>`) is that token, as
    /// in a Hugging Face tokenizer; none is added (no beginning-of-sequence id).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err("encode"))?
            .get_ids()
            .to_vec())
    }

    /// The text of `ids`, special tokens dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner.decode(ids, true).map_err(tok_err("decode"))
    }
}

/// How samples are cut.
#[derive(Config, Debug)]
pub struct GptCorpusDatasetConfig {
    /// Input tokens per sample (each sample holds one more, for the last label).
    pub seq_length: usize,
    /// Seed of the shuffle.
    #[config(default = 1234)]
    pub seed: u64,
}

/// Causal-LM samples over a tokenized corpus.
#[derive(Debug)]
pub struct GptCorpusDataset {
    tokens: Vec<u32>,
    order: Vec<usize>,
    seq_length: usize,
}

/// One sample, host-side.
#[derive(Debug, Clone, PartialEq)]
pub struct GptSample {
    /// `seq_length` input ids.
    pub ids: Vec<i64>,
    /// The next token of each position.
    pub labels: Vec<i64>,
}

impl GptCorpusDataset {
    /// Tokenizes `docs` (sentences joined by spaces), concatenates them with `eod` after
    /// each, and cuts non-overlapping windows of `seq_length + 1` tokens.
    pub fn new(
        docs: &[Document],
        tokenizer: &GptTokenizer,
        config: GptCorpusDatasetConfig,
    ) -> Result<Self, DataError> {
        let mut tokens = Vec::new();
        for d in docs {
            tokens.extend(tokenizer.encode(&d.join(" "))?);
            tokens.push(tokenizer.eod);
        }
        Self::from_tokens(tokens, config)
    }

    /// Samples over an already tokenized stream.
    pub fn from_tokens(
        tokens: Vec<u32>,
        config: GptCorpusDatasetConfig,
    ) -> Result<Self, DataError> {
        let s = config.seq_length;
        if s == 0 {
            return Err(DataError::Config("seq_length must be at least 1".into()));
        }
        let windows = tokens.len().saturating_sub(1) / s;
        if windows == 0 {
            return Err(DataError::Config(format!(
                "{} tokens make no sample of {} (seq_length + 1)",
                tokens.len(),
                s + 1
            )));
        }
        let mut order: Vec<usize> = (0..windows).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(config.seed));
        Ok(Self {
            tokens,
            order,
            seq_length: s,
        })
    }

    /// Samples per epoch.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether there are none (never: construction refuses that).
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Tokens in the stream.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Global sample `index` (epochs repeat the same order).
    pub fn sample(&self, index: usize) -> GptSample {
        let s = self.seq_length;
        let start = self.order[index % self.order.len()] * s;
        let window = &self.tokens[start..start + s + 1];
        GptSample {
            ids: window[..s].iter().map(|&t| i64::from(t)).collect(),
            labels: window[1..].iter().map(|&t| i64::from(t)).collect(),
        }
    }
}

/// A micro-batch as tensors, in the shapes [`crate::models::Gpt`] takes.
#[derive(Debug, Clone)]
pub struct GptBatch {
    /// `[b, s]` input ids.
    pub ids: Tensor<2, Int>,
    /// `[b, s]` next tokens.
    pub labels: Tensor<2, Int>,
    /// `[b, s]` 1 where the label counts, 0 where it is ignored.
    pub loss_mask: Tensor<2>,
}

impl GptBatch {
    /// Stacks `samples` (all of one length) on `device`. A negative label (padding past
    /// the end of the data, Megatron's `-1`) is ignored: its loss mask is 0 and its label 0.
    pub fn new(samples: &[GptSample], device: &Device) -> Self {
        let (b, s) = (samples.len(), samples.first().map_or(0, |x| x.ids.len()));
        let flat = |f: fn(&GptSample) -> &Vec<i64>| -> Vec<i64> {
            samples.iter().flat_map(|x| f(x).iter().copied()).collect()
        };
        let ints = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [b, s]), device);
        let labels = flat(|x| &x.labels);
        let mask: Vec<f32> = labels
            .iter()
            .map(|&l| f32::from(u8::from(l >= 0)))
            .collect();
        Self {
            ids: ints(flat(|x| &x.ids)),
            labels: ints(labels.into_iter().map(|l| l.max(0)).collect()),
            loss_mask: Tensor::from_data(TensorData::new(mask, [b, s]), device),
        }
    }
}

mod sentencepiece;
#[cfg(test)]
mod tests;
mod tiktoken;
pub use tiktoken::{LLAMA3_PATTERN, llama3_special_tokens};
