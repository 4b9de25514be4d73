//! `forward_backward_func` on a stack of linear + tanh layers split over P stages × V chunks,
//! against the same stack on one rank run by a plain gradient-accumulation loop (no
//! executor): per-microbatch losses, every layer's gradients, and weights after AdamW steps.

use crate::comm::{Comm, Probed};
use crate::launch::{LaunchOptions, threads};
use crate::pipeline::*;
use crate::tensor_parallel::MasterInit;
use crate::topology::{ParallelConfig, layer_offset, layers_per_chunk};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const LAYERS: usize = 8;
const H: usize = 6;
const B: usize = 2;
const STEPS: usize = 3;

#[derive(Module, Debug)]
struct Stack {
    layers: Vec<Linear>,
}

fn layer(i: usize, device: &Device) -> Linear {
    let w = MasterInit::KaimingUniform.values(H * H, H, 100 + i as u64);
    let b = MasterInit::Uniform {
        low: -0.1,
        high: 0.1,
    }
    .values(H, H, 200 + i as u64);
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [H, H]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(b, [H]),
            device,
        ))),
    }
}

impl Stack {
    fn new(range: std::ops::Range<usize>, device: &Device) -> Self {
        Self {
            layers: range.map(|i| layer(i, device)).collect(),
        }
    }

    fn forward(&self, mut x: Tensor<3>) -> Tensor<3> {
        for l in &self.layers {
            x = l.forward(x).tanh();
        }
        x
    }
}

/// Sequence length of microbatch `k` (varying when `variable`).
fn seq(k: usize, variable: bool) -> usize {
    if variable { 2 + k % 3 } else { 3 }
}

fn input(k: usize, variable: bool, device: &Device) -> Tensor<3> {
    let s = seq(k, variable);
    let v: Vec<f32> = (0..s * B * H)
        .map(|i| ((i * 7 + k * 13) % 11) as f32 / 11.0 - 0.5)
        .collect();
    Tensor::from_data(TensorData::new(v, [s, B, H]), device)
}

fn loss(out: Tensor<3>, k: usize) -> Tensor<1> {
    (out - (k as f32 * 0.1)).powi_scalar(2).mean().reshape([1])
}

/// One chunk on one microbatch: from the microbatch's input on the first stage, the loss
/// (reporting the microbatch id) on the last.
fn stack_step(s: ForwardStep<'_, Stack, 3>, last: bool, variable: bool) -> ChunkOutput<3> {
    let device = s.model.layers[0].weight.val().device();
    let x = s
        .input
        .unwrap_or_else(|| input(s.microbatch, variable, &device));
    let y = s.model.forward(x);
    if last {
        ChunkOutput::Loss {
            loss: loss(y, s.microbatch),
            report: vec![Tensor::from_floats([s.microbatch as f32], &device)],
        }
    } else {
        ChunkOutput::Activation(y)
    }
}

/// Everything a run produces: per-step losses, first-step gradients and final weights of
/// each global layer (weight then bias values).
#[derive(Debug, Default, Clone)]
struct Trace {
    losses: Vec<Vec<f64>>,
    grads: Vec<(usize, Vec<f32>)>,
    weights: Vec<(usize, Vec<f32>)>,
}

fn layer_values(l: &Linear, grads: Option<&GradientsParams>) -> Vec<f32> {
    let (w, b) = match grads {
        Some(g) => (
            g.get::<2>(l.weight.id).expect("weight grad"),
            g.get::<1>(l.bias.as_ref().unwrap().id).expect("bias grad"),
        ),
        None => (l.weight.val(), l.bias.as_ref().unwrap().val()),
    };
    let mut v: Vec<f32> = w.into_data().iter::<f32>().collect();
    v.extend(b.into_data().iter::<f32>());
    v
}

/// One rank, a plain loop: Σ_k (loss_k / M).backward().
fn reference(m: usize, variable: bool) -> Trace {
    let device = Device::flex().autodiff();
    let mut model = Stack::new(0..LAYERS, &device);
    let mut optim = AdamWConfig::new().init();
    let mut trace = Trace::default();
    for step in 0..STEPS {
        let mut acc = GradientsAccumulator::new();
        let mut losses = Vec::new();
        for k in 0..m {
            let l = loss(model.forward(input(k, variable, &device)), k);
            losses.push(f64::from(
                l.clone().into_data().iter::<f32>().next().unwrap(),
            ));
            let g = (l / m as f32).backward();
            acc.accumulate(&model, GradientsParams::from_grads(g, &model));
        }
        let grads = acc.grads();
        if step == 0 {
            for (i, l) in model.layers.iter().enumerate() {
                trace.grads.push((i, layer_values(l, Some(&grads))));
            }
        }
        model = optim.step(1e-2, model, grads);
        trace.losses.push(losses);
    }
    for (i, l) in model.layers.iter().enumerate() {
        trace.weights.push((i, layer_values(l, None)));
    }
    trace
}

/// P stages × V chunks through `forward_backward_func`; returns each rank's trace and peak.
fn pipelined(schedule: PipelineSchedule, variable: bool) -> Vec<(Trace, usize)> {
    let (p, v) = (schedule.pipeline_size, schedule.num_model_chunks);
    let config = ParallelConfig::new(p, 1, p).with_virtual_pipeline((v > 1).then_some(v));
    threads(&config, LaunchOptions::default(), |ctx| {
        let rank = ctx.state.pipeline_model_parallel_rank();
        let per = layers_per_chunk(LAYERS, p, v)?;
        let offsets: Vec<usize> = (0..v)
            .map(|c| layer_offset(LAYERS, p, v, rank, c))
            .collect::<Result<_, _>>()?;
        let mut chunks: Vec<Stack> = offsets
            .iter()
            .map(|&o| Stack::new(o..o + per, &ctx.device))
            .collect();
        let shapes = if variable {
            P2pShapes::Variable
        } else {
            P2pShapes::Fixed {
                dims: vec![3, B, H],
                dtype: burn::tensor::DType::F32,
            }
        };
        let p2p = ctx.p2p(shapes);
        let mut optim = AdamWConfig::new().init();
        let (mut trace, mut peak) = (Trace::default(), 0);
        for step in 0..STEPS {
            let out = forward_backward_func(
                |s: ForwardStep<'_, Stack, 3>| {
                    let last = virtual_stage(p, rank, s.chunk) + 1 == p * v;
                    Ok(stack_step(s, last, variable))
                },
                &chunks,
                &p2p,
                ForwardBackwardConfig::new(schedule),
            )?;
            peak = peak.max(out.peak_live_microbatches);
            if step == 0 {
                for (c, chunk) in chunks.iter().enumerate() {
                    for (j, l) in chunk.layers.iter().enumerate() {
                        trace
                            .grads
                            .push((offsets[c] + j, layer_values(l, Some(&out.grads))));
                    }
                }
            }
            trace
                .losses
                .push(read_losses(&out.losses).iter().map(|l| l.loss).collect());
            chunks = optim.step(1e-2, chunks, out.grads);
        }
        for (c, chunk) in chunks.iter().enumerate() {
            for (j, l) in chunk.layers.iter().enumerate() {
                trace.weights.push((offsets[c] + j, layer_values(l, None)));
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((trace, peak))
    })
    .unwrap()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
    }
}

fn check(schedule: PipelineSchedule, variable: bool) {
    let m = schedule.num_microbatches;
    let reference = reference(m, variable);
    let ranks = pipelined(schedule, variable);
    let mut seen = vec![0usize; LAYERS];
    for (rank, (trace, peak)) in ranks.iter().enumerate() {
        let what = format!("{schedule:?} variable {variable} rank {rank}");
        assert_eq!(
            *peak,
            (schedule.num_warmup(rank) + 1).min(m * schedule.num_model_chunks)
        );
        if rank + 1 == ranks.len() {
            assert_eq!(trace.losses.len(), STEPS, "{what}");
            for (got, want) in trace.losses.iter().zip(&reference.losses) {
                assert_eq!(got.len(), want.len(), "{what}: loss count");
                for (g, w) in got.iter().zip(want) {
                    assert!((g - w).abs() <= 1e-6, "{what}: loss {g} vs {w}");
                }
            }
        } else {
            assert!(trace.losses.iter().all(Vec::is_empty), "{what}");
        }
        for (layer, g) in &trace.grads {
            seen[*layer] += 1;
            close(
                g,
                &reference.grads[*layer].1,
                1e-6,
                &format!("{what} grad {layer}"),
            );
        }
        for (layer, w) in &trace.weights {
            close(
                w,
                &reference.weights[*layer].1,
                1e-5,
                &format!("{what} weight {layer}"),
            );
        }
    }
    assert_eq!(seen, vec![1; LAYERS], "every layer on exactly one chunk");
}

#[test]
fn one_f_one_b_matches_one_rank() {
    check(PipelineSchedule::new(2, 4), false);
    check(PipelineSchedule::new(4, 3), true);
}

#[test]
fn interleaved_matches_one_rank() {
    check(PipelineSchedule::new(2, 4).with_model_chunks(2), false);
    check(PipelineSchedule::new(2, 4).with_model_chunks(4), true);
    check(
        PipelineSchedule::new(2, 4)
            .with_model_chunks(2)
            .with_microbatch_group_size(Some(4)),
        false,
    );
    check(PipelineSchedule::new(4, 8).with_model_chunks(2), true);
}

/// Counts the warnings logged on this thread while it lives.
struct Warnings(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Forward only, on the chunks as trained (tracked: the schedule warns, once per rank, that
/// Burn keeps their graphs) and on their `valid()` copies without autodiff (no warning):
/// the same losses, no gradients.
#[test]
fn forward_only_gives_the_losses_and_no_gradients() {
    use tracing_subscriber::layer::SubscriberExt;
    let reference = reference(4, true);
    let schedule = PipelineSchedule::new(2, 4)
        .with_model_chunks(2)
        .with_forward_only(true);
    let config = ParallelConfig::new(2, 1, 2).with_virtual_pipeline(Some(2));
    for valid in [false, true] {
        let out = threads(&config, LaunchOptions::default(), |ctx| {
            let warnings = Arc::new(AtomicUsize::new(0));
            let subscriber = tracing_subscriber::registry().with(Warnings(warnings.clone()));
            let _log = tracing::subscriber::set_default(subscriber);
            let rank = ctx.state.pipeline_model_parallel_rank();
            let chunks: Vec<Stack> = (0..2)
                .map(|c| {
                    let o = layer_offset(LAYERS, 2, 2, rank, c).unwrap();
                    let chunk = Stack::new(o..o + 2, &ctx.device);
                    if valid { chunk.valid() } else { chunk }
                })
                .collect();
            let device = match valid {
                true => ctx.device.clone().without_autodiff(),
                false => ctx.device.clone(),
            };
            let (pp, back) = (ctx.groups.pp.clone(), ctx.groups.pp_backward.clone());
            let p2p = P2pCommunicator::new(pp, back, P2pShapes::Variable, device);
            let out = forward_backward_func(
                |s: ForwardStep<'_, Stack, 3>| {
                    let last = rank == 1 && s.chunk == 1;
                    Ok(stack_step(s, last, true))
                },
                &chunks,
                &p2p,
                ForwardBackwardConfig::new(schedule),
            )?;
            assert!(out.grads.is_empty());
            let warned = warnings.load(Ordering::Relaxed);
            Ok::<_, PipelineError>((read_losses(&out.losses), warned))
        })
        .unwrap();
        let what = if valid {
            "valid copies"
        } else {
            "tracked chunks"
        };
        assert!(out[0].0.is_empty(), "{what}");
        assert_eq!(out[1].0.len(), 4, "{what}");
        for (k, l) in out[1].0.iter().enumerate() {
            assert_eq!(l.report, vec![k as f64]);
            assert!((l.loss - reference.losses[0][k]).abs() <= 1e-6, "{what}");
        }
        let warned: Vec<usize> = out.iter().map(|o| o.1).collect();
        assert_eq!(
            warned,
            [usize::from(!valid); 2],
            "{what}: warnings per rank"
        );
    }
}

/// A forward step failing mid-schedule on one rank ends every rank with an error that names
/// it, long before the communicator timeout.
#[test]
fn a_failing_rank_fails_every_rank_without_a_hang() {
    let timeout = Duration::from_secs(60);
    let errors = Mutex::new(Vec::new());
    let start = std::time::Instant::now();
    let config = ParallelConfig::new(4, 1, 4);
    let result = threads(
        &config,
        LaunchOptions::default().with_timeout(timeout),
        |ctx| {
            let rank = ctx.state.pipeline_model_parallel_rank();
            let chunks = vec![Stack::new(2 * rank..2 * rank + 2, &ctx.device)];
            let r = forward_backward_func(
                |s: ForwardStep<'_, Stack, 3>| {
                    if rank == 2 && s.microbatch == 3 {
                        return Err("out of memory (simulated)".into());
                    }
                    Ok(stack_step(s, rank == 3, false))
                },
                &chunks,
                &ctx.p2p(P2pShapes::Variable),
                ForwardBackwardConfig::new(PipelineSchedule::new(4, 8)),
            );
            if let Err(e) = &r {
                errors
                    .lock()
                    .unwrap()
                    .push((ctx.state.global_rank(), e.to_string()));
            }
            r.map(|_| ())
        },
    );
    let err = result.unwrap_err().to_string();
    assert!(err.contains("rank 2") && err.contains("simulated"), "{err}");
    let errors = errors.into_inner().unwrap();
    assert_eq!(errors.len(), 4, "every rank ends with an error: {errors:?}");
    for (rank, e) in &errors {
        if *rank != 2 {
            assert!(e.contains("global rank 2 failed"), "rank {rank}: {e}");
        }
    }
    assert!(start.elapsed() < timeout / 2, "took {:?}", start.elapsed());
}

#[test]
fn inconsistent_calls_are_refused_before_any_work() {
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let chunks = vec![Stack::new(0..1, &ctx.device)];
            let p2p = ctx.p2p(P2pShapes::Variable);
            let never = |_: ForwardStep<'_, Stack, 3>| -> Result<ChunkOutput<3>, StageError> {
                panic!("no forward may run")
            };
            let errs = [
                ForwardBackwardConfig::new(PipelineSchedule::new(4, 4)),
                ForwardBackwardConfig::new(PipelineSchedule::new(2, 4).with_model_chunks(2)),
                ForwardBackwardConfig::new(PipelineSchedule::new(2, 0)),
                ForwardBackwardConfig {
                    grad_scale: f64::NAN,
                    ..ForwardBackwardConfig::new(PipelineSchedule::new(2, 4))
                },
            ]
            .map(|c| {
                forward_backward_func(never, &chunks, &p2p, c)
                    .unwrap_err()
                    .to_string()
            });
            Ok::<_, PipelineError>(errs)
        },
    )
    .unwrap();
    let e = &out[0];
    assert!(e[0].contains("P = 4") && e[0].contains("has 2"), "{}", e[0]);
    assert!(
        e[1].contains("V = 2") && e[1].contains("1 chunks"),
        "{}",
        e[1]
    );
    assert!(e[2].contains("microbatches M"), "{}", e[2]);
    assert!(e[3].contains("grad_scale"), "{}", e[3]);
}

/// `inner`, counting the messages moved to or from a peer before `connect` opened their
/// pair (on NCCL, pairs opened at their first message by a ring of stages could wait on each
/// other).
fn opening(inner: Comm) -> (Comm, Arc<AtomicUsize>) {
    let early = Arc::new(AtomicUsize::new(0));
    let (count, opened) = (early.clone(), Mutex::new(Vec::new()));
    let probed = Probed::new(inner, move |call| match (call.op, call.peer) {
        ("connect", Some(peer)) => opened.lock().unwrap().push(peer),
        ("send" | "recv", Some(peer)) if !opened.lock().unwrap().contains(&peer) => {
            count.fetch_add(1, Ordering::SeqCst);
        }
        _ => {}
    });
    (Arc::new(probed), early)
}

/// Every stage opens its pairs with both neighbours, on both channels, before its first
/// message: four stages interleaved, whose last stage passes microbatches on to the first.
#[test]
fn every_stage_opens_its_pairs_before_its_first_message() {
    let (p, v) = (4, 2);
    let schedule = PipelineSchedule::new(p, 8).with_model_chunks(v);
    let config = ParallelConfig::new(p, 1, p).with_virtual_pipeline(Some(v));
    let early = threads(&config, LaunchOptions::default(), |ctx| {
        let rank = ctx.state.pipeline_model_parallel_rank();
        let per = layers_per_chunk(LAYERS, p, v)?;
        let mut chunks = Vec::with_capacity(v);
        for c in 0..v {
            let o = layer_offset(LAYERS, p, v, rank, c)?;
            chunks.push(Stack::new(o..o + per, &ctx.device));
        }
        let (f, fwd) = opening(ctx.groups.pp.clone());
        let (b, bwd) = opening(ctx.groups.pp_backward.clone());
        let p2p = P2pCommunicator::new(f, b, P2pShapes::Variable, ctx.device.clone());
        forward_backward_func(
            |s: ForwardStep<'_, Stack, 3>| {
                let last = virtual_stage(p, rank, s.chunk) + 1 == p * v;
                Ok(stack_step(s, last, true))
            },
            &chunks,
            &p2p,
            ForwardBackwardConfig::new(schedule),
        )?;
        let early = fwd.load(Ordering::SeqCst) + bwd.load(Ordering::SeqCst);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(early)
    })
    .unwrap();
    assert_eq!(
        early,
        vec![0; p],
        "messages before their pair was opened, per stage"
    );
}
