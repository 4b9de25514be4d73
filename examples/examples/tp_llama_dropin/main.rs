//! A Burn user's Llama made tensor-parallel by swapping its layers, then pipeline-parallel
//! by building each stage's part.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example tp_llama_dropin [-- --tp 2 --pp 2 --steps 5]
//! ```
//!
//! `mod plain` is a small Llama written the way Burn's model repositories write one
//! (llama-burn): private fields, `nn::SwiGlu`, an attention output reshaped to the input's
//! width, a key/value cache sized from the config, weights loaded from a saved record and
//! greedy generation. `mod parallel` is the same code with tensor-parallel layers (diff the
//! two). The plain model saves a record once; TP 1 loads it whole, each rank at `--tp` loads
//! only its shards from it. Both train from it and generate from it: the losses and the first
//! step's gradients (gathered by path) must agree within 1e-5 and the generated tokens must be
//! equal, or the example fails. `mod pipeline` is `parallel` split into pipeline stages (diff
//! the two): at TP = `--tp` × PP = `--pp` each stage loads only its layers from the same
//! record and trains through Megatron's 1F1B schedule, held to the same bounds.
//!
//! With `--hf <dir>`, the same Llama reads a Hugging Face Llama checkpoint instead (`mod hf`:
//! its `config.json` and the load options that map its tensors), at TP 1 and at `--tp`, and
//! generates from `--text` or `--prompt`. With `--meta <dir>`, it reads a checkpoint in
//! Meta's own format (`mod meta`: `params.json` and `consolidated.NN.pth`, one file or one
//! per model-parallel rank; `tokenizer.model` for `--text`), and generates from `--text` or
//! `--prompt`.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use burn_megatron::comm::Comm;
use burn_megatron::data::GptTokenizer;
use burn_megatron::dropin::{LoadOptions, RecordSource, save_gathered};
use burn_megatron::launch::{self, LaunchOptions, RankContext};
use burn_megatron::pipeline::{
    ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule, forward_backward_func,
    read_losses,
};
use burn_megatron::tensor_parallel::TpError;
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_examples::dropin::{
    ByPath, by_path, param_bytes, print_losses, solo, train, worst,
};
use burn_megatron_examples::memory::{Counter, mib};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(group(clap::ArgGroup::new("checkpoint").args(["hf", "meta"])))]
struct Args {
    /// Tensor-parallel size to compare with TP = 1 (1 or 2: it splits the 2 key/value heads;
    /// with `--hf` or `--meta`, any divisor of the checkpoint's).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Pipeline stages for the TP × PP run (1 or 2: the model has 2 layers).
    #[arg(long, default_value_t = 2)]
    pp: usize,
    /// Training steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Tokens to generate greedily from the saved weights.
    #[arg(long, default_value_t = 8)]
    new_tokens: usize,
    /// The prompt's token ids.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 7, 3, 12])]
    prompt: Vec<i64>,
    /// A Hugging Face Llama's directory (`config.json` and its weights, safetensors or
    /// PyTorch): load it at TP 1 and at `--tp` (any divisor of its key/value heads) and
    /// generate from `--prompt` or `--text`, instead of the rest.
    #[arg(long)]
    hf: Option<PathBuf>,
    /// With `--hf`: a text prompt for the directory's `tokenizer.json`, after the config's
    /// `bos_token_id`; with `--meta`: for its `tokenizer.model` (Llama 3's tiktoken file),
    /// after `<|begin_of_text|>`. Instead of `--prompt`.
    #[arg(long, requires = "checkpoint", conflicts_with = "prompt")]
    text: Option<String>,
    /// With `--hf`: write the model loaded at `--tp` back to this directory as a Hugging Face
    /// checkpoint (`config.json`, `model.safetensors`), each rank's shards gathered.
    #[arg(long, requires = "hf")]
    save_hf: Option<PathBuf>,
    /// A Llama in Meta's format (`params.json`, `consolidated.NN.pth`): load it at TP 1 and at
    /// `--tp` and generate from `--prompt` or `--text`, instead of the rest.
    #[arg(long, conflicts_with = "hf")]
    meta: Option<PathBuf>,
    /// With `--meta`: Llama 3's RoPE scaling factor, which Meta's params.json does not give
    /// (Hugging Face's configs: 32 for Llama 3.2 1B and 3B, 8 for the other 3.1 and later).
    #[arg(long, requires = "meta")]
    rope_scaling_factor: Option<f32>,
    /// With `--hf` or `--meta`: load only at `--tp`, without the TP 1 comparison (whose whole
    /// model need not fit one device).
    #[arg(long)]
    no_reference: bool,
    /// With `--hf` or `--meta`: where each rank of `--tp` computes: `cpu` (Burn's Flex), or
    /// `cuda`, rank r on CUDA device r (build with `--features cuda`; collectives staged
    /// through host memory).
    #[arg(long, value_enum, default_value_t = RankDevice::Cpu)]
    device: RankDevice,
    /// With `--hf` or `--meta`: the float type the weights are held and computed in
    /// (`f32`; or `bf16`, `f16`: each rank's device set to it before the model is built, so
    /// the weights are read into it from the file, never widened).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    dtype: Precision,
}

/// `--dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Precision {
    F32,
    Bf16,
    F16,
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RankDevice {
    Cpu,
    Cuda,
}

impl RankDevice {
    /// Each of `ranks` ranks' device, or why there is none (before any rank starts).
    fn devices(self, ranks: usize, dtype: Precision) -> Result<Vec<Device>, String> {
        (0..ranks)
            .map(|r| {
                let mut device = match self {
                    RankDevice::Cpu => Device::flex(),
                    RankDevice::Cuda => burn_megatron::device::cuda_device(r)
                        .map_err(|e| format!("--device cuda, rank {r}: {e}"))?,
                };
                let float = match dtype {
                    Precision::F32 => return Ok(device),
                    Precision::Bf16 => FloatDType::BF16,
                    Precision::F16 => FloatDType::F16,
                };
                // Once per device: the ranks of one CPU share it, and a second run reuses it.
                if device.settings().float_dtype != float {
                    device
                        .configure(float)
                        .map_err(|e| format!("--dtype: {e:?}"))?;
                }
                Ok(device)
            })
            .collect()
    }
}

const SEQ: usize = 16;
const BATCH: usize = 2;
const TOLERANCE: f32 = 1e-5;

/// The config, the rotary encoding, the cache: what the conversion leaves alone.
mod llama;
use llama::{KeyValueCache, LlamaConfig, causal_mask, repeat_kv};

/// A Hugging Face Llama checkpoint read into the user's Llama.
mod hf;

/// A Llama checkpoint in Meta's own format read into the user's Llama.
mod meta;

/// The user's Llama, in plain Burn.
mod plain;

/// The same Llama, tensor-parallel: diff `parallel.rs` against `plain.rs`.
mod parallel;

/// The tensor-parallel Llama split into pipeline stages: diff `pipeline.rs` against
/// `parallel.rs`.
mod pipeline;

/// The fixed batch both train on: `[BATCH, SEQ]` inputs and the labels one token ahead.
fn batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let v: Vec<i64> = (0..BATCH * (SEQ + 1))
        .map(|i| ((i * 5 + i / 3) % 64) as i64)
        .collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [BATCH, SEQ + 1]), device);
    (ids.clone().narrow(1, 0, SEQ), ids.narrow(1, 1, SEQ))
}

/// Each rank's peak while building and loading a larger Llama (vocabulary 8192, width 512,
/// 4 layers: 82 MB of weights) from its record, against its shards plus one whole tensor.
fn loading_memory(dir: &std::path::Path, tp: usize) -> Result<String, Box<dyn std::error::Error>> {
    let config = LlamaConfig::new(8192, 512, 8, 4, 1536, 4, 64);
    let record = dir.join("larger.bpk");
    plain::Llama::new(&config, &Device::flex()).save_file(&record)?;
    let whole = std::fs::metadata(&record)?.len() as i64;
    let ranks = launch::threads(
        &ParallelConfig::new(tp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let counter = Counter::claim();
            let model = parallel::Llama::load(
                &config,
                &RecordSource::from_path(&record),
                &LoadOptions::default(),
                &ctx.groups.tp,
                &Device::flex(),
            )?;
            let peak = counter.peak();
            Ok::<_, TpError>((peak, param_bytes(&model) as i64))
        },
    )?;
    let (peak, shards) = ranks[0];
    // The largest tensor (the output layer and the embedding, [512, 8192]): one whole one.
    let bound = shards + 512 * 8192 * 4;
    let line = format!(
        "loading a {} record at TP {tp}: rank 0 peaks at {} = {:.2}x (its shards {} + one whole tensor {})",
        mib(whole),
        mib(peak),
        peak as f64 / bound as f64,
        mib(shards),
        mib(512 * 8192 * 4),
    );
    Ok(line)
}

type Error = Box<dyn std::error::Error + Send + Sync>;

// ANCHOR: pipeline
/// One rank of the TP × PP run: its stage built and loaded, `steps` AdamW steps through the
/// 1F1B schedule (a microbatch per sample). Its losses where it is the last stage, and the
/// first step's gradients by the whole model's names.
fn pipeline_rank(
    ctx: RankContext,
    config: &LlamaConfig,
    record: &RecordSource,
    steps: usize,
) -> Result<(Option<Vec<f32>>, ByPath), Error> {
    let (tp, d) = (&ctx.groups.tp, &ctx.device);
    let stage = pipeline::Llama::pp_plan(config).stage(PipelinePosition::of(&ctx.state, 0))?;
    let mut model = pipeline::Llama::load(config, record, &LoadOptions::default(), &stage, tp, d)?;
    let p2p = ctx.p2p(P2pShapes::Variable);
    let schedule = PipelineSchedule::new(ctx.state.pipeline_model_parallel_size(), BATCH);
    let mut optim = burn::optim::AdamWConfig::new()
        .with_weight_decay(0.01)
        .init();
    let (x, y) = batch(d);
    let (mut losses, mut grads0) = (Vec::new(), ByPath::new());
    for step in 0..steps {
        let out = forward_backward_func(
            |s: ForwardStep<'_, pipeline::Llama, 3>| {
                let (x, y) = (
                    x.clone().narrow(0, s.microbatch, 1),
                    y.clone().narrow(0, s.microbatch, 1),
                );
                Ok(s.model.forward_step(x, y, s.input)?)
            },
            std::slice::from_ref(&model),
            &p2p,
            ForwardBackwardConfig::new(schedule),
        )?;
        let microbatches = read_losses(&out.losses);
        losses.push(microbatches.iter().map(|l| l.loss as f32).sum::<f32>() / BATCH as f32);
        if step == 0 {
            let grads = by_path(&model, Some(&out.grads), tp);
            grads0 = grads
                .into_iter()
                .map(|(k, v)| (stage.global_name(&k), v))
                .collect();
        }
        model = optim.step(3e-3, model, out.grads);
    }
    Ok((stage.is_last().then_some(losses), grads0))
}
// ANCHOR_END: pipeline

/// `--hf`: the checkpoint in `dir` at TP 1 and at `--tp`, each rank reading only its shards,
/// generating greedily from `--prompt` (or `--text`, through the checkpoint's tokenizer).
fn from_hugging_face(dir: &Path, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut checkpoint = hf::Checkpoint::open(dir)?;
    let c = &checkpoint.config;
    println!(
        "{}: {} layers, width {}, {} heads over {} key/value heads, vocabulary {}{}",
        dir.display(),
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.vocab_size,
        if checkpoint.tie_word_embeddings {
            ", tied"
        } else {
            ""
        },
    );
    let bos = checkpoint.bos_token_id;
    let (prompt, tokenizer) = prompt(args, || Ok((open(&dir.join("tokenizer.json"))?, bos)))?;
    fit(&mut checkpoint.config, &prompt, args)?;
    let load = |tp: &Comm, device: &Device| checkpoint.load(tp, device);
    same_tokens(&checkpoint.config, load, &prompt, tokenizer.as_ref(), args)?;
    if let Some(out) = &args.save_hf {
        // What a fine-tune would write back: here the weights as loaded, at --tp.
        launch::threads(
            &ParallelConfig::new(args.tp, args.tp, 1),
            LaunchOptions::default(),
            |ctx| {
                let model = checkpoint.load(&ctx.groups.tp, &Device::flex())?;
                checkpoint.save(&model, out, &ctx.groups.tp)
            },
        )?;
        println!("written at TP {}: {}", args.tp, out.display());
    }
    Ok(())
}

/// `--meta`: the checkpoint in `dir` at TP 1 and at `--tp`, each rank reading only its shards
/// (of the parts joined, for a model-parallel checkpoint), generating greedily from `--prompt`
/// (or `--text`, through its `tokenizer.model`).
fn from_meta(dir: &Path, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut checkpoint = meta::Checkpoint::open(dir, args.rope_scaling_factor)?;
    let c = &checkpoint.config;
    let files = match RecordSource::from_meta(dir)? {
        RecordSource::ModelParallel(files) => format!("{} model-parallel files", files.len()),
        _ => "one file".to_string(),
    };
    println!(
        "{} ({files}): {} layers, width {}, feed-forward {}, {} heads over {} key/value heads, \
         vocabulary {}",
        dir.display(),
        c.n_layers,
        c.d_model,
        c.hidden_size,
        c.n_heads,
        c.n_kv_heads,
        c.vocab_size,
    );
    let (prompt, tokenizer) = prompt(args, || {
        let t = open(&dir.join("tokenizer.model"))?;
        // Llama 3's, or Llama 2's (SentencePiece's).
        let bos = (t.token_id("<|begin_of_text|>").or(t.token_id("<s>"))).map(i64::from);
        Ok((t, bos))
    })?;
    fit(&mut checkpoint.config, &prompt, args)?;
    let load = |tp: &Comm, device: &Device| checkpoint.load(tp, device);
    same_tokens(&checkpoint.config, load, &prompt, tokenizer.as_ref(), args)
}

/// The checkpoint's tokenizer, or why there is none.
fn open(path: &Path) -> Result<GptTokenizer, String> {
    GptTokenizer::from_file(path).map_err(|e| format!("--text needs the tokenizer: {e}"))
}

/// `--text` through the checkpoint's tokenizer, after its beginning-of-sequence id (what
/// `tokenizer` gives), or `--prompt`.
fn prompt(
    args: &Args,
    tokenizer: impl FnOnce() -> Result<(GptTokenizer, Option<i64>), String>,
) -> Result<(Vec<i64>, Option<GptTokenizer>), Box<dyn std::error::Error>> {
    let Some(text) = &args.text else {
        return Ok((args.prompt.clone(), None));
    };
    let (t, bos) = tokenizer()?;
    let ids = t.encode(text)?.into_iter().map(i64::from);
    let ids: Vec<i64> = bos.into_iter().chain(ids).collect();
    println!("prompt ids: {ids:?}");
    Ok((ids, Some(t)))
}

/// The config's positions cut to the prompt and `--new-tokens`: the cache and the rotary table
/// for the positions this run uses, not the 128k a Llama 3 checkpoint allows (the scaling
/// reads its original context length). `--tp` must divide the key/value heads, and the
/// prompt's ids must be in the vocabulary.
fn fit(config: &mut LlamaConfig, prompt: &[i64], args: &Args) -> Result<(), String> {
    if !config.n_kv_heads.is_multiple_of(args.tp) {
        return Err(format!(
            "--tp must divide the {} key/value heads",
            config.n_kv_heads
        ));
    }
    in_vocabulary(prompt, config.vocab_size)?;
    let length = prompt.len() + args.new_tokens;
    if prompt.is_empty() || length > config.max_seq_len {
        return Err(format!(
            "the prompt is empty, or it and --new-tokens exceed the model's {} positions",
            config.max_seq_len
        ));
    }
    config.max_seq_len = length;
    Ok(())
}

/// The float types of `model`'s weights, and their bytes on this rank.
fn held(model: &impl Module) -> (Vec<DType>, usize) {
    struct Held(Vec<DType>, usize);
    impl ModuleVisitor for Held {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p.val();
            if !self.0.contains(&v.dtype()) {
                self.0.push(v.dtype());
            }
            self.1 += v.shape().num_elements() * v.dtype().size();
        }
    }
    let mut held = Held(Vec::new(), 0);
    model.visit(&mut held);
    (held.0, held.1)
}

/// An error naming the first of `prompt`'s ids that is not in a vocabulary of `vocab`.
fn in_vocabulary(prompt: &[i64], vocab: usize) -> Result<(), String> {
    let outside = |&&i: &&i64| usize::try_from(i).ok().is_none_or(|i| i >= vocab);
    match prompt.iter().find(outside) {
        Some(id) => Err(format!(
            "the prompt's token {id} is not in the vocabulary of {vocab}"
        )),
        None => Ok(()),
    }
}

/// The model `load` gives at TP 1 and at `--tp` generates greedily from `prompt`; an error if
/// the tokens differ.
fn same_tokens(
    config: &LlamaConfig,
    load: impl Fn(&Comm, &Device) -> Result<parallel::Llama, TpError> + Sync,
    prompt: &[i64],
    tokenizer: Option<&GptTokenizer>,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut generated = Vec::new();
    let mut sizes = match args.no_reference {
        true => vec![args.tp],
        false => vec![1, args.tp],
    };
    sizes.dedup();
    for tp in sizes {
        let devices = args.device.devices(tp, args.dtype)?;
        let options = LaunchOptions::default().with_device(move |r| devices[r].clone());
        let ranks = launch::threads(&ParallelConfig::new(tp, tp, 1), options, |ctx| {
            let model = load(&ctx.groups.tp, &ctx.device)?;
            let weights = held(&model);
            (model.generate(config, prompt, args.new_tokens)).map(|tokens| (tokens, weights))
        })?;
        let (tokens, (dtypes, bytes)) = ranks.into_iter().next().expect("a rank");
        println!("weights TP={tp}: {dtypes:?}, {bytes} bytes on rank 0");
        let new = &tokens[prompt.len()..];
        println!("greedy tokens TP={tp}: {new:?}");
        if let Some(t) = tokenizer {
            let ids: Vec<u32> = new.iter().map(|&i| i as u32).collect();
            println!("text TP={tp}: {:?}", t.decode(&ids)?);
        }
        generated.push(tokens);
    }
    if generated.iter().any(|g| *g != generated[0]) {
        return Err(format!("TP={} generated other tokens than TP=1", args.tp).into());
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(dir) = &args.hf {
        return from_hugging_face(dir, &args);
    }
    if let Some(dir) = &args.meta {
        return from_meta(dir, &args);
    }
    // 65 tokens: no TP size splits them, so the plan pads the vocabulary (to 80 at TP 2).
    let config = LlamaConfig::new(65, 32, 4, 2, 48, 2, SEQ + args.new_tokens + 8);
    if !config.n_kv_heads.is_multiple_of(args.tp) {
        return Err("--tp must divide the 2 key/value heads".into());
    }
    if !config.n_layers.is_multiple_of(args.pp) {
        return Err("--pp must divide the 2 layers".into());
    }
    in_vocabulary(&args.prompt, config.vocab_size)?;
    // The user's saved weights: a record the plain model writes (burnpack, Burn's own format).
    let dir = std::env::temp_dir().join(format!("tp-llama-dropin-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (record, trained) = (dir.join("llama.bpk"), dir.join("trained.bpk"));
    let source = RecordSource::from_path(&record);
    let device = Device::flex();
    device.seed(42);
    plain::Llama::new(&config, &device).save_file(&record)?;
    let prompt = &args.prompt;

    // TP 1: the plain model loads the whole record.
    let tokens =
        plain::Llama::load(&config, &record, &device).generate(&config, prompt, args.new_tokens);
    let ad = Device::flex().autodiff();
    let model = plain::Llama::load(&config, &record, &ad);
    let (x, y) = batch(&ad);
    let (_, single, plain_grads) = train(model, args.steps, &solo(), |m| {
        Ok::<_, TpError>(m.loss(x.clone(), y.clone()))
    })?;

    // TP = --tp: each rank reads only its shards of the same record.
    let ranks = launch::threads(
        &ParallelConfig::new(args.tp, args.tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (tp, d) = (&ctx.groups.tp, &ctx.device);
            let model = parallel::Llama::load(
                &config,
                &source,
                &LoadOptions::default(),
                tp,
                &Device::flex(),
            )?;
            let tokens = model.generate(&config, prompt, args.new_tokens)?;
            let model = parallel::Llama::load(&config, &source, &LoadOptions::default(), tp, d)?;
            let (x, y) = batch(d);
            let loss = |m: &parallel::Llama| m.loss(x.clone(), y.clone());
            let (model, losses, grads) = train(model, args.steps, tp, loss)?;
            // The trained weights back as the plain model's record.
            let after = loss(&model)?.into_scalar::<f32>();
            save_gathered(&model, &trained, tp)?;
            Ok::<_, TpError>((losses, grads, tokens, after))
        },
    )?;
    // TP × PP: each stage reads only its layers' shards of the same record.
    let stages = launch::threads(
        &ParallelConfig::new(args.tp * args.pp, args.tp, args.pp),
        LaunchOptions::default(),
        |ctx| pipeline_rank(ctx, &config, &source, args.steps),
    )?;
    let mut pipelined = (Vec::new(), ByPath::new());
    for (losses, grads) in stages {
        pipelined.0 = losses.unwrap_or(pipelined.0);
        pipelined.1.extend(grads);
    }
    let memory = loading_memory(&dir, args.tp)?;
    let (parallel, parallel_grads, parallel_tokens, after) =
        ranks.into_iter().next().expect("a rank");
    // The plain model, loaded with Burn's own `load_file` from what the split one saved.
    let reloaded = plain::Llama::load(&config, &trained, &ad);
    let reloaded = reloaded.loss(x.clone(), y.clone()).into_scalar::<f32>();
    std::fs::remove_dir_all(&dir)?;

    println!("{memory}");
    println!("greedy tokens TP=1:  {tokens:?}");
    println!("greedy tokens TP={}: {parallel_tokens:?}", args.tp);
    let worst_loss = print_losses(&format!("TP={}", args.tp), &single, &parallel);
    let (worst_grad, name) = worst(&plain_grads, &parallel_grads);
    println!("largest relative gradient difference (step 0): {worst_grad:.2e} ({name})");
    let layout = format!("TP={}×PP={}", args.tp, args.pp);
    let worst_pp_loss = print_losses(&layout, &single, &pipelined.0);
    let (worst_pp_grad, pp_name) = worst(&plain_grads, &pipelined.1);
    println!(
        "largest relative gradient difference (step 0, {layout}): {worst_pp_grad:.2e} ({pp_name})"
    );
    let saved = (reloaded - after).abs();
    println!(
        "trained at TP={}, saved with save_gathered, loaded by the plain model: loss {reloaded:.6} \
         (TP={}: {after:.6}, |diff| {saved:.2e})",
        args.tp, args.tp
    );
    if saved.is_nan() || saved > TOLERANCE {
        return Err("the plain model loaded from save_gathered's record differs".into());
    }
    // Written so that a NaN fails too.
    if !(worst_loss <= TOLERANCE && worst_grad <= TOLERANCE) {
        return Err(format!(
            "TP={} differs from TP=1 by more than {TOLERANCE:e}",
            args.tp
        )
        .into());
    }
    if pipelined.0.len() != single.len()
        || !(worst_pp_loss <= TOLERANCE && worst_pp_grad <= TOLERANCE)
    {
        return Err(format!("{layout} differs from TP=1 by more than {TOLERANCE:e}").into());
    }
    if tokens != parallel_tokens {
        return Err(format!("TP={} generated other tokens than TP=1", args.tp).into());
    }
    Ok(())
}
