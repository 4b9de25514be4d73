//! GPT-family pretraining (GPT-2 or Llama style) with tensor, pipeline and data parallelism,
//! Megatron's `pretrain_gpt.py` flags.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example gpt_pretrain
//! cargo run --release -p burn-megatron-examples --example gpt_pretrain -- --help
//! ```
//!
//! The loop itself is `train_minimal`'s (`examples/examples/train_minimal.rs`, one screen)
//! with every flag: read that first. Here it lives in `examples/src/pretrain/train.rs`.

use burn_megatron_examples::pretrain::{GptArgs, run_gpt};
use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = GptArgs::parse();
    match run_gpt(&args) {
        Ok(_) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
