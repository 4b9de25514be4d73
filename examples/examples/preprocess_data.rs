//! JSONL to Megatron's indexed dataset (after Megatron-LM's `tools/preprocess_data.py`).
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example preprocess_data -- \
//!     --input corpus.jsonl --json-keys text --tokenizer-model tokenizer.json \
//!     --output-prefix corpus --append-eod --workers 2
//! # writes corpus_text_document.bin / corpus_text_document.idx
//! ```

use burn_megatron_examples::preprocess::{PreprocessArgs, preprocess};
use clap::Parser;

fn main() {
    let args = PreprocessArgs::parse();
    match preprocess(&args) {
        Ok(written) => {
            for w in written {
                println!(
                    "> {}: {} documents, {} tokens ({}.bin / .idx)",
                    w.key, w.documents, w.tokens, w.prefix
                );
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
