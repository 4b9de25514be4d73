//! Context parallelism's memory and step time: a Llama-style GPT (2 layers, hidden 256, 4
//! heads, seq 4096, micro-batch 1, fp32, no dropout) at CP 1, 2 and 4, with `all_gather`,
//! ring attention (`p2p`) and Ulysses (`a2a`), each rank a thread. Memory comes from the
//! counting allocator, per rank, above what it held
//! before the step: "kept" is what the forward left alive for backward (the activations CP
//! splits), "peak" the step's highest point. Step time is the median of the timed steps;
//! on this 2-core machine the CP ranks share the cores, so the time column shows the cost
//! of the extra collectives and masking, not a speed-up.
//!
//! Ring attention posts each block's send before the step's compute and receives after it.
//! For `p2p` the bench reports the communication hidden behind compute: the same exchanges
//! (count and sizes) timed alone on the same ranks right after the steps, against the
//! communication the steps were still exposed to: the time in sends, and in each receive
//! the wait after the previous rank had posted the block ([`RingStats`]; waiting before
//! that is waiting for the peer's compute). Hidden = 1 − exposed / alone.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example cp_bench
//! ```

use burn::optim::GradientsParams;
use burn::tensor::DType;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::comm::tensor;
use burn_megatron::context_parallel::{ContextParallel, CpCommType, RingStats};
use burn_megatron::data_parallel::DataParallelConfig;
use burn_megatron::data_parallel::advanced::{DpReduction, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::GptStageOutput;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_examples::llama;
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

/// One rank's measurements.
struct Measured {
    kept: i64,
    peak: i64,
    /// Median step seconds.
    step: f64,
    /// The ring's sends and receives in the timed steps.
    ring: RingStats,
    /// The same exchanges alone: seconds.
    alone: f64,
}

/// The ring's exchanges of `stats` (each of the average size) done alone, one after the
/// other, through the calls the ring makes (`comm::tensor::send` / `recv` of a tensor on the
/// rank's device, so that host copies count on both sides of the comparison): seconds.
fn exchanges_alone(
    cp: &ContextParallel,
    stats: &RingStats,
    device: &burn::tensor::Device,
) -> Result<f64, Error> {
    let n = cp.size();
    let (next, previous) = ((cp.rank() + 1) % n, (cp.rank() + n - 1) % n);
    let len = (stats.bytes / stats.sends.max(1) as u64 / 4) as usize;
    let block = Tensor::<1>::zeros([len], device);
    cp.comm().barrier()?;
    let t = Instant::now();
    for _ in 0..stats.sends {
        tensor::send(&**cp.comm(), block.clone(), next)?;
        let _: Tensor<1> = tensor::recv(&**cp.comm(), [len], DType::F32, device, previous)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds of ring communication each rank was exposed to: its time in sends, and in each
/// receive the wait after the previous rank had posted the block (waiting before that is
/// waiting for the peer's compute, not for communication).
fn exposed(ranks: &[Measured]) -> Vec<f64> {
    let n = ranks.len();
    (0..n)
        .map(|r| {
            let posted = &ranks[(r + n - 1) % n].ring.posted;
            let waits: f64 = ranks[r]
                .ring
                .received
                .iter()
                .zip(posted)
                .map(|(&(start, end), &sent)| end.saturating_duration_since(start.max(sent)))
                .map(|d| d.as_secs_f64())
                .sum();
            ranks[r].ring.send_time.as_secs_f64() + waits
        })
        .collect()
}

/// Per rank: kept and peak bytes, step time, and the ring's exposed and alone times.
fn measure(args: &Args, cp: usize, comm_type: CpCommType) -> Result<Vec<Measured>, Error> {
    // ANCHOR: cp_layout
    let layout = ParallelConfig::new(cp, 1, 1).with_context_parallel(cp);
    // ANCHOR_END: cp_layout
    let vocab = 4096;
    let ffn = args.hidden * 8 / 3 / 64 * 64;
    let config = llama(args.layers, args.hidden, (4, 4), ffn, args.seq, vocab);
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let counter = Counter::claim();
        let d = &ctx.device;
        let model = config.init(&ctx.groups.tp, d)?;
        // ANCHOR: cp_split
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
        // ANCHOR_END: cp_split
        let (mut kept, mut peak, mut secs) = (0, 0, Vec::new());
        for step in 0..=args.steps {
            let before = counter.live();
            counter.reset_peak();
            let t = Instant::now();
            // ANCHOR: cp_forward
            let GptStageOutput::Logits(logits) = (if cp == 1 {
                model.forward_stage(Some(ids.clone()), None, None)?
            } else {
                model.forward_stage_cp(Some(ids.clone()), None, None, &split)?
            }) else {
                unreachable!("one stage holds the head")
            };
            let loss = model.loss_cp(logits, labels.clone(), mask.clone(), &split)? * cp as f32;
            // ANCHOR_END: cp_forward
            let held = counter.live() - before;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            finalize_model_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.dp_cp),
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
            } else {
                split.take_ring_stats();
            }
        }
        let ring = split.take_ring_stats();
        let alone = exchanges_alone(&split, &ring, &ctx.device)?;
        Ok::<_, Error>(Measured {
            kept,
            peak,
            step: median(secs),
            ring,
            alone,
        })
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
            let kept = ranks.iter().map(|r| r.kept).max().unwrap_or(0);
            let peak = ranks.iter().map(|r| r.peak).max().unwrap_or(0);
            let step = ranks.iter().map(|r| r.step).fold(0.0, f64::max);
            let exposed: f64 = exposed(&ranks).iter().sum();
            let alone: f64 = ranks.iter().map(|r| r.alone).sum();
            let hidden = if comm_type == CpCommType::P2p && alone > 0.0 {
                format!(
                    " | ring: {:.2} ms exposed of {:.2} ms alone per rank, {:.0}% hidden",
                    1e3 * exposed / ranks.len() as f64,
                    1e3 * alone / ranks.len() as f64,
                    100.0 * (1.0 - exposed / alone)
                )
            } else {
                String::new()
            };
            let (k1, s1) = *base.get_or_insert((kept, step));
            println!(
                "CP {cp} {comm_type:?}: kept {} per rank ({:.2}× less than CP 1, ideal {cp}×) | peak {} | step {:.2} s ({:.2}× CP 1's){hidden}",
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
