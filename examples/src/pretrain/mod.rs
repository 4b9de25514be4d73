//! The `bert_pretrain` example as a library, so tests can run it in-process: parse
//! [`Args`], then [`run`].

mod args;
mod plot;
mod spans;
mod train;

pub use args::{Args, DecayStyle, WdIncr};
pub use train::scheduler;

use burn::config::Config;
use burn_megatron::data::{
    BatchLayout, BertDataset, BertDatasetConfig, BertTokenizer, Document, load_corpus,
    synthetic_corpus, synthetic_vocabulary,
};
use burn_megatron::launch::{DistributedBackend, LaunchEnv, LaunchOptions, from_env, threads};
use burn_megatron::models::BertConfig;
use burn_megatron::pipeline::{Span, chrome_trace, idle_fractions};
use burn_megatron::tensor_parallel::padded_vocab_size;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::time::{Duration, Instant};

/// One iteration, as logged.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationLog {
    /// Iterations done (1-based).
    pub iteration: usize,
    /// Samples consumed so far.
    pub consumed_samples: usize,
    /// Learning rate of this step.
    pub lr: f64,
    /// MLM loss (mean over the global batch's micro-batches).
    pub lm_loss: f64,
    /// Sentence-order loss.
    pub sop_loss: f64,
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
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Every iteration of this run (resumed runs start after the checkpoint).
    pub log: Vec<IterationLog>,
    /// (iteration, lm loss, sop loss) of each validation.
    pub evals: Vec<(usize, f64, f64)>,
    /// Wall time, data preparation included.
    pub wall: Duration,
}

/// What every rank reads: arguments, data and the progress display.
pub struct Shared {
    args: Args,
    layout: BatchLayout,
    model_config: BertConfig,
    train: BertDataset,
    valid: BertDataset,
    progress: ProgressBar,
    /// Every rank's timeline is measured from here.
    epoch: Instant,
}

impl Shared {
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
pub fn log_line(e: &IterationLog, args: &Args) -> String {
    let norm = e.grad_norm.map_or("-".to_string(), |n| format!("{n:.3}"));
    format!(
        " iteration {:>8}/{:>8} | consumed samples: {:>10} | elapsed time per iteration (ms): {:.1} | \
         learning rate: {:.6E} | global batch size: {:>5} | lm loss: {:.6E} | sop loss: {:.6E} | \
         loss scale: {:.1} | grad norm: {norm} | number of skipped iterations: {:>3} | tokens/s: {:.0} |",
        e.iteration,
        args.train_iters,
        e.consumed_samples,
        e.ms_per_iter,
        e.lr,
        args.global_batch_size,
        e.lm_loss,
        e.sop_loss,
        e.loss_scale,
        e.skipped_iterations,
        e.tokens_per_s,
    )
}

fn corpus(args: &Args) -> Result<Vec<Document>, String> {
    match &args.data_path {
        Some(p) => load_corpus(p).map_err(|e| e.to_string()),
        None => Ok(synthetic_corpus(args.synthetic_documents, args.seed)),
    }
}

/// The tokenizer: `--vocab-file`; else the one saved with the checkpoint being loaded;
/// else the built-in generator's fixed vocabulary; else one trained on the corpus (and
/// saved with the checkpoints, since training can differ between processes).
fn tokenizer(args: &Args, docs: &[Document], leader: bool) -> Result<BertTokenizer, String> {
    let saved = args
        .load
        .as_ref()
        .map(|d| d.join("tokenizer.json"))
        .filter(|p| p.is_file());
    let tokenizer = match (&args.vocab_file, &saved, &args.data_path) {
        (Some(p), _, _) | (None, Some(p), _) => BertTokenizer::from_file(p.as_path()),
        (None, None, None) => BertTokenizer::from_vocab(synthetic_vocabulary()),
        (None, None, Some(_)) => BertTokenizer::train(docs, args.vocab_size),
    }
    .map_err(|e| e.to_string())?;
    if let Some(dir) = args.save.as_ref().filter(|_| leader) {
        std::fs::create_dir_all(dir).map_err(|e| format!("--save {}: {e}", dir.display()))?;
        tokenizer
            .save(&dir.join("tokenizer.json"))
            .map_err(|e| e.to_string())?;
    }
    Ok(tokenizer)
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
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n")
        .map_err(|e| format!("--log-json {}: {e}", path.display()))
}

/// Reads what [`write_log_json`] wrote (`--log-json`).
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
                sop_loss: f("sop_loss")?,
                grad_norm: v["grad_norm"].as_f64(),
                loss_scale: f("loss_scale")?,
                skipped_iterations: u("skipped_iterations")?,
                ms_per_iter: f("ms_per_iter")?,
                tokens_per_s: f("tokens_per_s")?,
            })
        })
        .collect()
}

/// Validates `args`, prepares the data and trains; returns the log of global rank 0.
pub fn run(args: &Args) -> Result<Summary, String> {
    let start = Instant::now();
    let layout = args.validate()?;
    let parallel = args.parallel_config()?;
    // One process per rank: the launcher must agree with the layout before any work, and
    // only global rank 0 prints, plots and writes shared files.
    let leader = match args.distributed_backend {
        DistributedBackend::Threads => true,
        backend => {
            let env = LaunchEnv::from_env()
                .map_err(|e| format!("--distributed-backend {backend}: {e}"))?;
            if env.world_size != args.world_size {
                return Err(format!(
                    "--distributed-backend {backend}: {} started {} processes but --world-size is {}",
                    env.launcher, env.world_size, args.world_size
                ));
            }
            env.rank == 0
        }
    };
    let mut docs = corpus(args)?;
    // Megatron-style split: the last ~3 % of documents (at least one) for validation.
    let n_valid = (docs.len() * 3 / 100)
        .max(1)
        .min(docs.len().saturating_sub(1));
    let valid_docs = docs.split_off(docs.len() - n_valid);
    if docs.is_empty() || valid_docs.is_empty() {
        return Err("the corpus needs at least two documents (train and validation)".into());
    }
    let tokenizer = tokenizer(args, &docs, leader)?;
    let data_config = BertDatasetConfig::new(args.seq_length).with_seed(args.seed);
    let train =
        BertDataset::new(&docs, &tokenizer, data_config.clone()).map_err(|e| e.to_string())?;
    let valid = BertDataset::new(
        &valid_docs,
        &tokenizer,
        data_config.with_seed(args.seed.wrapping_add(1)),
    )
    .map_err(|e| e.to_string())?;
    let tp = args.tensor_model_parallel_size;
    let model_config = BertConfig::new(
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.ffn_hidden_size.unwrap_or(4 * args.hidden_size),
        args.max_position_embeddings.unwrap_or(args.seq_length),
        padded_vocab_size(
            tokenizer.vocab_size(),
            args.make_vocab_size_divisible_by,
            tp,
        ),
    )
    .with_hidden_dropout(args.hidden_dropout)
    .with_attention_dropout(args.attention_dropout)
    .with_sequence_parallel(args.sequence_parallel)
    .with_gradient_accumulation_fusion(args.gradient_accumulation_fusion)
    .with_init_method_std(args.init_method_std)
    .with_seed(args.seed);
    // Beside the checkpoints, what the `checkpoint` tool needs to rebuild the model.
    if let Some(dir) = args.save.as_ref().filter(|_| leader) {
        let path = dir.join("bert_config.json");
        model_config
            .save(&path)
            .map_err(|e| format!("--save {}: {e}", path.display()))?;
    }
    let header = format!(
        "> BERT {} layers, hidden {}, {} heads, seq {} | TP {} × PP {}{} × DP {}{} | vocab {} (padded {}) | \
         {} train / {} validation segments | {}",
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        tp,
        args.pipeline_model_parallel_size,
        match args.num_model_chunks() {
            1 => String::new(),
            v => format!(" (V {v})"),
        },
        args.data_parallel_size(),
        if args.sequence_parallel { " + SP" } else { "" },
        tokenizer.vocab_size(),
        model_config.padded_vocab_size,
        train.len(),
        valid.len(),
        if args.bf16 {
            "bf16"
        } else if args.fp16 {
            "fp16"
        } else {
            "fp32"
        },
    );
    if leader {
        println!("{header}");
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
    let shared = Shared {
        args: args.clone(),
        layout,
        model_config,
        train,
        valid,
        progress,
        epoch: Instant::now(),
    };
    let options = LaunchOptions::default()
        .with_backend(args.distributed_backend)
        .with_timeout(args.distributed_timeout());
    let (log, evals, _) = match args.distributed_backend {
        DistributedBackend::Threads => {
            let train = |ctx| train::train_rank(ctx, &shared);
            let outputs = threads(&parallel, options, train).map_err(|e| e.to_string())?;
            if let Some(path) = &args.timeline {
                let ranks: Vec<Vec<Span>> = outputs.iter().map(|o| o.2.clone()).collect();
                write_timeline(path, &ranks)?;
            }
            outputs.into_iter().next().expect("a layout has ranks")
        }
        _ => from_env(&parallel, options, |ctx| {
            let world = ctx.groups.world.clone();
            let out = train::train_rank(ctx, &shared)?;
            // Every process's spans to rank 0, while the communicators still exist.
            if let Some(path) = &args.timeline {
                let ranks = spans::gather(&world, &out.2, shared.epoch)?;
                if leader {
                    write_timeline(path, &ranks)?;
                }
            }
            Ok::<_, String>(out)
        })
        .map_err(|e| e.to_string())?,
    };
    shared.progress.finish_and_clear();
    if let Some(path) = args.log_json.as_ref().filter(|_| leader) {
        write_log_json(path, &log)?;
    }
    if let Some(first) = log.first().filter(|_| leader) {
        plot::loss_curve(&args.loss_plot, &log, &evals)?;
        let last = log.last().unwrap_or(first);
        println!(
            "> done: lm loss {:.4} → {:.4} over iterations {}–{} in {:.1} s; loss curve in {}",
            first.lm_loss,
            last.lm_loss,
            first.iteration,
            last.iteration,
            start.elapsed().as_secs_f64(),
            args.loss_plot.display()
        );
    }
    Ok(Summary {
        log,
        evals,
        wall: start.elapsed(),
    })
}
