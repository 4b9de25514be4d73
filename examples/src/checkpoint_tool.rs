//! What the `checkpoint` example does: print a training checkpoint's index (the layout it was
//! saved at, every tensor with its global shape), and convert one to a Hugging Face directory
//! (`BertForPreTraining`, or a GPT's Llama / Qwen2 / GPT-2 causal LM). Both read checkpoints
//! of any layout; [`load_rank`] loads one into a whole model at any tensor-parallel size, and
//! [`load_rank_stages`] into a rank's pipeline chunks.

use burn::config::Config;
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn_megatron::checkpoint::{
    CheckpointIndex, CheckpointRank, SavedLayout, advanced::load_checkpoint, committed_dir,
    latest_loadable_checkpoint,
};
use burn_megatron::comm::Comm;
use burn_megatron::data::{BertTokenizer, GptTokenizer};
use burn_megatron::launch::{self, LaunchOptions, RankContext};
use burn_megatron::models::{
    Bert, BertConfig, Gpt, GptConfig, HfBertConfig, HfGptConfig, save_hf_bert, save_hf_gpt,
};
use burn_megatron::moe::global_expert_name;
use burn_megatron::optimizer::MegatronOptimizer;
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

/// `iteration`, or the newest one under `root` that verifies (those newer that do not are
/// reported on stderr and passed over, as a resumed run would).
pub fn resolve_iteration(root: &Path, iteration: Option<usize>) -> Result<usize, String> {
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
    let iteration = resolve_iteration(root, iteration)?;
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

/// A model the tool reads checkpoints of, whole (one pipeline stage): the config its
/// pretraining example writes beside the iterations, how it is built, and the global names
/// its checkpoints key its parameters by.
pub trait WholeModel: Module + Clone + Send {
    /// The model's configuration.
    type Config: Config + Clone + Send + Sync;
    /// The config's file under a checkpoint root.
    const CONFIG_FILE: &'static str;
    /// The example whose `--save` writes it.
    const EXAMPLE: &'static str;
    /// This rank's part of the model chunk at `position` over `tp`, without sequence
    /// parallelism (inference runs the sequence whole; the weights are the same either way).
    fn build(
        config: &Self::Config,
        tp: &Comm,
        position: PipelinePosition,
        device: &Device,
    ) -> Result<Self, String>;
    /// The global index of the chunk's first layer.
    fn first_layer(&self) -> usize;
    /// The global name of the parameter at module path `path` of chunks whose first layers
    /// are `first_layers` (`"1.layers.0.…"`, or `"layers.0.…"` for one chunk).
    fn global_name(first_layers: &[usize], path: &str) -> String;
    /// The config at `path`, as a checkpoint of any age saved it.
    fn load_config(path: &Path) -> Result<Self::Config, burn::config::ConfigError>;
}

impl WholeModel for Bert {
    type Config = BertConfig;
    const CONFIG_FILE: &'static str = "bert_config.json";
    const EXAMPLE: &'static str = "bert_pretrain";
    fn build(
        config: &BertConfig,
        tp: &Comm,
        position: PipelinePosition,
        device: &Device,
    ) -> Result<Self, String> {
        let config = (config.clone()).map_transformer(|t| t.with_sequence_parallel(false));
        (config.init_stage(tp, position, device)).map_err(|e| e.to_string())
    }
    fn first_layer(&self) -> usize {
        Bert::first_layer(self)
    }
    fn global_name(first_layers: &[usize], path: &str) -> String {
        Bert::global_param_name_at(first_layers, path)
    }
    fn load_config(path: &Path) -> Result<BertConfig, burn::config::ConfigError> {
        BertConfig::load_saved(path)
    }
}

impl WholeModel for Gpt {
    type Config = GptConfig;
    const CONFIG_FILE: &'static str = "gpt_config.json";
    const EXAMPLE: &'static str = "gpt_pretrain";
    fn build(
        config: &GptConfig,
        tp: &Comm,
        position: PipelinePosition,
        device: &Device,
    ) -> Result<Self, String> {
        let config = (config.clone()).map_transformer(|t| t.with_sequence_parallel(false));
        (config.init_stage(tp, position, device)).map_err(|e| e.to_string())
    }
    fn first_layer(&self) -> usize {
        Gpt::first_layer(self)
    }
    fn global_name(first_layers: &[usize], path: &str) -> String {
        Gpt::global_param_name_at(first_layers, path)
    }
    fn load_config(path: &Path) -> Result<GptConfig, burn::config::ConfigError> {
        GptConfig::load_saved(path)
    }
}

/// The model config saved beside the checkpoints under `root`.
pub fn read_config<M: WholeModel>(root: &Path) -> Result<M::Config, String> {
    let path = root.join(M::CONFIG_FILE);
    M::load_config(&path)
        .map_err(|e| format!("{}: {e} (written by {} --save)", path.display(), M::EXAMPLE))
}

/// This rank's part of the whole model (one pipeline stage, split over `ctx`'s
/// tensor-parallel group), loaded from the checkpoint of `iteration` under `root`, whatever
/// layout it was saved at. Collective over `ctx`'s ranks.
pub fn load_rank<M: WholeModel>(
    root: &Path,
    iteration: usize,
    config: &M::Config,
    ctx: &RankContext,
) -> Result<M, String> {
    let state = &ctx.state;
    if state.pipeline_model_parallel_size() != 1 {
        return Err(
            "a whole model loads at pipeline-parallel size 1 (load_rank_stages loads stages)"
                .into(),
        );
    }
    let mut chunks = load_rank_stages::<M>(root, iteration, config, ctx)?;
    Ok(chunks.remove(0))
}

/// This rank's model chunks (one per virtual stage of `ctx`'s layout, split over its
/// tensor-parallel group), loaded from the checkpoint of `iteration` under `root`, whatever
/// layout it was saved at. Collective over `ctx`'s ranks.
pub fn load_rank_stages<M: WholeModel>(
    root: &Path,
    iteration: usize,
    config: &M::Config,
    ctx: &RankContext,
) -> Result<Vec<M>, String> {
    let state = &ctx.state;
    let v = state.virtual_pipeline_model_parallel_size().unwrap_or(1);
    let chunks = (0..v)
        .map(|c| {
            M::build(
                config,
                &ctx.groups.tp,
                PipelinePosition::of(state, c),
                &ctx.device,
            )
        })
        .collect::<Result<Vec<M>, String>>()?;
    let first_layers: Vec<usize> = chunks.iter().map(M::first_layer).collect();
    // Every expert is local here (EP 1): they go by their global index, as training saves
    // them.
    let names = move |path: &str| global_expert_name(&M::global_name(&first_layers, path), 0);
    let rank = CheckpointRank {
        layout: SavedLayout {
            tensor_model_parallel_size: state.tensor_model_parallel_size(),
            pipeline_model_parallel_size: state.pipeline_model_parallel_size(),
            virtual_pipeline_model_parallel_size: v,
            data_parallel_size: state.data_parallel_size(),
            distributed_optimizer: false,
            expert_model_parallel_size: 1,
        },
        tensor_model_parallel_rank: state.tensor_model_parallel_rank(),
        pipeline_model_parallel_rank: state.pipeline_model_parallel_rank(),
        expert_model_parallel_rank: 0,
        share: burn_megatron::checkpoint::SaveShare::ALL,
        names: &names,
    };
    let (mp, tp_rank) = (ctx.groups.mp.clone(), state.tensor_model_parallel_rank());
    let weights_only = |m: &Vec<M>| {
        Ok(MegatronOptimizer::new(
            AdamWConfig::new().init(),
            m,
            mp,
            tp_rank,
        ))
    };
    load_checkpoint(root, iteration, &rank, chunks, weights_only, false)
        .map(|r| r.model)
        .map_err(|e| e.to_string())
}

/// Runs `f` on the whole model (TP 1, one stage) of the checkpoint of `iteration` (default:
/// the latest) under `root`, with its config and its (single-rank) tensor-parallel group.
fn with_whole<M: WholeModel, T: Send>(
    root: &Path,
    iteration: Option<usize>,
    f: impl Fn(M, &M::Config) -> Result<T, String> + Sync,
) -> Result<T, String> {
    let iteration = resolve_iteration(root, iteration)?;
    let config = read_config::<M>(root)?;
    let options = LaunchOptions::default().with_device(|_| Device::flex());
    let mut out = launch::threads(&ParallelConfig::new(1, 1, 1), options, |ctx| {
        let model = load_rank::<M>(root, iteration, &config, &ctx)?;
        f(model, &config)
    })
    .map_err(|e| e.to_string())?;
    Ok(out.remove(0))
}

/// The whole model (TP 1, one stage) of the checkpoint of `iteration` (default: the
/// latest) under `root`, with its config: `load_whole::<Bert>` or `load_whole::<Gpt>`.
pub fn load_whole<M: WholeModel>(
    root: &Path,
    iteration: Option<usize>,
) -> Result<(M, M::Config), String> {
    with_whole(root, iteration, |m: M, c: &M::Config| Ok((m, c.clone())))
}

/// Writes a Hugging Face directory from the checkpoint of `iteration` (default: the latest)
/// under `root`: a GPT's (`gpt_config.json` beside the checkpoints; Llama, Qwen2 or GPT-2,
/// whichever its shape is, with its `tokenizer.json`), else a BERT's
/// (`BertForPreTraining`). Returns the architecture written.
pub fn to_hf(root: &Path, iteration: Option<usize>, out: &Path) -> Result<String, String> {
    // ANCHOR: to_hf
    let tokenizer_path = root.join("tokenizer.json");
    if !root.join(Gpt::CONFIG_FILE).is_file() {
        let vocab = BertTokenizer::from_file(&tokenizer_path)
            .map_err(|e| e.to_string())?
            .vocab_size();
        return with_whole(root, iteration, |model: Bert, config| {
            let hf = HfBertConfig::from_bert_config(config, vocab);
            save_hf_bert(&model, &hf, out).map_err(|e| e.to_string())?;
            Ok("BertForPreTraining".to_string())
        });
    }
    let tokenizer = GptTokenizer::from_file(&tokenizer_path).map_err(|e| e.to_string())?;
    let architecture = with_whole(root, iteration, |model: Gpt, config| {
        // The model's own vocabulary (a fine-tuned Hugging Face model's may exceed its
        // tokenizer's).
        let mut hf =
            HfGptConfig::from_gpt_config(config, config.vocab_size()).map_err(|e| e.to_string())?;
        // The document separator begins and ends a text, as GPT-2's `<|endoftext|>`.
        hf.bos_token_id = Some(tokenizer.eod);
        hf.eos_token_id = vec![tokenizer.eod];
        save_hf_gpt(&model, &hf, out).map_err(|e| e.to_string())?;
        Ok(hf.architecture.names().1.to_string())
    })?;
    // ANCHOR_END: to_hf
    let copy = out.join("tokenizer.json");
    std::fs::copy(&tokenizer_path, &copy).map_err(|e| format!("{}: {e}", copy.display()))?;
    Ok(architecture)
}
