//! Inspect a training checkpoint, or convert it to a Hugging Face directory: a
//! `bert_pretrain` checkpoint to `BertForPreTraining`, a `gpt_pretrain` one to a causal LM
//! (`LlamaForCausalLM`, `Qwen2ForCausalLM` or `GPT2LMHeadModel`, whichever its shape is).
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example checkpoint -- inspect ckpt
//! cargo run --release -p burn-megatron-examples --example checkpoint -- to-hf ckpt hf-bert
//! cargo run --release -p burn-megatron-examples --example checkpoint -- to-hf gpt-ckpt hf-gpt
//! ```
//!
//! Checkpoints of any layout (TP, PP, DP, the distributed optimizer) are read.

use burn_megatron_examples::checkpoint_tool::{inspect, to_hf};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Inspect or convert a burn-megatron training checkpoint (BERT or GPT)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the layout saved at, the training state and every tensor's global shape.
    Inspect {
        /// The checkpoint root (`--save` of bert_pretrain or gpt_pretrain).
        root: PathBuf,
        /// The iteration (default: the latest); `--ckpt-step`, as in the pretraining
        /// examples and `generate`, is the same flag.
        #[arg(long, visible_alias = "ckpt-step")]
        iteration: Option<usize>,
    },
    /// Write a Hugging Face directory (config.json, model.safetensors) of a BERT or a GPT.
    ///
    /// From a bert_pretrain checkpoint, `BertForPreTraining`; from a gpt_pretrain one
    /// (gpt_config.json beside the iterations), `LlamaForCausalLM`, `Qwen2ForCausalLM` or
    /// `GPT2LMHeadModel`, whichever its shape is, with its tokenizer.json copied.
    ToHf {
        /// The checkpoint root (with bert_config.json or gpt_config.json and tokenizer.json).
        root: PathBuf,
        /// The output directory.
        out: PathBuf,
        /// The iteration (default: the latest); `--ckpt-step`, as in the pretraining
        /// examples and `generate`, is the same flag.
        #[arg(long, visible_alias = "ckpt-step")]
        iteration: Option<usize>,
    },
}

fn main() {
    let result = match Cli::parse().command {
        Command::Inspect { root, iteration } => {
            inspect(&root, iteration).map(|text| print!("{text}"))
        }
        Command::ToHf {
            root,
            out,
            iteration,
        } => to_hf(&root, iteration, &out).map(|architecture| {
            println!(
                "wrote {architecture}: {}/config.json and model.safetensors",
                out.display()
            )
        }),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
