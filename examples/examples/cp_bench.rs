//! Context parallelism's memory and step time: a Llama-style GPT (2 layers, hidden 256, 4
//! heads, seq 4096, micro-batch 1, fp32, no dropout) at CP 1, 2 and 4, with `all_gather`,
//! ring attention (`p2p`) and Ulysses (`a2a`), each rank a thread. Memory comes from the
//! counting allocator, per rank, above what it held
//! before the step: "kept" is what the forward left alive for backward (the activations CP
//! splits), "peak" the step's highest point. Step time is the median of the timed steps;
//! on this 2-core machine the CP ranks share the cores, so the time column shows the cost
//! of the extra collectives and masking, not a speed-up. The ring's sends are not overlapped
//! with compute: the thread and MPI communicators' send/recv are blocking, so none of the
//! ring's communication time is hidden here.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example cp_bench
//! ```

use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::context_parallel::{ContextParallel, CpCommType};
use burn_megatron::data_parallel::{DataParallelConfig, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{
    ActivationFunc, GptConfig, GptStageOutput, NormKind, PositionEmbeddingType,
};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_examples::median;
use burn_megatron_examples::memory::{Counter, mib};
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Timed steps per setting (after one untimed step); the median is reported.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    seq: usize,
    /// Hidden size (4 heads).
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Context-parallel sizes to measure.
    #[arg(long, num_args = 1.., default_values_t = [1, 2, 4])]
    cp: Vec<usize>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Per rank: kept and peak bytes, median step seconds.
fn measure(args: &Args, cp: usize, comm_type: CpCommType) -> Result<Vec<(i64, i64, f64)>, Error> {
    let layout = ParallelConfig::new(cp, 1, 1).with_context_parallel(cp);
    let vocab = 4096;
    let config = GptConfig::new(
        args.layers,
        args.hidden,
        4,
        args.hidden * 8 / 3 / 64 * 64,
        args.seq,
        vocab,
    )
    .with_position_embedding_type(PositionEmbeddingType::Rope)
    .with_normalization(NormKind::RmsNorm)
    .with_gated_linear_unit(true)
    .with_activation_func(ActivationFunc::Silu)
    .with_add_bias_linear(false)
    .with_untie_embeddings_and_output_weights(true)
    .with_hidden_dropout(0.0)
    .with_attention_dropout(0.0);
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let counter = Counter::claim();
        let d = &ctx.device;
        let model = config.init(&ctx.groups.tp, d)?;
        let split =
            ContextParallel::new(ctx.groups.cp.clone(), args.seq)?.with_comm_type(comm_type);
        let local = split.positions().len();
        let row: Vec<i64> = (0..args.seq + 1)
            .map(|i| ((i * 7919) % vocab) as i64)
            .collect();
        let ints = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, local]), d);
        let ids = ints(split.split(&row[..args.seq])?);
        let labels = ints(split.split(&row[1..])?);
        let mask = Tensor::<2>::ones([1, local], d);
        let (mut kept, mut peak, mut secs) = (0, 0, Vec::new());
        for step in 0..=args.steps {
            let before = counter.live();
            counter.reset_peak();
            let t = Instant::now();
            let GptStageOutput::Logits(logits) = (if cp == 1 {
                model.forward_stage(Some(ids.clone()), None, None)?
            } else {
                model.forward_stage_cp(Some(ids.clone()), None, None, &split)?
            }) else {
                unreachable!("one stage holds the head")
            };
            let loss = model.loss_cp(logits, labels.clone(), mask.clone(), &split)? * cp as f32;
            let held = counter.live() - before;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            finalize_model_grads(
                &model,
                &mut grads,
                &ctx.groups.dp_cp,
                &ctx.groups.tp,
                None,
                &DataParallelConfig::default(),
            )?;
            drop(grads);
            let elapsed = t.elapsed().as_secs_f64();
            if step > 0 {
                secs.push(elapsed);
                kept = kept.max(held);
                peak = peak.max(counter.peak() - before);
            }
        }
        Ok::<_, Error>((kept, peak, median(secs)))
    })?;
    Ok(out)
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    println!(
        "> Llama-style GPT {} layers, hidden {}, seq {}, micro-batch 1, fp32; per rank above the weights",
        args.layers, args.hidden, args.seq
    );
    let mut base: Option<(i64, f64)> = None;
    for &cp in &args.cp {
        let types: &[CpCommType] = if cp == 1 {
            &[CpCommType::AllGather]
        } else {
            &[CpCommType::AllGather, CpCommType::P2p, CpCommType::A2a]
        };
        for &comm_type in types {
            let ranks = measure(&args, cp, comm_type)?;
            let kept = ranks.iter().map(|r| r.0).max().unwrap_or(0);
            let peak = ranks.iter().map(|r| r.1).max().unwrap_or(0);
            let step = ranks.iter().map(|r| r.2).fold(0.0, f64::max);
            let (k1, s1) = *base.get_or_insert((kept, step));
            println!(
                "CP {cp} {comm_type:?}: kept {} per rank ({:.2}× less than CP 1, ideal {cp}×) | peak {} | step {:.2} s ({:.2}× CP 1's)",
                mib(kept),
                k1 as f64 / kept.max(1) as f64,
                mib(peak),
                step,
                step / s1
            );
        }
    }
    Ok(())
}
