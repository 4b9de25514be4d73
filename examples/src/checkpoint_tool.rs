//! What the `checkpoint` example does: print a training checkpoint's index (the layout it was
//! saved at, every tensor with its global shape), and convert one to a Hugging Face
//! `BertForPreTraining` directory. Both read checkpoints of any layout.

use burn::config::Config;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn_megatron::checkpoint::{
    CheckpointIndex, CheckpointRank, SavedLayout, committed_dir, latest_loadable_checkpoint,
    load_checkpoint,
};
use burn_megatron::comm::Comm;
use burn_megatron::data::BertTokenizer;
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::models::{Bert, BertConfig, HfBertConfig, save_hf_bert};
use burn_megatron::optimizer::MegatronOptimizer;
use burn_megatron::topology::ParallelConfig;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

/// `iteration`, or the newest one under `root` that verifies (those newer that do not are
/// reported on stderr and passed over, as a resumed run would).
fn which(root: &Path, iteration: Option<usize>) -> Result<usize, String> {
    if let Some(i) = iteration {
        return Ok(i);
    }
    let found = latest_loadable_checkpoint(root)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{}: no checkpoint that verifies", root.display()))?;
    for (skipped, e) in &found.skipped {
        eprintln!("WARNING: checkpoint iteration {skipped} does not verify, skipped: {e}");
    }
    Ok(found.iteration)
}

/// A readable summary of the checkpoint of `iteration` (default: the latest) under `root`.
pub fn inspect(root: &Path, iteration: Option<usize>) -> Result<String, String> {
    let iteration = which(root, iteration)?;
    let index =
        CheckpointIndex::read(&committed_dir(root, iteration)).map_err(|e| e.to_string())?;
    let state = index.state();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "checkpoint {} (iteration {})",
        index.dir.display(),
        state.iteration
    );
    let _ = writeln!(out, "saved at {}", index.layout());
    let optimizer = match state.fused_adam_steps {
        Some(steps) => format!("the fused Adam after {steps} steps"),
        None => "burn-optim's optimizer (resumes at this layout only)".to_string(),
    };
    let _ = writeln!(out, "optimizer: {optimizer}");
    if let Some(s) = &state.grad_scaler {
        let _ = writeln!(out, "loss scaler: {s:?}");
    }
    // name → (global shape, sets, shards)
    let mut tensors: BTreeMap<&str, (Vec<usize>, Vec<&str>, usize)> = BTreeMap::new();
    let (mut files, mut bytes) = (0, 0);
    for (_, rank) in &index.ranks {
        for t in &rank.tensors {
            let e = tensors
                .entry(t.name.as_str())
                .or_insert_with(|| (t.global_shape.clone(), Vec::new(), 0));
            if !e.1.contains(&t.set.as_str()) {
                e.1.push(t.set.as_str());
            }
            if t.set == "model" {
                e.2 += 1;
            }
        }
        files += rank.files.len();
        bytes += rank.files.values().map(|f| f.bytes).sum::<u64>();
    }
    let _ = writeln!(out, "{} tensors:", tensors.len());
    for (name, (shape, sets, shards)) in &tensors {
        let _ = writeln!(
            out,
            "  {name:<58} {:<14} {:<36} {shards} shard(s)",
            format!("{shape:?}"),
            sets.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "{} rank directories, {files} files, {bytes} bytes (each file's size and CRC-32 in its index.json)",
        index.ranks.len()
    );
    Ok(out)
}

/// Runs `f` on the whole model (TP 1, one stage) of the checkpoint, with its config, its
/// real vocabulary size and the (single-rank) tensor-parallel group: what
/// `bert_pretrain --save` wrote (`bert_config.json`, `tokenizer.json` beside the iterations)
/// is read back.
fn with_whole<T: Send>(
    root: &Path,
    iteration: Option<usize>,
    f: impl Fn(Bert, &BertConfig, usize, &Comm) -> Result<T, String> + Sync,
) -> Result<T, String> {
    let iteration = which(root, iteration)?;
    let config_path = root.join("bert_config.json");
    let config = BertConfig::load(&config_path).map_err(|e| {
        format!(
            "{}: {e} (written by bert_pretrain --save)",
            config_path.display()
        )
    })?;
    let tokenizer =
        BertTokenizer::from_file(&root.join("tokenizer.json")).map_err(|e| e.to_string())?;
    let vocab = tokenizer.vocab_size();
    let options = LaunchOptions::default().with_device(|_| Device::flex());
    let mut out = launch::threads(&ParallelConfig::new(1, 1, 1), options, |ctx| {
        let model = config
            .init(&ctx.groups.tp, &ctx.device)
            .map_err(|e| e.to_string())?;
        let layout = SavedLayout {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: 1,
            data_parallel_size: 1,
            distributed_optimizer: false,
        };
        let names = |p: &str| Bert::global_param_name_at(&[0], p);
        let rank = CheckpointRank {
            layout,
            tensor_model_parallel_rank: 0,
            pipeline_model_parallel_rank: 0,
            names: &names,
        };
        let mp = ctx.groups.mp.clone();
        let weights_only =
            |m: &Bert| Ok(MegatronOptimizer::new(AdamWConfig::new().init(), m, mp, 0));
        let r = load_checkpoint(root, iteration, &rank, model, weights_only, false)
            .map_err(|e| e.to_string())?;
        f(r.model, &config, vocab, &ctx.groups.tp)
    })
    .map_err(|e| e.to_string())?;
    Ok(out.remove(0))
}

/// The whole model (TP 1, one stage) of the checkpoint of `iteration` (default: the
/// latest) under `root`, with its config.
pub fn load_whole(root: &Path, iteration: Option<usize>) -> Result<(Bert, BertConfig), String> {
    with_whole(root, iteration, |m, c, _, _| Ok((m, c.clone())))
}

/// Writes `out/config.json` and `out/model.safetensors`, Hugging Face's `BertForPreTraining`,
/// from the checkpoint of `iteration` (default: the latest) under `root`.
pub fn to_hf(root: &Path, iteration: Option<usize>, out: &Path) -> Result<(), String> {
    with_whole(root, iteration, |model, config, vocab, tp| {
        let hf = HfBertConfig::from_bert_config(config, vocab);
        save_hf_bert(&model, &hf, out, tp).map_err(|e| e.to_string())
    })
}
