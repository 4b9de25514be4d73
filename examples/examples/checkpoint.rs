//! Inspect a training checkpoint, or convert it to Hugging Face's `BertForPreTraining`.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example checkpoint -- inspect ckpt
//! cargo run --release -p burn-megatron-examples --example checkpoint -- to-hf ckpt hf-bert
//! ```
//!
//! Checkpoints of any layout (TP, PP, DP, the distributed optimizer) are read.

use burn_megatron_examples::checkpoint_tool::{inspect, to_hf};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Inspect or convert a burn-megatron training checkpoint")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the layout saved at, the training state and every tensor's global shape.
    Inspect {
        /// The checkpoint root (`--save` of bert_pretrain).
        root: PathBuf,
        /// The iteration (default: the latest).
        #[arg(long)]
        iteration: Option<usize>,
    },
    /// Write a Hugging Face `BertForPreTraining` directory (config.json, model.safetensors).
    ToHf {
        /// The checkpoint root.
        root: PathBuf,
        /// The output directory.
        out: PathBuf,
        /// The iteration (default: the latest).
        #[arg(long)]
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
        } => to_hf(&root, iteration, &out)
            .map(|()| println!("wrote {}/config.json and model.safetensors", out.display())),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
