//! BERT training throughput at TP = 1, fp32 (forward + backward + AdamW step, median of the
//! timed steps) for two model sizes, with the MLM head over every position (the same work as
//! PyTorch's reference) and over the masked positions only; with `--torch`, PyTorch eager's
//! step on the same model in the same run, and the ratios. Then where our step's time goes.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example bert_bench -- --torch
//! ```
//!
//! `--torch` runs `scripts/torch_ref/torch_bert_ref.py` (PyTorch from pip; dev-only) twice: as
//! PyTorch runs by default on a CPU, and with glibc's malloc keeping freed memory as our
//! examples' allocator does (the `⁺` columns, the like-for-like comparison; see
//! `burn_megatron_examples::torch_ref`).

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::models::{
    BertConfig, BertStageOutput, MaskedPositions, ParallelAttentionConfig, ParallelMlpConfig,
    TransformerLayerConfig,
};
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer};
use burn_megatron_examples::median;
use burn_megatron_examples::phases::{PhaseTimes, Run, print_breakdown};
use burn_megatron_examples::torch_ref;
use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, clap::ValueEnum)]
enum Optim {
    Fused,
    Adamw,
}

#[derive(Parser)]
struct Args {
    /// Timed steps per run (after two untimed ones); the median is reported.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Also time PyTorch eager's step on each model (`python3` with torch installed).
    #[arg(long)]
    torch: bool,
    /// The PyTorch reference script.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/torch_ref/torch_bert_ref.py"))]
    torch_script: PathBuf,
    /// `fused`: `MegatronOptimizer::new` with a `FusedAdam` (AdamW over flat buffers, one
    /// native pass on Flex); `adamw`: `MegatronOptimizer` around burn-optim's `AdamW`. The
    /// same update.
    #[arg(long, value_enum, default_value_t = Optim::Fused)]
    optimizer: Optim,
    /// Models as LAYERSxHIDDENxHEADS.
    #[arg(long, value_delimiter = ',', default_value = "2x128x2,4x256x4")]
    models: Vec<String>,
}

const SEQ: usize = 128;
const MICRO_BATCH: usize = 8;
const VOCAB: usize = 30592;

/// A BERT layer of width `hidden` with `heads` heads, an MLP of `4·hidden` and the other
/// switches at their defaults.
fn bert_layer(hidden: usize, heads: usize) -> TransformerLayerConfig {
    let (attention, mlp) = (
        ParallelAttentionConfig::new(heads),
        ParallelMlpConfig::new(4 * hidden),
    );
    TransformerLayerConfig::new(hidden, attention, mlp).with_seed(1234)
}

fn ints(f: impl Fn(usize) -> i64, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..MICRO_BATCH * SEQ).map(f).collect();
    Tensor::from_data(TensorData::new(v, [MICRO_BATCH, SEQ]), device)
}

fn ours(
    (layers, hidden, heads): (usize, usize, usize),
    masked_head: bool,
    args: &Args,
    times: &PhaseTimes,
) -> Result<Run, Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0)?);
    let mut model =
        BertConfig::new(layers, SEQ, VOCAB, bert_layer(hidden, heads)).init(&tp, &device)?;
    let steps = args.steps;
    let mut optim = match args.optimizer {
        Optim::Fused => {
            let adam = FusedAdamConfig::new().with_no_weight_decay_on_1d(false);
            MegatronOptimizer::new(adam.init()?, &model, tp.clone(), 0)
        }
        Optim::Adamw => MegatronOptimizer::new(AdamWConfig::new().init(), &model, tp.clone(), 0),
    };
    let ids = ints(|i| ((i * 7919) % 30000) as i64, &device);
    let types = ints(|i| i64::from(i % SEQ >= SEQ / 2), &device);
    let padding = ints(|_| 0, &device).equal_elem(1);
    let labels = ints(|i| ((i * 104_729) % 30000) as i64, &device);
    let mask_v: Vec<f32> = (0..MICRO_BATCH * SEQ)
        .map(|i| if i % 7 == 0 { 1.0 } else { 0.0 })
        .collect();
    let mask = Tensor::<2>::from_data(TensorData::new(mask_v, [MICRO_BATCH, SEQ]), &device);
    let sop = Tensor::<1, Int>::from_data(
        TensorData::new(vec![0i64, 1, 0, 1, 0, 1, 0, 1], [MICRO_BATCH]),
        &device,
    );
    let mut secs = Vec::new();
    for step in 0..steps + 2 {
        if step == 2 {
            times.take();
        }
        let t = Instant::now();
        let positions = masked_head
            .then(|| MaskedPositions::from_loss_mask(&mask))
            .transpose()?;
        let tokens = Some((ids.clone(), types.clone()));
        let out = match model.forward_stage_with_positions(
            tokens,
            None,
            padding.clone(),
            None,
            positions.as_ref(),
        )? {
            BertStageOutput::Output(out) => out,
            BertStageOutput::Hidden(_) => unreachable!("the whole model ends in its heads"),
        };
        let (lm, so) = model.loss(out, labels.clone(), mask.clone(), sop.clone())?;
        let grads = {
            let _span = tracing::debug_span!("backward").entered();
            GradientsParams::from_grads((lm + so).backward(), &model)
        };
        let _span = tracing::debug_span!("optimizer").entered();
        let (m, _) = optim.step(1e-4, model, grads)?;
        model = m;
        let _ = model.head.as_ref().map(|h| h.lm_bias.val().into_data()); // the step's end
        drop(_span);
        if step >= 2 {
            secs.push(t.elapsed().as_secs_f64());
        }
    }
    let phases = times
        .take()
        .into_iter()
        .map(|(k, v)| (k, v / steps as u32))
        .collect();
    Ok(Run {
        step: median(secs),
        phases,
    })
}

/// PyTorch's step on the model, with glibc keeping freed memory when `keep`.
fn torch(args: &Args, (l, h, a): (usize, usize, usize), keep: bool) -> Result<f64, String> {
    let argv = [l, h, a, SEQ, MICRO_BATCH, VOCAB, args.steps].map(|v| v.to_string());
    torch_ref::step_seconds(&args.torch_script, &argv, keep)
}

fn parse_model(s: &str) -> Result<(usize, usize, usize), String> {
    let v: Vec<usize> = s
        .split('x')
        .map(|p| p.parse::<usize>().map_err(|e| format!("{s}: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [l, h, a] => Ok((l, h, a)),
        _ => Err(format!("a model is LAYERSxHIDDENxHEADS, got {s}")),
    }
}

const PHASES: [(&str, &str); 7] = [
    ("embedding", "bert.embeddings"),
    ("attention", "layer.attention"),
    ("MLP", "layer.mlp"),
    ("LM head", "bert.lm_head"),
    ("cross-entropy", "bert.loss"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let models: Vec<_> = args
        .models
        .iter()
        .map(|m| parse_model(m))
        .collect::<Result<_, _>>()?;
    let (times, _guard) = PhaseTimes::install();
    let mut breakdown = Vec::new();
    println!(
        "{:>7} {:>7} {:>6} {:>9} {:>9} {:>10} {:>10} {:>10} {:>7} {:>8} {:>7} {:>8}",
        "layers",
        "hidden",
        "heads",
        "torch ms",
        "torch⁺ ms",
        "all ms",
        "masked ms",
        "tokens/s",
        "all×",
        "masked×",
        "all⁺×",
        "masked⁺×"
    );
    for &(l, h, a) in &models {
        let reference = |keep| {
            args.torch
                .then(|| torch(&args, (l, h, a), keep))
                .transpose()
        };
        let (default, kept) = (reference(false)?, reference(true)?);
        let all = ours((l, h, a), false, &args, &times)?;
        let masked = ours((l, h, a), true, &args, &times)?;
        let ms = |t: Option<f64>| t.map_or("-".into(), |t| format!("{:.1}", t * 1e3));
        let ratio =
            |t: Option<f64>, r: &Run| t.map_or("-".into(), |t| format!("{:.2}", t / r.step));
        println!(
            "{l:>7} {h:>7} {a:>6} {:>9} {:>9} {:>10.1} {:>10.1} {:>10.0} {:>7} {:>8} {:>7} {:>8}",
            ms(default),
            ms(kept),
            all.step * 1e3,
            masked.step * 1e3,
            (MICRO_BATCH * SEQ) as f64 / masked.step,
            ratio(default, &all),
            ratio(default, &masked),
            ratio(kept, &all),
            ratio(kept, &masked),
        );
        breakdown.push((format!("{l}x{h}x{a} all"), all));
        breakdown.push((format!("{l}x{h}x{a} masked"), masked));
    }
    print_breakdown(&PHASES, &breakdown, 15);
    Ok(())
}
