//! Activation memory and step time of a GPT with no, selective and full recomputation,
//! measured in one run: a Llama-style model (RoPE, RMSNorm, SwiGLU, no biases) of 8 layers,
//! hidden 512, 8 heads, seq 512, micro-batch 4, vocabulary 8192, fp32, TP 1, without
//! dropout as Llama trains (`--dropout 0.1` puts it in attention and after each block,
//! replayed by the recomputation).
//!
//! Both memory columns come from the counting allocator, above what the process held before
//! the step (weights and optimizer state): "kept" is what the forward left alive for
//! backward, the activations that recomputation targets (Korthikanti et al.'s tables count
//! these); "peak" is the step's highest point, which adds backward's transients, the
//! replayed region's activations and the gradients (their bytes are printed; they are not
//! all alive at the peak, so they are not subtracted). Step time is the median of the
//! timed steps. The settings take turns, one step each per round, so that the machine's
//! drift over the run (on a shared machine, tens of percent) falls on all of them alike.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example memory_bench
//! ```

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer};
use burn_megatron::recompute::{
    RecomputeConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule,
};
use burn_megatron::tensor_parallel::RngTracker;
use burn_megatron_examples::llama;
use burn_megatron_examples::median;
use burn_megatron_examples::memory::{Counter, mib};
use clap::Parser;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Timed steps per setting (after one untimed step); the median is reported.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Layers.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Hidden size (8 heads, SwiGLU FFN of 8/3 × hidden rounded to 64).
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Micro-batch size.
    #[arg(long, default_value_t = 4)]
    micro_batch: usize,
    /// Vocabulary.
    #[arg(long, default_value_t = 8192)]
    vocab: usize,
    /// Attention and hidden dropout.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
}

/// One setting's model and optimizer, and what its steps measured.
struct Setting {
    name: &'static str,
    model: burn_megatron::models::Gpt,
    optim: MegatronOptimizer<burn_megatron::models::Gpt>,
    kept: i64,
    peak: i64,
    gradients: i64,
    secs: Vec<f64>,
}

/// Builds `name`'s model and optimizer; every setting starts from the same weights.
fn setting(
    args: &Args,
    name: &'static str,
    recompute: RecomputeConfig,
    device: &Device,
) -> Result<Setting, Box<dyn std::error::Error>> {
    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0)?);
    let ffn = (args.hidden * 8 / 3).div_ceil(64) * 64;
    let mut config = llama(args.layers, args.hidden, (8, 8), ffn, args.seq, args.vocab);
    let layer = &mut config.transformer;
    (layer.hidden_dropout, layer.attention.attention_dropout) = (args.dropout, args.dropout);
    layer.recompute = recompute;
    let model = config.init(&tp, device)?;
    let params = burn::module::Module::num_params(&model) as i64;
    let adam = FusedAdamConfig::new().init()?;
    let optim = MegatronOptimizer::new(adam, &model, tp, 0);
    Ok(Setting {
        name,
        model,
        optim,
        kept: 0,
        peak: 0,
        gradients: 4 * params,
        secs: Vec::new(),
    })
}

/// One training step of `s`, measured from the counter unless `warmup`.
fn step(
    s: &mut Setting,
    batch: &(Tensor<2, Int>, Tensor<2, Int>, Tensor<2>),
    rng: &RngTracker,
    counter: Counter,
    warmup: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let (ids, labels, mask) = batch;
    let before = counter.live();
    counter.reset_peak();
    let t = Instant::now();
    let logits = s.model.forward_stage(Some(ids.clone()), None, Some(rng))?;
    let burn_megatron::models::GptStageOutput::Logits(logits) = logits else {
        unreachable!("one stage holds the head");
    };
    let loss = s.model.loss(logits, labels.clone(), mask.clone())?;
    let held = counter.live() - before;
    let grads = GradientsParams::from_grads(loss.backward(), &s.model);
    s.model = s.optim.step(1e-4, s.model.clone(), grads)?.0;
    let _ = s.model.layers[0].input_layernorm.gamma().val().into_data();
    let elapsed = t.elapsed().as_secs_f64();
    // The first step allocates the optimizer's state: not measured.
    if !warmup {
        s.secs.push(elapsed);
        s.kept = s.kept.max(held);
        s.peak = s.peak.max(counter.peak() - before);
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // ANCHOR: recompute_config
    let full = RecomputeConfig::new()
        .with_granularity(Some(RecomputeGranularity::Full))
        .with_method(Some(RecomputeMethod::Uniform))
        .with_num_layers(Some(1));
    let selective = |modules| {
        RecomputeConfig::new()
            .with_granularity(Some(RecomputeGranularity::Selective))
            .with_modules(modules)
    };
    // ANCHOR_END: recompute_config
    let settings = [
        ("none", RecomputeConfig::new()),
        (
            "selective core_attn",
            selective(vec![RecomputeModule::CoreAttn]),
        ),
        (
            "selective core_attn,layernorm",
            selective(vec![RecomputeModule::CoreAttn, RecomputeModule::Layernorm]),
        ),
        (
            "selective core_attn,mlp_act",
            selective(vec![RecomputeModule::CoreAttn, RecomputeModule::MlpAct]),
        ),
        (
            "selective core_attn,layernorm,mlp_act",
            selective(vec![
                RecomputeModule::CoreAttn,
                RecomputeModule::Layernorm,
                RecomputeModule::MlpAct,
            ]),
        ),
        (
            "selective core_attn,mlp",
            selective(vec![RecomputeModule::CoreAttn, RecomputeModule::Mlp]),
        ),
        ("full uniform 1", full),
    ];
    println!(
        "GPT {} layers, hidden {}, seq {}, micro-batch {}, vocabulary {}, dropout {}, fp32, TP 1",
        args.layers, args.hidden, args.seq, args.micro_batch, args.vocab, args.dropout
    );
    println!(
        "{:<38} {:>13} {:>13} {:>9} {:>9} {:>9} {:>9}",
        "recompute", "kept", "peak", "step", "kept cut", "peak cut", "time"
    );
    let counter = Counter::claim();
    let device = Device::flex().autodiff();
    let mut all = settings
        .into_iter()
        .map(|(name, recompute)| setting(&args, name, recompute, &device))
        .collect::<Result<Vec<_>, _>>()?;
    let (b, s) = (args.micro_batch, args.seq);
    let ints = |f: &dyn Fn(usize) -> i64| {
        let v: Vec<i64> = (0..b * s).map(f).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [b, s]), &device)
    };
    let batch = (
        ints(&|i| ((i * 7919) % args.vocab) as i64),
        ints(&|i| ((i * 7919 + 13) % args.vocab) as i64),
        Tensor::<2>::ones([b, s], &device),
    );
    let rng = RngTracker::new(1, 0);
    // Round by round, one step of each setting, so that the machine's drift over the run
    // falls on every setting alike.
    for round in 0..=args.steps {
        for s in &mut all {
            step(s, &batch, &rng, counter, round == 0)?;
        }
    }
    let base = (all[0].kept, all[0].peak, median(all[0].secs.clone()));
    for m in &all {
        let secs = median(m.secs.clone());
        println!(
            "{:<38} {:>13} {:>13} {:>7.0}ms {:>8.2}x {:>8.2}x {:>8.2}x",
            m.name,
            mib(m.kept),
            mib(m.peak),
            secs * 1e3,
            base.0 as f64 / m.kept as f64,
            base.1 as f64 / m.peak as f64,
            secs / base.2
        );
        if m.name == "none" {
            println!("  (gradients: {}, in every peak)", mib(m.gradients));
        }
    }
    println!(
        "targets: full ≥ 4x less activation memory for ≤ 1.4x the time; selective ≥ 1.5x for ≤ 1.1x"
    );
    Ok(())
}
