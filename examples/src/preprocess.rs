//! `preprocess_data`: JSONL to Megatron's indexed dataset, after Megatron-LM's
//! `tools/preprocess_data.py`. Each line is a JSON object; each `--json-keys` key holds a
//! document (a string, or a list of strings taken as its sentences). A document's
//! sentences become sequences (one sequence per document unless `--split-sentences`),
//! `--append-eod` adds the end-of-document token to its last one, and empty sentences are
//! dropped, as Megatron's encoder does. Output: `PREFIX_KEY_document.bin/.idx`
//! (`_sentence` with `--split-sentences`), tokens as `uint16` below 65 500 tokens of
//! vocabulary, `int32` above.

use burn_megatron::data::megatron::{IndexedDatasetBuilder, TokenDType};
use burn_megatron::data::{BertTokenizer, GptTokenizer};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use std::io::{BufRead, BufReader, Seek};
use std::path::PathBuf;

/// Megatron's tokenizer kinds that `preprocess_data` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenizerType {
    /// A Hugging Face `tokenizer.json` with an end-of-document token (GPT-2, Llama, …), or
    /// Meta's Llama 3 `tokenizer.model` (tiktoken's format).
    #[value(name = "HuggingFaceTokenizer")]
    HuggingFace,
    /// BERT's WordPiece (`vocab.txt` or `tokenizer.json`), lower-cased.
    #[value(name = "BertWordPieceLowerCase")]
    BertWordPiece,
}

/// Tokenize a JSONL corpus into Megatron's `.bin`/`.idx` format.
#[derive(Debug, Clone, Parser)]
#[command(name = "preprocess_data", version)]
pub struct PreprocessArgs {
    /// The JSONL input.
    #[arg(long)]
    pub input: PathBuf,
    /// The keys of each JSON object to tokenize; one dataset per key.
    #[arg(long, num_args = 1.., default_value = "text")]
    pub json_keys: Vec<String>,
    /// The tokenizer file.
    #[arg(long, visible_alias = "vocab-file")]
    pub tokenizer_model: PathBuf,
    /// How to read `--tokenizer-model`.
    #[arg(long, value_enum, default_value = "HuggingFaceTokenizer")]
    pub tokenizer_type: TokenizerType,
    /// Output path prefix.
    #[arg(long)]
    pub output_prefix: String,
    /// Append the end-of-document token to each document.
    #[arg(long)]
    pub append_eod: bool,
    /// One sequence per sentence (split after `.`, `!` or `?` followed by whitespace: a
    /// simpler rule than Megatron's NLTK punkt), for BERT data.
    #[arg(long)]
    pub split_sentences: bool,
    /// Tokenizing threads.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
}

enum Tokenizer {
    Gpt(GptTokenizer),
    Bert(BertTokenizer),
}

impl Tokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Self::Gpt(t) => t.encode(text),
            Self::Bert(t) => t.encode(text),
        }
        .map_err(|e| e.to_string())
    }
}

fn sentences(text: &str, split: bool) -> Vec<&str> {
    if !split {
        return vec![text];
    }
    let mut out = Vec::new();
    let mut start = 0;
    let bytes = text.as_bytes();
    for i in 0..bytes.len().saturating_sub(1) {
        if matches!(bytes[i], b'.' | b'!' | b'?') && bytes[i + 1].is_ascii_whitespace() {
            out.push(text[start..=i].trim());
            start = i + 1;
        }
    }
    out.push(text[start..].trim());
    out.retain(|s| !s.is_empty());
    out
}

/// What one run wrote, per key.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    /// The key.
    pub key: String,
    /// The dataset prefix.
    pub prefix: String,
    /// Documents.
    pub documents: usize,
    /// Tokens.
    pub tokens: u64,
}

/// Runs `preprocess_data`.
pub fn preprocess(args: &PreprocessArgs) -> Result<Vec<Written>, String> {
    let (tokenizer, vocab_size, eod) = match args.tokenizer_type {
        TokenizerType::HuggingFace => {
            let t = GptTokenizer::from_file(&args.tokenizer_model).map_err(|e| e.to_string())?;
            let (v, eod) = (t.vocab_size(), Some(t.eod));
            (Tokenizer::Gpt(t), v, eod)
        }
        TokenizerType::BertWordPiece => {
            let t = BertTokenizer::from_file(&args.tokenizer_model).map_err(|e| e.to_string())?;
            let v = t.vocab_size();
            (Tokenizer::Bert(t), v, None)
        }
    };
    let eod = match (args.append_eod, eod) {
        (true, None) => {
            return Err("--append-eod: this tokenizer has no end-of-document token".into());
        }
        (true, Some(e)) => Some(e),
        (false, _) => None,
    };
    if args.workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.workers)
        .build()
        .map_err(|e| e.to_string())?;
    let input = std::fs::File::open(&args.input)
        .map_err(|e| format!("--input {}: {e}", args.input.display()))?;
    let total = input.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = BufReader::new(input);
    let level = if args.split_sentences {
        "sentence"
    } else {
        "document"
    };
    let dtype = TokenDType::optimal(vocab_size);
    let mut outputs = Vec::new();
    for key in &args.json_keys {
        let prefix = format!("{}_{key}_{level}", args.output_prefix);
        let builder = IndexedDatasetBuilder::new(&prefix, dtype).map_err(|e| e.to_string())?;
        outputs.push((
            builder,
            Written {
                key: key.clone(),
                prefix,
                documents: 0,
                tokens: 0,
            },
        ));
    }
    let bar = if args.quiet {
        ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden())
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .map_err(|e| e.to_string())?,
    );
    let mut line_no = 0usize;
    loop {
        let mut lines = Vec::new();
        for line in (&mut reader).lines().take(4096) {
            line_no += 1;
            lines.push((
                line_no,
                line.map_err(|e| format!("--input line {line_no}: {e}"))?,
            ));
        }
        if lines.is_empty() {
            break;
        }
        // Each line: per key, the document's sentences as token ids.
        let encoded: Vec<Vec<Vec<Vec<u32>>>> = pool.install(|| {
            lines
                .par_iter()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(n, line)| {
                    encode_line(
                        *n,
                        line,
                        &args.json_keys,
                        &tokenizer,
                        args.split_sentences,
                        eod,
                    )
                })
                .collect::<Result<_, String>>()
        })?;
        for doc in encoded {
            for ((builder, written), sentences) in outputs.iter_mut().zip(doc) {
                for s in &sentences {
                    let ids: Vec<i64> = s.iter().map(|&t| i64::from(t)).collect();
                    builder.add_item(&ids).map_err(|e| e.to_string())?;
                    written.tokens += ids.len() as u64;
                }
                builder.end_document();
                written.documents += 1;
            }
        }
        bar.set_position(reader.stream_position().unwrap_or(total));
    }
    bar.finish_and_clear();
    let mut done = Vec::new();
    for (builder, written) in outputs {
        builder.finalize().map_err(|e| e.to_string())?;
        done.push(written);
    }
    Ok(done)
}

fn encode_line(
    n: usize,
    line: &str,
    keys: &[String],
    tokenizer: &Tokenizer,
    split: bool,
    eod: Option<u32>,
) -> Result<Vec<Vec<Vec<u32>>>, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("--input line {n}: {e}"))?;
    keys.iter()
        .map(|key| {
            let texts: Vec<&str> = match &value[key] {
                serde_json::Value::String(s) => sentences(s, split),
                serde_json::Value::Array(items) => items
                    .iter()
                    .map(|s| {
                        s.as_str()
                            .ok_or_else(|| format!("--input line {n}: {key:?} holds a non-string"))
                    })
                    .collect::<Result<_, _>>()?,
                _ => return Err(format!("--input line {n}: no string or list under {key:?}")),
            };
            let mut doc: Vec<Vec<u32>> = texts
                .iter()
                .map(|t| tokenizer.encode(t))
                .collect::<Result<Vec<_>, _>>()?;
            doc.retain(|s| !s.is_empty());
            if let (Some(e), Some(last)) = (eod, doc.last_mut()) {
                last.push(e);
            }
            Ok(doc)
        })
        .collect()
}
