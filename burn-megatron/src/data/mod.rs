//! Pretraining data: a corpus (procedural by default, or a text / JSONL file); for BERT a
//! WordPiece tokenizer and sentence-pair samples with masking, for GPT a byte-level BPE and
//! causal-LM windows; and the split of each global batch over data-parallel ranks.
//! [`megatron`] reads Megatron-Core's own datasets and samples them as Megatron does.
//!
//! ```
//! use burn_megatron::data::*;
//!
//! let docs = synthetic_corpus(100, 1);
//! let tokenizer = BertTokenizer::from_vocab(synthetic_vocabulary()).unwrap();
//! let data = BertDataset::new(&docs, &tokenizer, BertDatasetConfig::new(32)).unwrap();
//! let layout = BatchLayout::new(8, 2, 2).unwrap(); // 2 micro-batches per DP rank
//! let rank1 = layout.micro_batch(0, 1, 0); // samples 4..6 of step 0
//! let sample = data.sample(rank1.start);
//! assert_eq!(sample.ids.len(), 32);
//! ```

mod batch;
mod bert_dataset;
mod corpus;
mod gpt_dataset;
pub mod megatron;
mod tokenizer;

pub use batch::BatchLayout;
pub use bert_dataset::{BertBatch, BertDataset, BertDatasetConfig, BertSample};
pub use corpus::{Document, load_corpus, synthetic_corpus, synthetic_vocabulary};
pub use gpt_dataset::{
    END_OF_TEXT, GptBatch, GptCorpusDataset, GptCorpusDatasetConfig, GptSample, GptTokenizer,
    LLAMA3_PATTERN, llama3_special_tokens,
};
pub use tokenizer::{BertTokenizer, SPECIAL_TOKENS};

/// Why data could not be prepared.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DataError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A file's content is not what was expected.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The tokenizer failed to load, train or encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Invalid sizes.
    #[error("{0}")]
    Config(String),
}

#[cfg(test)]
mod tests;
