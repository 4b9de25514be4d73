//! Activation memory and step time of a GPT with no, selective and full recomputation,
//! measured in one run: a Llama-style model (RoPE, RMSNorm, SwiGLU, no biases) of 8 layers,
//! hidden 512, 8 heads, seq 512, micro-batch 4, vocabulary 8192, fp32, TP 1, without
//! dropout as Llama trains (`--dropout 0.1` puts it in attention and after each block,
//! replayed by the recomputation).
//!
//! Both memory columns come from the counting allocator, above what the rank held before
//! the step (weights and optimizer state): "kept" is what the forward left alive for
//! backward, the activations that recomputation targets (Korthikanti et al.'s tables count
//! these); "peak" is the step's highest point, which adds backward's transients, the
//! replayed region's activations and the gradients (their bytes are printed; they are not
//! all alive at the peak, so they are not subtracted). Step time is the median of the
//! timed steps.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example memory_bench
//! ```

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::models::{ActivationFunc, GptConfig, NormKind, PositionEmbeddingType};
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer};
use burn_megatron::recompute::{
    RecomputeConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule,
};
use burn_megatron::tensor_parallel::RngTracker;
use burn_megatron_examples::median;
use burn_megatron_examples::memory::{Counter, mib};
use clap::Parser;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Timed steps per setting (after one untimed step); the median is reported.
    #[arg(long, default_value_t = 3)]
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

/// What one setting measured.
#[derive(Clone, Copy)]
struct Measured {
    kept: i64,
    peak: i64,
    gradients: i64,
    step: f64,
}

fn measure(
    args: &Args,
    recompute: RecomputeConfig,
) -> Result<Measured, Box<dyn std::error::Error>> {
    let counter = Counter::claim();
    let device = Device::flex().autodiff();
    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0)?);
    let ffn = (args.hidden * 8 / 3).div_ceil(64) * 64;
    let config = GptConfig::new(args.layers, args.hidden, 8, ffn, args.seq, args.vocab)
        .with_position_embedding_type(PositionEmbeddingType::Rope)
        .with_normalization(NormKind::RmsNorm)
        .with_gated_linear_unit(true)
        .with_activation_func(ActivationFunc::Silu)
        .with_add_bias_linear(false)
        .with_untie_embeddings_and_output_weights(true)
        .with_hidden_dropout(args.dropout)
        .with_attention_dropout(args.dropout)
        .with_recompute(recompute);
    let mut model = config.init(&tp, &device)?;
    let params = burn::module::Module::num_params(&model) as i64;
    let adam = FusedAdamConfig::new().init()?;
    let mut optim = MegatronOptimizer::fused_adam(adam, &model, tp.clone(), 0);
    let rng = RngTracker::new(1, 0);
    let (b, s) = (args.micro_batch, args.seq);
    let ints = |f: &dyn Fn(usize) -> i64| {
        let v: Vec<i64> = (0..b * s).map(f).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [b, s]), &device)
    };
    let ids = ints(&|i| ((i * 7919) % args.vocab) as i64);
    let labels = ints(&|i| ((i * 7919 + 13) % args.vocab) as i64);
    let mask = Tensor::<2>::ones([b, s], &device);
    let (mut kept, mut peak, mut secs) = (0, 0, Vec::new());
    for step in 0..=args.steps {
        let before = counter.live();
        counter.reset_peak();
        let t = Instant::now();
        let logits = model.forward_stage(Some(ids.clone()), None, Some(&rng))?;
        let burn_megatron::models::GptStageOutput::Logits(logits) = logits else {
            unreachable!("one stage holds the head");
        };
        let loss = model.loss(logits, labels.clone(), mask.clone())?;
        let held = counter.live() - before;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-4, model, grads)?.0;
        let _ = model.layers[0].input_layernorm.gamma().val().into_data();
        let elapsed = t.elapsed().as_secs_f64();
        // The first step allocates the optimizer's state: not measured.
        if step > 0 {
            secs.push(elapsed);
            kept = kept.max(held);
            peak = peak.max(counter.peak() - before);
        }
    }
    Ok(Measured {
        kept,
        peak,
        gradients: 4 * params,
        step: median(secs),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let full = RecomputeConfig::new()
        .with_granularity(Some(RecomputeGranularity::Full))
        .with_method(Some(RecomputeMethod::Uniform))
        .with_num_layers(Some(1));
    let selective = |modules| {
        RecomputeConfig::new()
            .with_granularity(Some(RecomputeGranularity::Selective))
            .with_modules(modules)
    };
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
        "{:<30} {:>13} {:>13} {:>9} {:>9} {:>9} {:>9}",
        "recompute", "kept", "peak", "step", "kept cut", "peak cut", "time"
    );
    let mut base: Option<Measured> = None;
    for (name, recompute) in settings {
        let m = measure(&args, recompute)?;
        let b = *base.get_or_insert(m);
        println!(
            "{name:<30} {:>13} {:>13} {:>7.0}ms {:>8.2}x {:>8.2}x {:>8.2}x",
            mib(m.kept),
            mib(m.peak),
            m.step * 1e3,
            b.kept as f64 / m.kept as f64,
            b.peak as f64 / m.peak as f64,
            m.step / b.step
        );
        if name == "none" {
            println!("  (gradients: {}, in every peak)", mib(m.gradients));
        }
    }
    println!(
        "targets: full ≥ 4x less activation memory for ≤ 1.4x the time; selective ≥ 1.5x for ≤ 1.1x"
    );
    Ok(())
}
