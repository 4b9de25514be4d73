//! The pipeline bubble, measured: stages of a fixed synthetic cost (each chunk's forward
//! sleeps `f / V`, its backward `b / V`, so ranks do not compete for the two cores) run
//! GPipe, 1F1B and interleaved 1F1B through `forward_backward_func`. Each rank's idle
//! fraction, from the executor's timeline, is printed beside Megatron's formula —
//! `(P − 1)/(M + P − 1)`, and `(P − 1)/(V·M + P − 1)` when interleaving — with the most
//! microbatches that held activations at once per rank.
//!
//! `cargo run --release --example pipeline_bubble [-- --forward-ms 4 --backward-ms 8]`

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineError, PipelineSchedule,
    idle_fractions, virtual_stage,
};
use burn_megatron::topology::ParallelConfig;
use clap::Parser;
use std::time::{Duration, Instant};

/// An identity whose backward sleeps: a stage's backward cost without using a core.
#[backend_extension(Flex, Autodiff)]
pub trait SleepOps: Backend {
    /// Returns `x`; its backward sleeps `micros` µs before passing the gradient on.
    fn sleep_in_backward(x: FloatTensor<Self>, micros: u64) -> FloatTensor<Self>;
}

impl SleepOps for Flex {
    fn sleep_in_backward(x: FloatTensor<Self>, _: u64) -> FloatTensor<Self> {
        x
    }
}

#[derive(Debug)]
struct SleepBackward;

impl<B: SleepOps> Backward<B, 1> for SleepBackward {
    type State = u64;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        std::thread::sleep(Duration::from_micros(ops.state));
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, grad);
        }
    }
}

impl<B: SleepOps, C: CheckpointStrategy> SleepOps for Autodiff<B, C> {
    fn sleep_in_backward(x: FloatTensor<Self>, micros: u64) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match SleepBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(micros, B::sleep_in_backward(x, micros)),
            OpsKind::UnTracked(prep) => prep.finish(B::sleep_in_backward(x, micros)),
        }
    }
}

/// One model chunk: a weight, so that even the first stage has a graph to run backward.
#[derive(Module, Debug)]
struct Stage {
    w: Param<Tensor<1>>,
}

#[derive(Parser, Debug)]
struct Args {
    /// Forward time of one whole stage (all its chunks), in ms.
    #[arg(long, default_value_t = 4.0)]
    forward_ms: f64,
    /// Backward time of one whole stage, in ms.
    #[arg(long, default_value_t = 8.0)]
    backward_ms: f64,
}

struct Measured {
    idle: Vec<f64>,
    peak: Vec<usize>,
}

fn measure(schedule: PipelineSchedule, args: &Args) -> Result<Measured, String> {
    let (p, v) = (schedule.pipeline_size, schedule.num_model_chunks);
    let chunk_us = |ms: f64| (ms * 1e3 / v as f64) as u64;
    let (f_us, b_us) = (chunk_us(args.forward_ms), chunk_us(args.backward_ms));
    let config = ParallelConfig::new(p, 1, p).with_virtual_pipeline((v > 1).then_some(v));
    let epoch = Instant::now();
    let out = threads(&config, LaunchOptions::default(), |ctx| {
        let rank = ctx.state.pipeline_model_parallel_rank();
        let chunks: Vec<Stage> = (0..v)
            .map(|_| Stage {
                w: Param::from_tensor(Tensor::ones([4], &ctx.device)),
            })
            .collect();
        let mut fb = ForwardBackwardConfig::new(schedule);
        fb.timeline = Some(epoch);
        let out = burn_megatron::pipeline::forward_backward_func(
            |s: ForwardStep<'_, Stage, 1>| {
                let x = s.input.unwrap_or_else(|| Tensor::ones([4], &ctx.device));
                std::thread::sleep(Duration::from_micros(f_us));
                let y = x * s.model.w.val();
                let y = Tensor::from_dispatch(Dispatch::sleep_in_backward(y.into_dispatch(), b_us));
                Ok(if virtual_stage(p, rank, s.chunk) + 1 == p * v {
                    ChunkOutput::Loss {
                        loss: y.sum(),
                        report: vec![],
                    }
                } else {
                    ChunkOutput::Activation(y)
                })
            },
            &chunks,
            &ctx.p2p(P2pShapes::Variable),
            fb,
        )?;
        Ok::<_, PipelineError>((out.spans, out.peak_live_microbatches))
    })
    .map_err(|e| e.to_string())?;
    let (spans, peak): (Vec<_>, Vec<_>) = out.into_iter().unzip();
    Ok(Measured {
        idle: idle_fractions(&spans),
        peak,
    })
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    println!(
        "stage forward {} ms, backward {} ms (sleeps; chunks take 1/V of them)\n",
        args.forward_ms, args.backward_ms
    );
    println!(
        "{:<12} {:>2} {:>3} {:>2} | {:>8} {:>8} {:>9} {:>6} | peak live microbatches per rank",
        "schedule", "P", "M", "V", "idle avg", "idle max", "formula", "ratio"
    );
    for p in [2usize, 4] {
        for m in [p, 2 * p, 4 * p] {
            let cases = [
                (
                    "GPipe",
                    PipelineSchedule::new(p, m).with_all_forward_first(true),
                ),
                ("1F1B", PipelineSchedule::new(p, m)),
                (
                    "interleaved",
                    PipelineSchedule::new(p, m).with_model_chunks(2),
                ),
            ];
            for (name, schedule) in cases {
                let v = schedule.num_model_chunks;
                let formula = (p - 1) as f64 / (v * m + p - 1) as f64;
                let r = measure(schedule, &args)?;
                let avg = r.idle.iter().sum::<f64>() / r.idle.len() as f64;
                let max = r.idle.iter().copied().fold(0.0, f64::max);
                println!(
                    "{name:<12} {p:>2} {m:>3} {v:>2} | {avg:>8.3} {max:>8.3} {formula:>9.3} {:>6.2} | {:?}",
                    avg / formula,
                    r.peak
                );
            }
        }
    }
    Ok(())
}
