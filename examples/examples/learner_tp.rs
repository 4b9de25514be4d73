//! burn-train's `Learner` (its metrics, terminal UI and metric logs) training a GPT at
//! tensor parallel 2 × data parallel 2, each rank a thread with its own learner: what a
//! Burn user with a burn-train setup changes to train a model that outgrows a device.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example learner_tp -- \
//!     --world-size 4 --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 \
//!     --num-attention-heads 4 --seq-length 64 --micro-batch-size 4 --global-batch-size 16 \
//!     --train-iters 200 --eval-interval 50 --eval-iters 4 --renderer tui
//! ```
//!
//! Every `gpt_pretrain` flag applies (`--data-path` for Megatron data, `--save` for
//! checkpoints, `--bf16`, …); `--artifact-dir` is where burn-train writes its metric logs.

use burn_megatron_examples::pretrain::{GptArgs, LearnerOptions, run_gpt_learner};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "learner_tp", version)]
struct Cli {
    #[command(flatten)]
    gpt: GptArgs,
    #[command(flatten)]
    learner: LearnerOptions,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run_gpt_learner(&cli.gpt, &cli.learner) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
