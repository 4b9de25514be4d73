//! Llama-style GPT training throughput at TP = 1, fp32 (grouped-query attention, RoPE,
//! SwiGLU, RMSNorm, untied output layer; seq 256, micro-batch 4, vocabulary 32000; forward +
//! backward + AdamW step, median of the timed steps), with PyTorch eager's step on the same
//! model in the same run (`--torch`: written-out attention, and `torch`'s fused
//! `scaled_dot_product_attention`), the ratios, the step's achieved FLOP/s beside one large
//! f32 matmul's measured in the same run, and where our step's time goes.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example gpt_bench -- --torch
//! ```
//!
//! `--torch` runs `scripts/torch_ref/torch_gpt_ref.py` (PyTorch from pip; dev-only) twice per
//! attention kind: as PyTorch runs by default on a CPU, and with glibc's malloc keeping
//! freed memory as our examples' allocator does (the `⁺` columns, the like-for-like
//! comparison; see `burn_megatron_examples::torch_ref`).

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::models::GptConfig;
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer};
use burn_megatron_examples::median;
use burn_megatron_examples::phases::{PhaseTimes, Run, print_breakdown};
use burn_megatron_examples::torch_ref;
use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Timed steps per run (after two untimed ones); the median is reported.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Also time PyTorch eager's step on each model (`python3` with torch installed).
    #[arg(long)]
    torch: bool,
    /// The PyTorch reference script.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/torch_ref/torch_gpt_ref.py"))]
    torch_script: PathBuf,
    /// Models as LAYERSxHIDDENxHEADSxKV_HEADSxFFN.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "2x256x8x2x704,4x512x8x2x1408"
    )]
    models: Vec<String>,
}

const SEQ: usize = 256;
const MICRO_BATCH: usize = 4;
const VOCAB: usize = 32000;

#[derive(Debug, Clone, Copy)]
struct Shape {
    layers: usize,
    hidden: usize,
    heads: usize,
    groups: usize,
    ffn: usize,
}

impl Shape {
    /// Forward + backward FLOPs of one step (3 × the forward's multiply-adds × 2), the
    /// attention scores over all `s²` pairs as both implementations compute them.
    fn flops(&self) -> f64 {
        let (h, hn) = (self.hidden as f64, (self.hidden / self.heads) as f64);
        let (np, ng, f) = (self.heads as f64, self.groups as f64, self.ffn as f64);
        let tokens = (SEQ * MICRO_BATCH) as f64;
        let per_layer = h * (np + 2.0 * ng) * hn + np * hn * h + 3.0 * h * f;
        let attention = 2.0 * SEQ as f64 * np * hn;
        let forward =
            2.0 * tokens * (self.layers as f64 * (per_layer + attention) + h * VOCAB as f64);
        3.0 * forward
    }

    fn config(&self) -> GptConfig {
        let heads = (self.heads, self.groups);
        burn_megatron_examples::llama(self.layers, self.hidden, heads, self.ffn, SEQ, VOCAB)
    }
}

fn ours(shape: Shape, args: &Args, times: &PhaseTimes) -> Result<Run, Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0)?);
    let mut model = shape.config().init(&tp, &device)?;
    let adam = FusedAdamConfig::new()
        .with_weight_decay(0.01)
        .with_no_weight_decay_on_1d(false);
    let mut optim = MegatronOptimizer::new(adam.init()?, &model, tp.clone(), 0);
    let ints = |f: &dyn Fn(usize) -> i64| {
        let v: Vec<i64> = (0..MICRO_BATCH * SEQ).map(f).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [MICRO_BATCH, SEQ]), &device)
    };
    let ids = ints(&|i| ((i * 7919) % VOCAB) as i64);
    let labels = ints(&|i| ((i * 7919 + 13) % VOCAB) as i64);
    let mask = Tensor::<2>::ones([MICRO_BATCH, SEQ], &device);
    let mut secs = Vec::new();
    for step in 0..args.steps + 2 {
        if step == 2 {
            times.take();
        }
        let t = Instant::now();
        let logits = model.forward(ids.clone())?;
        let loss = model.loss(logits, labels.clone(), mask.clone())?;
        let grads = {
            let _span = tracing::debug_span!("backward").entered();
            GradientsParams::from_grads(loss.backward(), &model)
        };
        let _span = tracing::debug_span!("optimizer").entered();
        model = optim.step(1e-4, model, grads)?.0;
        // The step's end: the last update is read back.
        let _ = model.layers[0].input_layernorm.gamma().val().into_data();
        drop(_span);
        if step >= 2 {
            secs.push(t.elapsed().as_secs_f64());
        }
    }
    let phases = times
        .take()
        .into_iter()
        .map(|(k, v)| (k, v / args.steps as u32))
        .collect();
    Ok(Run {
        step: median(secs),
        phases,
    })
}

fn torch(args: &Args, s: Shape, sdpa: bool, keep: bool) -> Result<f64, String> {
    let mut argv: Vec<String> = [
        s.layers,
        s.hidden,
        s.heads,
        s.groups,
        s.ffn,
        SEQ,
        MICRO_BATCH,
        VOCAB,
        args.steps,
    ]
    .map(|v| v.to_string())
    .into();
    if sdpa {
        argv.push("--sdpa".into());
    }
    torch_ref::step_seconds(&args.torch_script, &argv, keep)
}

/// FLOP/s of one `[n, n] × [n, n]` f32 matmul on Flex, the median of a few.
fn matmul_flops(n: usize) -> f64 {
    let device = Device::flex();
    let a = Tensor::<2>::ones([n, n], &device);
    let b = Tensor::<2>::ones([n, n], &device);
    let secs: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            let _ = a.clone().matmul(b.clone()).into_data();
            t.elapsed().as_secs_f64()
        })
        .collect();
    2.0 * (n as f64).powi(3) / median(secs)
}

fn parse_model(s: &str) -> Result<Shape, String> {
    let v: Vec<usize> = s
        .split('x')
        .map(|p| p.parse::<usize>().map_err(|e| format!("{s}: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [layers, hidden, heads, groups, ffn] => Ok(Shape {
            layers,
            hidden,
            heads,
            groups,
            ffn,
        }),
        _ => Err(format!(
            "a model is LAYERSxHIDDENxHEADSxKV_HEADSxFFN, got {s}"
        )),
    }
}

const PHASES: [(&str, &str); 7] = [
    ("embedding", "gpt.embedding"),
    ("attention", "layer.attention"),
    ("MLP", "layer.mlp"),
    ("output layer", "gpt.output_layer"),
    ("cross-entropy", "gpt.loss"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let models: Vec<Shape> = args
        .models
        .iter()
        .map(|m| parse_model(m))
        .collect::<Result<_, _>>()?;
    let (times, _guard) = PhaseTimes::install();
    let peak = matmul_flops(2048);
    println!(
        "one 2048² f32 matmul on Flex: {:.1} GFLOP/s (the limit below)",
        peak / 1e9
    );
    println!(
        "{:>22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>9} {:>8}",
        "model",
        "eager ms",
        "sdpa ms",
        "eager⁺ ms",
        "sdpa⁺ ms",
        "ours ms",
        "tokens/s",
        "eager×",
        "sdpa×",
        "eager⁺×",
        "sdpa⁺×",
        "GFLOP/s",
        "of limit"
    );
    let mut breakdown = Vec::new();
    for &s in &models {
        let reference = |sdpa, keep| args.torch.then(|| torch(&args, s, sdpa, keep)).transpose();
        let (eager, sdpa) = (reference(false, false)?, reference(true, false)?);
        let (eager_kept, sdpa_kept) = (reference(false, true)?, reference(true, true)?);
        let run = ours(s, &args, &times)?;
        let ms = |t: Option<f64>| t.map_or("-".into(), |t| format!("{:.1}", t * 1e3));
        let ratio = |t: Option<f64>| t.map_or("-".into(), |t| format!("{:.2}", t / run.step));
        let achieved = s.flops() / run.step;
        let name = format!(
            "{}x{}x{}x{}x{}",
            s.layers, s.hidden, s.heads, s.groups, s.ffn
        );
        println!(
            "{name:>22} {:>9} {:>9} {:>9} {:>9} {:>9.1} {:>10.0} {:>7} {:>7} {:>7} {:>7} {:>9.1} {:>7.0}%",
            ms(eager),
            ms(sdpa),
            ms(eager_kept),
            ms(sdpa_kept),
            run.step * 1e3,
            (MICRO_BATCH * SEQ) as f64 / run.step,
            ratio(eager),
            ratio(sdpa),
            ratio(eager_kept),
            ratio(sdpa_kept),
            achieved / 1e9,
            100.0 * achieved / peak,
        );
        breakdown.push((name, run));
    }
    print_breakdown(&PHASES, &breakdown, 18);
    Ok(())
}
