//! `bert_pretrain` and `gpt_pretrain` as a library, so tests can run them in-process: parse
//! [`Args`] (BERT) or [`GptArgs`], then [`run`] or [`run_gpt`].
//!
//! Both share one training loop (`train.rs`): a model family ([`Family`]) says how to build
//! a pipeline chunk, how to name its parameters globally, and how one microbatch runs and
//! is scored; everything else — the layout, the schedule, the optimizer, checkpoints,
//! validation, the log — is the loop's. The `train_minimal` example is the same loop in one
//! screen, without flags.

mod args;
mod bert;
mod data;
mod device;
mod gpt;
mod gpt_args;
mod learner;
mod moe_args;
mod plot;
mod setup;
mod spans;
mod train;

pub use args::{
    AttentionBackend, CpCommType, DecayStyle, Domain, Granularity, Method, TrainArgs, WdIncr,
    check_float,
};
pub use bert::{Args, run};
pub use gpt::{run_gpt, run_gpt_learner};
pub use gpt_args::{GptArgs, LLAMA_STYLE, PositionEmbedding};
pub use learner::{LearnerOptions, Renderer};
pub use moe_args::{Dispatcher, MoeArgs, RouterScore, TokenDrop};
pub use setup::scheduler;

use burn::module::Module;
use burn::tensor::Device;
use burn_megatron::context_parallel::ContextParallel;
use burn_megatron::data::{BatchLayout, Document, load_corpus, synthetic_corpus};
use burn_megatron::launch::{
    DistributedBackend, LaunchEnv, LaunchOptions, RankContext, from_env, threads,
};
use burn_megatron::pipeline::{
    ChunkOutput, ForwardStep, Span, StageError, chrome_trace, idle_fractions,
};
use burn_megatron::tensor_parallel::RngTracker;
use burn_megatron::topology::PipelinePosition;
use data::DataSource;
pub use device::TrainDevice;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use train::RankOutput;

/// One iteration, as logged.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationLog {
    /// Iterations done (1-based).
    pub iteration: usize,
    /// Samples consumed so far.
    pub consumed_samples: usize,
    /// Learning rate of this step.
    pub lr: f64,
    /// Language-model loss (mean over the global batch's micro-batches).
    pub lm_loss: f64,
    /// BERT's sentence-order loss.
    pub sop_loss: Option<f64>,
    /// Global gradient norm (None when the step was skipped).
    pub grad_norm: Option<f64>,
    /// Loss scale of this step.
    pub loss_scale: f64,
    /// Skipped (overflowed) iterations so far.
    pub skipped_iterations: usize,
    /// Wall time of the iteration.
    pub ms_per_iter: f64,
    /// Training tokens per second.
    pub tokens_per_s: f64,
    /// Mixture of experts: what the MoE layers saw this iteration.
    pub moe: Option<MoeLog>,
}

/// What a model's MoE layers saw in one iteration, over all layers, micro-batches and
/// data-parallel replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeLog {
    /// The mean load-balancing loss without its coefficient (about 1 when balanced; `None`
    /// when `--moe-aux-loss-coeff` is 0).
    pub load_balancing_loss: Option<f64>,
    /// Each expert's share of the routed tokens.
    pub expert_token_share: Vec<f64>,
}

impl MoeLog {
    /// Tokens of the busiest expert over the mean: 1 when balanced.
    pub fn max_over_mean(&self) -> f64 {
        let n = self.expert_token_share.len().max(1) as f64;
        self.expert_token_share
            .iter()
            .fold(0.0f64, |m, &s| m.max(s))
            * n
    }
}

/// One validation: iteration, lm loss and (BERT) sentence-order loss.
pub type Eval = (usize, f64, Option<f64>);

/// What a run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Every iteration of this run (resumed runs start after the checkpoint).
    pub log: Vec<IterationLog>,
    /// Each validation.
    pub evals: Vec<Eval>,
    /// Wall time, data preparation included.
    pub wall: Duration,
    /// Each rank's measured memory peak, (global rank, pipeline rank, bytes): every rank's
    /// with threads, this process's with one process per rank.
    pub peaks: Vec<train::RankPeak>,
    /// What the model family said after training (GPT: a sample per prompt), as global
    /// rank 0 printed it (this process's rank with one process per rank).
    pub said: Vec<String>,
}

/// Which samples a microbatch reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The training set.
    Train,
    /// The validation set.
    Valid,
}

/// A model family the shared loop trains: BERT or GPT.
pub trait Family: Send + Sync + 'static {
    /// One pipeline model chunk.
    type Chunk: Module + Clone + Send + Sync + std::fmt::Debug + 'static;

    /// The example's name (`bert_pretrain`), for files and the plot.
    fn example(&self) -> &'static str;
    /// The first line printed: the model, the layout, the data.
    fn header(&self) -> String;
    /// Whether the loss has a second, sentence-order part (BERT).
    fn has_sop(&self) -> bool;
    /// This rank's chunk at `position`.
    fn init_chunk(
        &self,
        ctx: &RankContext,
        position: PipelinePosition,
    ) -> Result<Self::Chunk, String>;
    /// The global index of a chunk's first layer.
    fn first_layer(chunk: &Self::Chunk) -> usize;
    /// The global index of this rank's first expert in each MoE layer (0 without experts).
    fn first_expert(_chunk: &Self::Chunk) -> usize {
        0
    }
    /// The model's mixture-of-experts settings (`None`: a dense model).
    fn moe(&self) -> Option<&burn_megatron::moe::MoeConfig> {
        None
    }
    /// Each MoE layer's stats since they were last taken (and counting afresh).
    fn take_moe_stats(_chunks: &[Self::Chunk]) -> Vec<burn_megatron::moe::MoeLayerStats> {
        Vec::new()
    }
    /// The global name of the parameter at `path` of chunks whose first layers are `first`.
    fn global_name(first: &[usize], path: &str) -> String;
    /// One microbatch (samples `samples` of `split`) through `step.model`: its activation,
    /// or on the last stage its loss and reported values (lm, and sop for BERT).
    #[allow(clippy::too_many_arguments)]
    fn forward_step(
        &self,
        step: ForwardStep<'_, Self::Chunk, 3>,
        split: Split,
        samples: Range<usize>,
        rng: Option<&RngTracker>,
        cp: Option<&ContextParallel>,
        device: &Device,
    ) -> Result<ChunkOutput<3>, StageError>;
    /// After the last iteration, on every rank, with its trained chunks (e.g. generate
    /// samples, write a Hugging Face directory); returns the lines global rank 0 prints.
    fn finish(&self, _ctx: &RankContext, _chunks: &[Self::Chunk]) -> Result<Vec<String>, String> {
        Ok(Vec::new())
    }
}

/// What every rank reads: arguments, the model family with its data, the progress display.
pub struct Shared<F: Family> {
    args: TrainArgs,
    layout: BatchLayout,
    family: F,
    progress: ProgressBar,
    /// Every rank's timeline is measured from here.
    epoch: Instant,
}

impl<F: Family> Shared<F> {
    fn println(&self, line: String) {
        if self.progress.is_hidden() {
            println!("{line}");
        } else {
            self.progress.println(line);
        }
    }

    fn report(&self, e: &IterationLog) {
        self.progress.set_position(e.iteration as u64);
        self.progress.set_message(format!(
            "lm loss {:.3} | {:.0} tok/s",
            e.lm_loss, e.tokens_per_s
        ));
        if e.iteration.is_multiple_of(self.args.log_interval)
            || e.iteration == self.args.train_iters
        {
            self.println(log_line(e, &self.args));
        }
    }
}

/// Megatron's training log line.
pub fn log_line(e: &IterationLog, args: &TrainArgs) -> String {
    let norm = e.grad_norm.map_or("-".to_string(), |n| format!("{n:.3}"));
    let sop = e
        .sop_loss
        .map_or(String::new(), |s| format!(" sop loss: {s:.6E} |"));
    let moe = e.moe.as_ref().map_or(String::new(), |m| {
        let lb = m.load_balancing_loss.map_or(String::new(), |l| {
            format!(" load balancing loss: {l:.6E} |")
        });
        let shares: Vec<String> = m
            .expert_token_share
            .iter()
            .map(|s| format!("{:.1}", 100.0 * s))
            .collect();
        format!(
            "{lb} expert token share (%): {} | expert tokens max/mean: {:.3} |",
            shares.join(" "),
            m.max_over_mean()
        )
    });
    format!(
        " iteration {:>8}/{:>8} | consumed samples: {:>10} | elapsed time per iteration (ms): {:.1} | \
         learning rate: {:.6E} | global batch size: {:>5} | lm loss: {:.6E} |{sop} \
         loss scale: {:.1} | grad norm: {norm} | number of skipped iterations: {:>3} | tokens/s: {:.0} |{moe}",
        e.iteration,
        args.train_iters,
        e.consumed_samples,
        e.ms_per_iter,
        e.lr,
        args.global_batch_size,
        e.lm_loss,
        e.loss_scale,
        e.skipped_iterations,
        e.tokens_per_s,
    )
}

/// The training and validation documents of a corpus (none for Megatron datasets): the
/// last ~3 % (at least one) validate, as Megatron's split.
fn corpus(args: &TrainArgs) -> Result<(Vec<Document>, Vec<Document>), String> {
    let mut docs = match args.data_source()? {
        DataSource::Corpus(p) => load_corpus(&p).map_err(|e| e.to_string())?,
        DataSource::Synthetic => synthetic_corpus(args.synthetic_documents, args.seed),
        DataSource::Megatron(_) => return Ok((Vec::new(), Vec::new())),
    };
    let n_valid = (docs.len() * 3 / 100)
        .max(1)
        .min(docs.len().saturating_sub(1));
    let valid = docs.split_off(docs.len() - n_valid);
    if docs.is_empty() || valid.is_empty() {
        return Err("the corpus needs at least two documents (train and validation)".into());
    }
    Ok((docs, valid))
}

/// Whether this process is global rank 0 (it prints, plots and writes shared files): always
/// with threads; with one process per rank, the launcher must agree with the layout first.
fn is_leader(args: &TrainArgs) -> Result<bool, String> {
    match args.distributed_backend {
        DistributedBackend::Threads => Ok(true),
        backend => {
            let env = LaunchEnv::from_env()
                .map_err(|e| format!("--distributed-backend {backend}: {e}"))?;
            if env.world_size != args.world_size {
                return Err(format!(
                    "--distributed-backend {backend}: {} started {} processes but --world-size is {}",
                    env.launcher, env.world_size, args.world_size
                ));
            }
            Ok(env.rank == 0)
        }
    }
}

/// The layout part of the header: `TP 2 × PP 1 × DP 1 + SP`, and each virtual stage's
/// layers under an uneven split (`PP 3 (layers 1+2+1)`).
fn layout_line(args: &TrainArgs) -> String {
    let uneven = match args.layers_per_virtual_stage() {
        Ok(layers) if layers.windows(2).any(|w| w[0] != w[1]) => {
            let layers: Vec<String> = layers.iter().map(usize::to_string).collect();
            format!(" layers {}", layers.join("+"))
        }
        _ => String::new(),
    };
    format!(
        "TP {} × PP {}{}{} × DP {}{}",
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        match (args.num_model_chunks(), uneven.is_empty()) {
            (1, true) => String::new(),
            (1, false) => format!(" ({})", uneven.trim_start()),
            (v, _) => format!(" (V {v}{uneven})"),
        },
        match args.context_parallel_size {
            1 => String::new(),
            cp => format!(" × CP {cp}"),
        },
        args.data_parallel_size(),
        if args.sequence_parallel_on() {
            " + SP"
        } else {
            ""
        },
    )
}

fn precision(args: &TrainArgs) -> &'static str {
    if args.bf16 {
        "bf16"
    } else if args.fp16 {
        "fp16"
    } else {
        "fp32"
    }
}

/// Writes every rank's spans of the last iteration as a Chrome trace at `path` and as a PNG
/// beside it, and prints each rank's idle fraction.
fn write_timeline(path: &std::path::Path, ranks: &[Vec<Span>]) -> Result<(), String> {
    std::fs::write(path, chrome_trace(ranks))
        .map_err(|e| format!("--timeline {}: {e}", path.display()))?;
    let png = path.with_extension("png");
    plot::timeline(&png, ranks)?;
    let idle: Vec<String> = idle_fractions(ranks)
        .iter()
        .map(|f| format!("{f:.2}"))
        .collect();
    println!(
        "> timeline of the last iteration in {} and {} | idle fraction per rank: {}",
        path.display(),
        png.display(),
        idle.join(" ")
    );
    Ok(())
}

/// One JSON object per iteration, every field at full precision.
fn write_log_json(path: &std::path::Path, log: &[IterationLog]) -> Result<(), String> {
    let lines: Vec<String> = log
        .iter()
        .map(|e| {
            serde_json::json!({
                "iteration": e.iteration,
                "consumed_samples": e.consumed_samples,
                "lr": e.lr,
                "lm_loss": e.lm_loss,
                "sop_loss": e.sop_loss,
                "grad_norm": e.grad_norm,
                "loss_scale": e.loss_scale,
                "skipped_iterations": e.skipped_iterations,
                "ms_per_iter": e.ms_per_iter,
                "tokens_per_s": e.tokens_per_s,
                "load_balancing_loss": e.moe.as_ref().and_then(|m| m.load_balancing_loss),
                "expert_token_share": e.moe.as_ref().map(|m| m.expert_token_share.clone()),
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n")
        .map_err(|e| format!("--log-json {}: {e}", path.display()))
}

/// Reads the log a run wrote with `--log-json`.
pub fn read_log_json(path: &std::path::Path) -> Result<Vec<IterationLog>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
            let f = |k: &str| v[k].as_f64().ok_or(format!("{k} missing in {line}"));
            let u = |k: &str| {
                v[k].as_u64()
                    .map(|x| x as usize)
                    .ok_or(format!("{k} missing in {line}"))
            };
            Ok(IterationLog {
                iteration: u("iteration")?,
                consumed_samples: u("consumed_samples")?,
                lr: f("lr")?,
                lm_loss: f("lm_loss")?,
                sop_loss: v["sop_loss"].as_f64(),
                grad_norm: v["grad_norm"].as_f64(),
                loss_scale: f("loss_scale")?,
                skipped_iterations: u("skipped_iterations")?,
                ms_per_iter: f("ms_per_iter")?,
                tokens_per_s: f("tokens_per_s")?,
                moe: v["expert_token_share"].as_array().map(|shares| MoeLog {
                    load_balancing_loss: v["load_balancing_loss"].as_f64(),
                    expert_token_share: shares.iter().filter_map(|s| s.as_f64()).collect(),
                }),
            })
        })
        .collect()
}

/// Trains `family` under `args` (already validated into `layout`) and returns the log of
/// global rank 0: the part of a run both examples share.
/// How one rank trains: our loop ([`train::train_rank`]) or burn-train's Learner.
type RankFn<'a, F> =
    &'a (dyn Fn(RankContext, &Arc<Shared<F>>) -> Result<RankOutput, String> + Sync);

fn train_family<F: Family>(
    args: &TrainArgs,
    layout: BatchLayout,
    family: F,
    leader: bool,
    start: Instant,
    rank: RankFn<'_, F>,
) -> Result<Summary, String> {
    let parallel = args.parallel_config()?;
    if leader {
        println!("{}", family.header());
    }
    let progress = if args.no_progress || !leader {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::with_draw_target(
            Some(args.train_iters as u64),
            ProgressDrawTarget::stderr(),
        );
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .map_err(|e| e.to_string())?,
        );
        bar
    };
    let loss_plot = args
        .loss_plot
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}_loss.png", family.example())));
    let shared = Arc::new(Shared {
        args: args.clone(),
        layout,
        family,
        progress,
        epoch: Instant::now(),
    });
    let mut options = LaunchOptions::default()
        .with_backend(args.distributed_backend)
        .with_timeout(args.distributed_timeout());
    if args.device != TrainDevice::Cpu && args.distributed_backend != DistributedBackend::Nccl {
        let device = args.device.resolve()?;
        options = options.with_device(move |_| device.clone());
    }
    // ANCHOR: launch
    let (log, evals, peaks, said) = match args.distributed_backend {
        DistributedBackend::Threads => {
            let train = |ctx| rank(ctx, &shared);
            let outputs = threads(&parallel, options, train).map_err(|e| e.to_string())?;
            if let Some(path) = &args.timeline {
                let ranks: Vec<Vec<Span>> = outputs.iter().map(|o| o.spans.clone()).collect();
                write_timeline(path, &ranks)?;
            }
            let peaks = outputs.iter().map(|o| o.peak).collect();
            let first = outputs.into_iter().next().expect("a layout has ranks");
            (first.log, first.evals, peaks, first.said)
        }
        _ => from_env(&parallel, options, |ctx| {
            let world = ctx.groups.world.clone();
            let out = rank(ctx, &shared)?;
            // Every process's spans to rank 0, while the communicators still exist.
            if let Some(path) = &args.timeline {
                let ranks = spans::gather(&world, &out.spans, shared.epoch)?;
                if leader {
                    write_timeline(path, &ranks)?;
                }
            }
            Ok::<_, String>(out)
        })
        .map(|out| (out.log, out.evals, vec![out.peak], out.said))
        .map_err(|e| e.to_string())?,
    };
    // ANCHOR_END: launch
    shared.progress.finish_and_clear();
    if let Some(path) = args.log_json.as_ref().filter(|_| leader) {
        write_log_json(path, &log)?;
    }
    if let Some(first) = log.first().filter(|_| leader) {
        plot::loss_curve(&loss_plot, shared.family.example(), &log, &evals)?;
        let last = log.last().unwrap_or(first);
        println!(
            "> done: lm loss {:.4} → {:.4} over iterations {}–{} in {:.1} s; loss curve in {}",
            first.lm_loss,
            last.lm_loss,
            first.iteration,
            last.iteration,
            start.elapsed().as_secs_f64(),
            loss_plot.display()
        );
    }
    Ok(Summary {
        log,
        evals,
        wall: start.elapsed(),
        peaks,
        said,
    })
}
