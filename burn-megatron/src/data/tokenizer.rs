//! BERT's WordPiece tokenizer through the Hugging Face `tokenizers` crate: loaded from a
//! `vocab.txt` or `tokenizer.json`, or trained on the corpus.

use super::{DataError, Document};
use std::path::Path;
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainer};
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::{AddedToken, Tokenizer};

/// BERT's special tokens, in the order a trained vocabulary gives them ids 0–4.
pub const SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// A WordPiece tokenizer with the ids of BERT's special tokens.
#[derive(Debug, Clone)]
pub struct BertTokenizer {
    inner: Tokenizer,
    /// `[PAD]`.
    pub pad: u32,
    /// `[CLS]`.
    pub cls: u32,
    /// `[SEP]`.
    pub sep: u32,
    /// `[MASK]`.
    pub mask: u32,
}

fn tok_err(path: &str) -> impl Fn(tokenizers::Error) -> DataError + '_ {
    move |e| DataError::Tokenizer(format!("{path}: {e}"))
}

impl BertTokenizer {
    fn from_tokenizer(inner: Tokenizer, source: &str) -> Result<Self, DataError> {
        let id = |t: &str| {
            inner.token_to_id(t).ok_or_else(|| {
                DataError::Tokenizer(format!("{source}: the vocabulary has no {t} token"))
            })
        };
        Ok(Self {
            pad: id("[PAD]")?,
            cls: id("[CLS]")?,
            sep: id("[SEP]")?,
            mask: id("[MASK]")?,
            inner,
        })
    }

    fn bert(model: WordPiece) -> Tokenizer {
        let mut tokenizer = Tokenizer::new(model);
        tokenizer
            .with_normalizer(Some(BertNormalizer::default()))
            .expect("BertNormalizer is a valid normalizer");
        tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
        tokenizer.with_decoder(Some(WordPieceDecoder::default()));
        tokenizer
    }

    /// Loads a `tokenizer.json` (any Hugging Face tokenizer) or a BERT `vocab.txt`
    /// (lower-casing BERT normaliser and pre-tokeniser).
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let name = path.display().to_string();
        if !path.is_file() {
            return Err(DataError::Io {
                path: name,
                message: "no such file".into(),
            });
        }
        let inner = if path.extension().is_some_and(|e| e == "json") {
            Tokenizer::from_file(path).map_err(tok_err(&name))?
        } else {
            let model = WordPiece::from_file(&name)
                .unk_token("[UNK]".into())
                .build()
                .map_err(tok_err(&name))?;
            Self::bert(model)
        };
        Self::from_tokenizer(inner, &name)
    }

    /// A WordPiece tokenizer over exactly `tokens` (after the special tokens, in the order
    /// given, duplicates dropped).
    pub fn from_vocab(tokens: impl IntoIterator<Item = String>) -> Result<Self, DataError> {
        let mut vocab = ahash::AHashMap::new();
        for t in SPECIAL_TOKENS.iter().map(|t| t.to_string()).chain(tokens) {
            let next = vocab.len() as u32;
            vocab.entry(t).or_insert(next);
        }
        let model = WordPiece::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .map_err(tok_err("vocabulary"))?;
        Self::from_tokenizer(Self::bert(model), "vocabulary")
    }

    /// Trains a WordPiece vocabulary of at most `vocab_size` tokens on `docs`.
    ///
    /// Ids are renumbered canonically (special tokens, then string order), but which
    /// sub-words the trainer keeps can differ between processes when merge counts tie: save
    /// the result ([`BertTokenizer::save`]) and reload it to reproduce a run exactly.
    pub fn train(docs: &[Document], vocab_size: usize) -> Result<Self, DataError> {
        let model = WordPiece::builder()
            .unk_token("[UNK]".into())
            .build()
            .map_err(tok_err("training"))?;
        let mut tokenizer = Self::bert(model);
        let trainer = WordPieceTrainer::builder()
            .vocab_size(vocab_size)
            .show_progress(false)
            .special_tokens(
                SPECIAL_TOKENS
                    .iter()
                    .map(|t| AddedToken::from(*t, true))
                    .collect(),
            )
            .build();
        let mut trainer = TrainerWrapper::WordPieceTrainer(trainer);
        tokenizer
            .train(&mut trainer, docs.iter().flatten())
            .map_err(tok_err("training"))?;
        // The trainer numbers tokens in hash-map order, which changes from run to run:
        // renumber them (special tokens first, then in string order) so the same corpus
        // always gives the same ids.
        let mut tokens: Vec<String> = tokenizer.get_vocab(false).into_keys().collect();
        tokens.sort();
        Self::from_vocab(tokens)
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

    /// The ids of `text` without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err("encode"))?
            .get_ids()
            .to_vec())
    }

    /// The text of `ids` (WordPiece pieces joined).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner.decode(ids, true).map_err(tok_err("decode"))
    }

    /// Whether `id` is one of BERT's special tokens (never masked).
    pub fn is_special(&self, id: u32) -> bool {
        [self.pad, self.cls, self.sep, self.mask].contains(&id)
    }
}

#[cfg(test)]
mod tests;
