//! BERT pretraining with tensor and data parallelism, Megatron's flags.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example bert_pretrain
//! cargo run --release -p burn-megatron-examples --example bert_pretrain -- --help
//! ```
//!
//! The loop itself is `train_minimal`'s (`examples/examples/train_minimal.rs`, one screen)
//! with every flag: read that first. Here it lives in `examples/src/pretrain/train.rs`.

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
