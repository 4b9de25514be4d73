//! `dataset`: what a run will read from Megatron datasets, before it runs. `samples`
//! prints each split's samples (`--seq-length` + 1 tokens each), in the order training
//! reads them; `stats` prints each split's documents, tokens, epochs and samples.

use burn_megatron::data::megatron::{
    Blend, GPTDatasetConfig, MegatronSplit, Split, build_gpt_datasets,
};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Inspect Megatron datasets as a run will read them.
#[derive(Debug, Clone, Parser)]
#[command(name = "dataset", version)]
pub struct DatasetCli {
    /// What to print.
    #[command(subcommand)]
    pub command: DatasetCommand,
}

/// `dataset`'s subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum DatasetCommand {
    /// Each split's samples, in order.
    Samples(DatasetArgs),
    /// Documents, tokens, epochs and samples per split.
    Stats(DatasetArgs),
}

/// The sampling flags, named as `gpt_pretrain`'s (and Megatron's).
#[derive(Debug, Clone, Args)]
pub struct DatasetArgs {
    /// `PREFIX`, or weighted prefixes `W1 P1 W2 P2 …`.
    #[arg(long, num_args = 1.., required = true)]
    pub data_path: Vec<String>,
    /// Tokens per sample (each sample holds one more).
    #[arg(long)]
    pub seq_length: usize,
    /// Seed of the shuffles.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Train, validation and test proportions of the documents.
    #[arg(long, default_value = "969,30,1")]
    pub split: String,
    /// Training samples the run needs.
    #[arg(long, default_value_t = 0)]
    pub train_samples: usize,
    /// Validation samples the run needs.
    #[arg(long, default_value_t = 0)]
    pub valid_samples: usize,
    /// Test samples the run needs.
    #[arg(long, default_value_t = 0)]
    pub test_samples: usize,
    /// Where the sample indices are cached (default: beside the data).
    #[arg(long)]
    pub data_cache_path: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn build(a: &DatasetArgs) -> Result<[Option<MegatronSplit>; 3], String> {
    let blend = Blend::parse(&a.data_path).map_err(|e| e.to_string())?;
    let config = GPTDatasetConfig::new(a.seq_length)
        .with_random_seed(a.seed)
        .with_split(a.split.clone())
        .with_path_to_cache(a.data_cache_path.as_ref().map(|p| p.display().to_string()));
    let sizes = [a.train_samples, a.valid_samples, a.test_samples].map(Some);
    build_gpt_datasets(&blend, &config, sizes).map_err(|e| e.to_string())
}

/// `dataset samples`: `{"train": [[…], …], "valid": […], "test": […]}` with the number of
/// samples asked for of each split (as JSON, or one line per sample).
pub fn samples(a: &DatasetArgs) -> Result<String, String> {
    let splits = build(a)?;
    let wanted = [a.train_samples, a.valid_samples, a.test_samples];
    let mut json = serde_json::Map::new();
    let mut text = String::new();
    for ((split, data), n) in Split::ALL.iter().zip(&splits).zip(wanted) {
        let mut rows = Vec::new();
        if let Some(data) = data {
            for i in 0..n.min(data.len()) {
                rows.push(data.sample(i).map_err(|e| e.to_string())?);
            }
        }
        for (i, r) in rows.iter().enumerate() {
            text.push_str(&format!("{} {i}: {r:?}\n", split.name()));
        }
        json.insert(split.name().into(), serde_json::json!(rows));
    }
    Ok(if a.json {
        serde_json::Value::Object(json).to_string()
    } else {
        text
    })
}

/// `dataset stats`: per split and dataset, documents, tokens per epoch, epochs and samples.
pub fn stats(a: &DatasetArgs) -> Result<String, String> {
    let splits = build(a)?;
    let mut rows = Vec::new();
    for (split, data) in Split::ALL.iter().zip(&splits) {
        let Some(data) = data else {
            rows.push(serde_json::json!({ "split": split.name(), "samples": 0 }));
            continue;
        };
        let datasets: Vec<_> = data
            .datasets()
            .iter()
            .map(|d| {
                serde_json::json!({
                    "prefix": d.indexed().prefix().display().to_string(),
                    "documents": d.documents().len(),
                    "tokens_per_epoch": d.tokens_per_epoch(),
                    "epochs": d.num_epochs(),
                    "samples": d.len(),
                })
            })
            .collect();
        rows.push(serde_json::json!({
            "split": split.name(),
            "samples": data.len(),
            "datasets": datasets,
        }));
    }
    if a.json {
        return Ok(serde_json::Value::Array(rows).to_string());
    }
    let mut out = String::new();
    for r in rows {
        out.push_str(&format!(
            "{}: {} samples\n",
            r["split"].as_str().unwrap_or(""),
            r["samples"]
        ));
        for d in r["datasets"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  {}: {} documents, {} tokens per epoch, {} epochs, {} samples built\n",
                d["prefix"].as_str().unwrap_or(""),
                d["documents"],
                d["tokens_per_epoch"],
                d["epochs"],
                d["samples"]
            ));
        }
    }
    Ok(out)
}
