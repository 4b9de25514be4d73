//! What each rank of a run will hold, before launching: `plan gpt` takes `gpt_pretrain`'s
//! flags, `plan bert` `bert_pretrain`'s (validated by the same code, so a refused layout is
//! refused with the same message), the vocabulary taken from `--vocab-size` as Megatron
//! does; nothing is built, no tokenizer trained.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example plan -- gpt \
//!     --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
//!     --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 --vocab-size 32000 \
//!     --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --world-size 64 \
//!     --bf16 --use-distributed-optimizer --device-memory 80GiB
//! plan … --json                                  # one JSON object
//! plan … --search --world-size 64 --device-memory 80GiB   # the layouts that fit, ranked
//! ```
//!
//! The search's step-time model: `FLOPs per rank / --device-flops × (1 + bubble) +
//! bytes sent per rank / --link-bandwidth` (compute and communication not overlapped,
//! one bandwidth for every link); it ranks layouts, it does not predict seconds.

use burn_megatron::recompute::RecomputeModule;
use burn_megatron_examples::plan::{Setup, StagePlan};
use burn_megatron_examples::pretrain::{Args as BertArgs, GptArgs, Granularity, Method, TrainArgs};
use clap::{Parser, Subcommand};

#[derive(Debug, Clone, Parser)]
#[command(name = "plan")]
struct Cli {
    #[command(subcommand)]
    model: Model,
}

#[derive(Debug, Clone, Subcommand)]
enum Model {
    /// A GPT-family run: `gpt_pretrain`'s flags.
    Gpt {
        #[command(flatten)]
        args: Box<GptArgs>,
        #[command(flatten)]
        opts: Opts,
    },
    /// A BERT run: `bert_pretrain`'s flags.
    Bert {
        #[command(flatten)]
        args: Box<BertArgs>,
        #[command(flatten)]
        opts: Opts,
    },
}

#[derive(Debug, Clone, clap::Args)]
struct Opts {
    /// Memory of one device, e.g. `80GiB`, `512MiB`, or bytes.
    #[arg(long, value_parser = parse_bytes)]
    device_memory: Option<u64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// List the layouts of `--world-size` ranks that fit `--device-memory`, fastest first.
    #[arg(long)]
    search: bool,
    /// FLOP/s of one device, for the search's ranking.
    #[arg(long, default_value_t = 400e12)]
    device_flops: f64,
    /// Bytes/s of one link, for the search's ranking.
    #[arg(long, default_value_t = 100e9)]
    link_bandwidth: f64,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let units = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("B", 1),
    ];
    let (number, unit) = units
        .iter()
        .find_map(|(u, m)| s.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((s, 1));
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 80GiB"))?;
    if !(value.is_finite() && value > 0.0) {
        return Err(format!("{s:?}: a device's memory must be positive"));
    }
    Ok((value * unit as f64) as u64)
}

fn gib(bytes: u64) -> String {
    format!("{:.3} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn stage_json(s: &StagePlan) -> serde_json::Value {
    serde_json::json!({
        "stage": s.stage,
        "parameters": s.parameters,
        "weight_bytes": s.weight_bytes,
        "gradient_bytes": s.gradient_bytes,
        "optimizer_bytes": s.optimizer_bytes,
        "activation_bytes": s.activation_bytes,
        "activation_bytes_without_sp_or_recompute": s.activation_bytes_plain,
        "in_flight_microbatches": s.in_flight_microbatches,
        "transient_bytes": s.transient_bytes,
        "total_bytes": s.total_bytes,
        "sent_bytes": {
            "tensor_parallel": s.sent_bytes[0],
            "pipeline_parallel": s.sent_bytes[1],
            "data_parallel": s.sent_bytes[2],
            "context_parallel": s.sent_bytes[3],
        },
    })
}

fn print_table(setup: &Setup, stages: &[StagePlan], device: Option<u64>) {
    println!(
        "{:>5} {:>13} {:>11} {:>11} {:>11} {:>13} {:>13} {:>9} {:>11} {:>11}",
        "stage",
        "params/rank",
        "weights",
        "grads",
        "optimizer",
        "act/mb",
        "act/mb plain",
        "in flight",
        "transient",
        "total"
    );
    for s in stages {
        println!(
            "{:>5} {:>13} {:>11} {:>11} {:>11} {:>13} {:>13} {:>9} {:>11} {:>11}",
            s.stage,
            s.parameters,
            gib(s.weight_bytes),
            gib(s.gradient_bytes),
            gib(s.optimizer_bytes),
            gib(s.activation_bytes),
            gib(s.activation_bytes_plain),
            s.in_flight_microbatches,
            gib(s.transient_bytes),
            gib(s.total_bytes)
        );
    }
    for s in stages {
        let [tp, pp, dp, cp] = s.sent_bytes;
        println!(
            " stage {}: sends per step TP {} | PP {} | DP {} | CP {}",
            s.stage,
            gib(tp),
            gib(pp),
            gib(dp),
            gib(cp)
        );
    }
    println!(
        " pipeline bubble: {:.1}% of the ideal step",
        100.0 * setup.bubble()
    );
    if let Some(d) = device {
        let worst = stages.iter().map(|s| s.total_bytes).max().unwrap_or(0);
        let verdict = if worst <= d { "fits" } else { "does NOT fit" };
        println!(" largest rank {} of {}: {verdict}", gib(worst), gib(d));
    }
}

/// Builds a setup from the run's flags with its `TrainArgs` replaced.
type Make<'a> = &'a dyn Fn(TrainArgs) -> Result<Setup, String>;

/// Every layout of `world` ranks the flags allow, each with its plan.
fn search(train: &TrainArgs, make: Make<'_>) -> Vec<(String, Setup, Vec<StagePlan>)> {
    // Context parallelism stays as the flags set it; the rest of the world is searched.
    let cp = train.context_parallel_size;
    let world = train.world_size / cp;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for tp in divisors(world) {
        // Layers that do not split (evenly, or as the flags' uneven split says) are refused
        // by the validation below.
        for pp in divisors(world / tp) {
            // A --pipeline-model-parallel-layout fixes P·V: only its own model chunks.
            let chunks = match train.pipeline_model_parallel_layout {
                Some(l) if l.num_stages().is_multiple_of(pp) => vec![l.num_stages() / pp],
                Some(_) => Vec::new(),
                None => vec![1, 2, 4],
            };
            for vp in chunks.into_iter().filter(|&v| v == 1 || pp > 1) {
                for (recompute, name) in [
                    (None, "none"),
                    (Some(Granularity::Selective), "selective"),
                    (Some(Granularity::Full), "full"),
                ] {
                    for zero in [false, true] {
                        let mut t = train.clone();
                        t.tensor_model_parallel_size = tp;
                        t.pipeline_model_parallel_size = pp;
                        t.num_layers_per_virtual_pipeline_stage = None;
                        t.num_virtual_stages_per_pipeline_rank = (vp > 1).then_some(vp);
                        t.recompute_granularity = recompute;
                        t.recompute_method =
                            (recompute == Some(Granularity::Full)).then_some(Method::Uniform);
                        t.recompute_num_layers =
                            (recompute == Some(Granularity::Full)).then_some(1);
                        t.recompute_modules = vec![RecomputeModule::CoreAttn];
                        t.use_distributed_optimizer = zero;
                        if zero && cp * world / (tp * pp) == 1 {
                            continue;
                        }
                        // The same validation as the example's: refused layouts are skipped.
                        let Ok(setup) = make(t) else {
                            continue;
                        };
                        let Ok(plan) = setup.plan() else {
                            continue;
                        };
                        let label = format!(
                            "TP {tp} PP {pp} VP {vp}{} DP {} recompute {name}{}",
                            if cp > 1 {
                                format!(" CP {cp}")
                            } else {
                                String::new()
                            },
                            world / (tp * pp),
                            if zero { " distributed-optimizer" } else { "" }
                        );
                        out.push((label, setup, plan));
                    }
                }
            }
        }
    }
    out
}

fn main() -> std::process::ExitCode {
    let result = match Cli::parse().model {
        Model::Gpt { args, opts } => {
            let make = |train: TrainArgs| {
                let vocab = train.vocab_size;
                Setup::new(
                    &GptArgs {
                        train,
                        ..(*args).clone()
                    },
                    vocab,
                )
            };
            run(&args.train, &make, &opts)
        }
        Model::Bert { args, opts } => {
            let make = |train: TrainArgs| {
                let vocab = train.vocab_size;
                Setup::new_bert(
                    &BertArgs {
                        train,
                        ..(*args).clone()
                    },
                    vocab,
                )
            };
            run(&args.train, &make, &opts)
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(train: &TrainArgs, make: Make<'_>, opts: &Opts) -> Result<(), String> {
    if opts.search {
        return run_search(train, make, opts);
    }
    let setup = make(train.clone())?;
    let stages = setup.plan()?;
    let args = opts;
    if args.json {
        let json = serde_json::json!({
            "stages": stages.iter().map(stage_json).collect::<Vec<_>>(),
            "pipeline_bubble": setup.bubble(),
            "device_memory": args.device_memory,
            "fits": args.device_memory.map(|d| stages.iter().all(|s| s.total_bytes <= d)),
        });
        println!("{json}");
    } else {
        print_table(&setup, &stages, args.device_memory);
    }
    Ok(())
}

fn run_search(train: &TrainArgs, make: Make<'_>, args: &Opts) -> Result<(), String> {
    let Some(device) = args.device_memory else {
        return Err("--search needs --device-memory".into());
    };
    let mut fits: Vec<(f64, String, u64)> = search(train, make)
        .into_iter()
        .filter_map(|(label, setup, plan)| {
            let worst = plan.iter().map(|s| s.total_bytes).max()?;
            let sent = plan
                .iter()
                .map(|s| s.sent_bytes.iter().sum::<u64>())
                .max()?;
            let time = setup.flops_per_rank() / args.device_flops * (1.0 + setup.bubble())
                + sent as f64 / args.link_bandwidth;
            (worst <= device).then_some((time, label, worst))
        })
        .collect();
    if fits.is_empty() {
        return Err(format!(
            "no layout of {} ranks fits {} per device",
            train.world_size,
            gib(device)
        ));
    }
    fits.sort_by(|a, b| a.0.total_cmp(&b.0));
    println!(
        "layouts of {} ranks that fit {} (estimated step = FLOPs/rank ÷ {:.0e} FLOP/s × (1 + bubble) + bytes sent/rank ÷ {:.0e} B/s):",
        train.world_size,
        gib(device),
        args.device_flops,
        args.link_bandwidth
    );
    for (time, label, worst) in &fits {
        println!(
            " {:>10.3} s  {:<64} largest rank {}",
            time,
            label,
            gib(*worst)
        );
    }
    Ok(())
}
