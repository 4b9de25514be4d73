//! What a run will read from Megatron datasets.
//!
//! ```text
//! dataset samples --data-path 0.3 a_text_document 0.7 b_text_document --seq-length 1024 \
//!     --seed 1234 --split 969,30,1 --train-samples 1000 --valid-samples 100 --json
//! dataset stats --data-path corpus_text_document --seq-length 1024 --train-samples 100000
//! ```

use burn_megatron_examples::dataset_tool::{DatasetCli, DatasetCommand, samples, stats};
use clap::Parser;

fn main() {
    let cli = DatasetCli::parse();
    let out = match &cli.command {
        DatasetCommand::Samples(a) => samples(a),
        DatasetCommand::Stats(a) => stats(a),
    };
    match out {
        Ok(text) => println!("{}", text.trim_end()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
