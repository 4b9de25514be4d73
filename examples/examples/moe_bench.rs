//! Mixture of experts: a Llama-style GPT whose MLPs are 8 experts (top-2, SwiGLU, fp32, no
//! dropout), each rank a thread.
//!
//! 1. Throughput at EP 1, 2 and 4: DP = EP ranks, each with its own micro-batch, so every
//!    layout processes `ranks × micro-batch × seq` tokens per step; tokens/s is that over the
//!    median step (forward, backward, gradient reductions, AdamW), and the all-to-all's share
//!    is the time inside the token exchange (forward and backward, the `moe.all_to_all`
//!    span) over the step. On this 2-core machine the ranks share the cores, so EP > 1 shows
//!    the exchange's cost, not the speed-up of more devices.
//! 2. Load balance: one rank trains `--balance-steps` steps on skewed synthetic text with and
//!    without the load-balancing loss (`--moe-aux-loss-coeff`); the busiest expert's tokens
//!    over the mean (1 is perfect balance), averaged over the last 20 steps of every layer.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example moe_bench
//! ```

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::data_parallel::{
    DataParallelConfig,
    advanced::{DpReduction, finalize_expert_grads, finalize_model_grads},
};
use burn_megatron::launch::{LaunchOptions, RankContext, threads};
use burn_megatron::models::{Gpt, GptConfig};
use burn_megatron::moe::MoeConfig;
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_examples::llama;
use burn_megatron_examples::median;
use burn_megatron_examples::phases::PhaseTimes;
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Timed steps per layout (after one untimed step); the median is reported.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Hidden size (4 heads).
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Layers (all MoE).
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Experts per layer.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 4)]
    micro_batch: usize,
    /// Expert-parallel sizes to measure.
    #[arg(long, num_args = 1.., default_values_t = [1, 2, 4])]
    ep: Vec<usize>,
    /// Training steps of the load-balance comparison.
    #[arg(long, default_value_t = 200)]
    balance_steps: usize,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

const VOCAB: usize = 512;

fn config(args: &Args, hidden: usize, aux: f64) -> GptConfig {
    let mut config = llama(args.layers, hidden, (4, 4), hidden * 2, args.seq, VOCAB);
    // ANCHOR: moe_config
    // Every layer's MLP becomes 8 experts (by default), each token routed to 2 of them.
    let experts = MoeConfig::new(args.experts)
        .with_moe_router_topk(2)
        .with_moe_aux_loss_coeff(aux);
    config.transformer.moe = Some(experts);
    // ANCHOR_END: moe_config
    config
}

/// `n` rows of `seq + 1` skewed tokens from sample `start` on: a few frequent tokens and a
/// long tail (ids ~ r² of a uniform r), so a router can learn to favour some experts.
fn rows(start: usize, n: usize, seq: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ start as u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let r = (state >> 11) as f64 / (1u64 << 53) as f64;
        (r * r * VOCAB as f64) as i64
    };
    let tokens: Vec<Vec<i64>> = (0..n)
        .map(|_| (0..=seq).map(|_| next()).collect())
        .collect();
    let cut = |from: usize| -> Tensor<2, Int> {
        let v: Vec<i64> = tokens
            .iter()
            .flat_map(|t| t[from..from + seq].to_vec())
            .collect();
        Tensor::from_data(TensorData::new(v, [n, seq]), device)
    };
    (cut(0), cut(1))
}

/// One training step of `model` on its rank's rows; the loss.
fn step(
    ctx: &RankContext,
    model: Gpt,
    optim: &mut MegatronOptimizer<Gpt>,
    (ids, labels): &(Tensor<2, Int>, Tensor<2, Int>),
) -> Result<(Gpt, f32), Error> {
    let logits = model.forward(ids.clone())?;
    let mask = Tensor::ones(labels.dims(), &ctx.device);
    let loss = model.loss(logits, labels.clone(), mask)?;
    let value = loss.clone().into_scalar::<f32>();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    let (g, ddp) = (&ctx.groups, DataParallelConfig::default());
    finalize_model_grads(
        &model,
        &mut grads,
        DpReduction::AllReduce(&g.dp),
        &g.tp,
        None,
        &ddp,
    )?;
    let dp = ctx.state.data_parallel_size();
    finalize_expert_grads(
        &model,
        &mut grads,
        DpReduction::AllReduce(&g.expert_dp),
        dp,
        &ddp,
    )?;
    Ok((optim.step(1e-3, model, grads)?.0, value))
}

fn build(ctx: &RankContext, config: &GptConfig) -> Result<(Gpt, MegatronOptimizer<Gpt>), Error> {
    let g = &ctx.groups;
    // ANCHOR: moe_build
    let model = config.init_stage_with_experts(
        &g.tp,
        Some(&g.experts()),
        PipelinePosition::whole(),
        &ctx.device,
    )?;
    let optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, g.mp.clone(), 0)
        .with_expert_model_parallel(g.expert_mp.clone())
        .with_clip_grad(1.0, NormType::L2);
    // ANCHOR_END: moe_build
    Ok((model, optim))
}

/// Median step seconds and the all-to-all's share of the timed steps, per rank.
fn throughput(args: &Args, ep: usize) -> Result<Vec<(f64, f64)>, Error> {
    let config = config(args, args.hidden, 1e-2);
    let layout = ParallelConfig::new(ep, 1, 1).with_expert_parallel(ep);
    Ok(threads(&layout, LaunchOptions::default(), |ctx| {
        let (times, _guard) = PhaseTimes::install();
        let (mut model, mut optim) = build(&ctx, &config)?;
        let rank = ctx.state.global_rank();
        let batch = rows(rank * 1000, args.micro_batch, args.seq, &ctx.device);
        let mut secs = Vec::new();
        for s in 0..=args.steps {
            if s == 1 {
                times.take();
            }
            let t = Instant::now();
            model = step(&ctx, model, &mut optim, &batch)?.0;
            if s > 0 {
                secs.push(t.elapsed().as_secs_f64());
            }
        }
        let exchange = times
            .take()
            .get("moe.all_to_all")
            .map_or(0.0, |d| d.as_secs_f64());
        let total: f64 = secs.iter().sum();
        Ok::<_, Error>((median(secs), exchange / total.max(1e-12)))
    })?)
}

/// Max over mean tokens per expert, averaged over the last 20 steps and every layer, after
/// training `balance_steps` steps with load-balancing coefficient `aux`; and the last loss.
fn balance(args: &Args, aux: f64) -> Result<(f64, f32), Error> {
    let config = config(args, 64, aux);
    let layout = ParallelConfig::new(1, 1, 1);
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let (mut model, mut optim) = build(&ctx, &config)?;
        let (mut ratios, mut loss) = (Vec::new(), 0.0);
        for s in 0..args.balance_steps {
            let batch = rows(s, 2, args.seq.min(64), &ctx.device);
            (model, loss) = step(&ctx, model, &mut optim, &batch)?;
            for layer in &model.layers {
                let stats = layer.moe.as_ref().expect("every layer is MoE").take_stats();
                if s + 20 >= args.balance_steps {
                    let t = &stats.tokens_per_expert;
                    let mean = t.iter().sum::<usize>() as f64 / t.len().max(1) as f64;
                    let max = t.iter().copied().max().unwrap_or(0) as f64;
                    ratios.push(max / mean.max(1e-12));
                }
            }
        }
        let mean = ratios.iter().sum::<f64>() / ratios.len().max(1) as f64;
        Ok::<_, Error>((mean, loss))
    })?;
    Ok(out[0])
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    println!(
        "> Llama-style GPT {} layers, hidden {}, {} experts top-2, seq {}, micro-batch {} per rank, fp32",
        args.layers, args.hidden, args.experts, args.seq, args.micro_batch
    );
    let mut base = None;
    println!("| EP | ranks | tokens/s | vs EP 1 | all-to-all share of the step |");
    println!("| --- | --- | --- | --- | --- |");
    for &ep in &args.ep {
        let ranks = throughput(&args, ep)?;
        let step = ranks.iter().map(|r| r.0).fold(0.0, f64::max);
        let share = ranks.iter().map(|r| r.1).sum::<f64>() / ranks.len() as f64;
        let tokens = (ep * args.micro_batch * args.seq) as f64 / step;
        let b = *base.get_or_insert(tokens);
        println!(
            "| {ep} | {ep} | {tokens:.0} | {:.2}× | {:.1} % |",
            tokens / b,
            100.0 * share
        );
    }
    println!(
        "\n> load balance after {} steps (hidden 64, seq {}, 2 sequences per step, one rank)",
        args.balance_steps,
        args.seq.min(64)
    );
    println!("| --moe-aux-loss-coeff | busiest expert's tokens / mean | last lm loss |");
    println!("| --- | --- | --- |");
    for aux in [0.0, 1e-2] {
        let (ratio, loss) = balance(&args, aux)?;
        println!("| {aux} | {ratio:.3} | {loss:.3} |");
    }
    Ok(())
}
