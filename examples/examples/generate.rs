//! Text generation with a GPT-family model at any tensor- and pipeline-parallel size (ranks
//! as threads): a Hugging Face Llama / Mistral / Qwen2 / GPT-2 directory, or a `gpt_pretrain`
//! checkpoint.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example generate -- --load-hf hf-dir --prompt "The cat"
//! cargo run --release -p burn-megatron-examples --example generate -- --load ckpt --tensor-model-parallel-size 2
//! cargo run --release -p burn-megatron-examples --example generate -- --load-hf tests/fixtures/hf_llama_tiny --prompt-ids 1,2,3 --pipeline-model-parallel-size 2
//! ```
//!
//! A checkpoint (of any layout) loads straight into each rank's shard at the chosen TP and PP
//! sizes; with PP, each step's hidden states go through the stages and the last one draws.
//! Greedy unless `--temperature`, `--top-k` or `--top-p` is given.

use burn::module::Module;
use burn::tensor::Device;
use burn_megatron::data::GptTokenizer;
use burn_megatron::launch::{self, LaunchError, LaunchOptions};
use burn_megatron::models::{
    GenerateConfig, Gpt, HfGptConfig, generate_stages, load_hf_gpt_weights, read_hf_tensors,
};
use burn_megatron::tensor_parallel::Sampling;
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_examples::checkpoint_tool::{load_rank_stages, read_config, resolve_iteration};
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Generate text with a GPT-family model, split over tensor-parallel ranks.
#[derive(Parser)]
#[command(name = "generate")]
struct Cli {
    /// A Hugging Face Llama / Mistral / Qwen2 / GPT-2 directory (config.json, safetensors,
    /// tokenizer.json).
    #[arg(long, required_unless_present = "load", conflicts_with = "load")]
    load_hf: Option<PathBuf>,
    /// A `gpt_pretrain --save` directory (gpt_config.json, tokenizer.json, the checkpoints).
    #[arg(long)]
    load: Option<PathBuf>,
    /// With `--load`: the iteration (default: the newest that verifies).
    #[arg(long, requires = "load")]
    ckpt_step: Option<usize>,
    /// Tensor-parallel ranks (threads).
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// Pipeline stages (threads), each holding an even share of the layers.
    #[arg(long, default_value_t = 1)]
    pipeline_model_parallel_size: usize,
    /// A prompt (repeatable; default: two short ones).
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// A prompt as comma-separated token ids (repeatable), for a model without tokenizer.json.
    #[arg(long = "prompt-ids", conflicts_with = "prompts")]
    prompt_ids: Vec<String>,
    /// Tokens to generate per prompt at most.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature (sets sampling; default 1 when sampling).
    #[arg(long)]
    temperature: Option<f64>,
    /// Sample from the k most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the most likely tokens up to this probability mass.
    #[arg(long)]
    top_p: Option<f64>,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Re-run the whole sequence each step instead of keeping a key/value cache.
    #[arg(long)]
    no_cache: bool,
}

const DEFAULT_PROMPTS: [&str; 2] = ["The", "Once upon a time"];

fn parse_ids(text: &str) -> Result<Vec<u32>, String> {
    text.split(',')
        .map(|t| {
            t.trim()
                .parse()
                .map_err(|e| format!("--prompt-ids {text:?}: {t:?}: {e}"))
        })
        .collect()
}

fn run(cli: &Cli) -> Result<(), String> {
    let dir = cli
        .load_hf
        .as_ref()
        .or(cli.load.as_ref())
        .ok_or("no model")?;
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = tokenizer_path
        .is_file()
        .then(|| GptTokenizer::from_file(&tokenizer_path))
        .transpose()
        .map_err(|e| e.to_string())?;
    let prompts: Vec<Vec<u32>> = match (&tokenizer, cli.prompt_ids.is_empty()) {
        (_, false) => cli
            .prompt_ids
            .iter()
            .map(|p| parse_ids(p))
            .collect::<Result<_, _>>()?,
        (Some(t), true) => {
            let texts: Vec<&str> = if cli.prompts.is_empty() {
                DEFAULT_PROMPTS.to_vec()
            } else {
                cli.prompts.iter().map(String::as_str).collect()
            };
            texts
                .iter()
                .map(|p| t.encode(p).map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?
        }
        (None, true) => {
            return Err(format!(
                "{} has no tokenizer.json: give the prompts as --prompt-ids 1,2,3",
                dir.display()
            ));
        }
    };
    // EOS: the tokenizer's end of document, else the Hugging Face config's.
    let hf_eos = match &cli.load_hf {
        Some(d) => HfGptConfig::from_file(&d.join("config.json"))
            .map_err(|e| e.to_string())?
            .eos_token_id
            .first()
            .copied(),
        None => None,
    };
    let eos = tokenizer.as_ref().map(|t| t.eod).or(hf_eos);
    let sampling = if cli.temperature.is_some() || cli.top_k.is_some() || cli.top_p.is_some() {
        Sampling::Sample {
            temperature: cli.temperature.unwrap_or(1.0),
            top_k: cli.top_k,
            top_p: cli.top_p,
        }
    } else {
        Sampling::Greedy
    };
    // ANCHOR: generate_config
    let config = GenerateConfig::new(cli.max_new_tokens)
        .with_sampling(sampling)
        .with_seed(cli.seed)
        .with_eos_token_id(eos)
        .with_use_cache(!cli.no_cache);
    // ANCHOR_END: generate_config
    // A checkpoint: its config and iteration once, then each rank reads its own shard.
    let checkpoint = match &cli.load {
        Some(root) => Some((
            root,
            read_config::<Gpt>(root)?,
            resolve_iteration(root, cli.ckpt_step)?,
        )),
        None => None,
    };

    let (tp, pp) = (
        cli.tensor_model_parallel_size,
        cli.pipeline_model_parallel_size,
    );
    let hf = match (&checkpoint, &cli.load_hf) {
        (None, Some(d)) => Some((
            HfGptConfig::from_file(&d.join("config.json")).map_err(|e| e.to_string())?,
            read_hf_tensors(d).map_err(|e| e.to_string())?,
        )),
        _ => None,
    };
    let options = LaunchOptions::default().with_device(|_| Device::flex());
    let start = Instant::now();
    // ANCHOR: generate
    let out = launch::threads(&ParallelConfig::new(tp * pp, tp, pp), options, |ctx| {
        let chunks: Vec<Gpt> = match (&checkpoint, &hf) {
            (Some((root, c, iteration)), _) => load_rank_stages(root, *iteration, c, &ctx)?,
            (None, Some((hf, tensors))) => {
                let at = PipelinePosition::of(&ctx.state, 0);
                let chunk = (hf
                    .to_gpt_config(tp)
                    .init_stage(&ctx.groups.tp, at, &ctx.device))
                .map_err(|e| e.to_string())?;
                vec![load_hf_gpt_weights(chunk, hf, tensors).map_err(|e| e.to_string())?]
            }
            (None, None) => return Err("no model".to_string()),
        };
        let loaded = start.elapsed();
        let t = Instant::now();
        let generated = generate_stages(&chunks, &ctx.groups.pp, &prompts, &config)
            .map_err(|e| e.to_string())?;
        let params: usize = chunks.iter().map(Module::num_params).sum();
        Ok((generated, loaded, t.elapsed(), params))
    })
    .map_err(|e| match e {
        LaunchError::Failed { error, .. } => error,
        other => other.to_string(),
    })?;
    // ANCHOR_END: generate
    let (generated, loaded, took, params) = &out[0];

    println!(
        "> {} ({} parameters on rank 0) loaded at TP {tp} × PP {pp} in {:.2} s; {:?}, cache {}",
        dir.display(),
        params,
        loaded.as_secs_f64(),
        sampling,
        if cli.no_cache { "off" } else { "on" }
    );
    let show = |ids: &[u32]| match &tokenizer {
        Some(t) => t
            .decode(ids)
            .map(|s| format!("{s:?}"))
            .map_err(|e| e.to_string()),
        None => Ok(format!("{ids:?}")),
    };
    for (prompt, new) in prompts.iter().zip(&generated.tokens) {
        let stop = if new.last().copied() == eos && eos.is_some() {
            " [EOS]"
        } else {
            ""
        };
        println!("{} ⟶ {}{stop}", show(prompt)?, show(new)?);
    }
    let tokens: usize = generated.tokens.iter().map(Vec::len).sum();
    println!(
        "> {tokens} new tokens in {:.2} s: {:.1} tokens/s",
        took.as_secs_f64(),
        tokens as f64 / took.as_secs_f64().max(1e-9)
    );
    Ok(())
}

fn main() -> ExitCode {
    match run(&Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
