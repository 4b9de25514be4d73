//! BERT pretraining with tensor and data parallelism, Megatron's flags.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example bert_pretrain
//! cargo run --release -p burn-megatron-examples --example bert_pretrain -- --help
//! ```

use burn_megatron_examples::pretrain::{Args, run};
use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(_) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
