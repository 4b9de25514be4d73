use super::*;
use crate::comm::Buffer;
use crate::data_parallel::advanced::{DpReduction, finalize_model_grads};
use crate::launch::{LaunchOptions, threads};
use crate::models::{ActivationFunc, ParallelMlp};
use crate::tensor_parallel::{ColumnParallelLinearConfig, RowParallelLinearConfig, TpError};
use crate::topology::ParallelConfig;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::GradientsAccumulator;
use burn::tensor::{Device, TensorData};

#[derive(Module, Debug)]
struct Net {
    blocks: Vec<ParallelMlp>,
    norm: LayerNorm,
}

const H: usize = 8;

fn net(tp: &Comm, device: &Device) -> Result<Net, TpError> {
    let blocks = (0..3)
        .map(|i| {
            Ok(ParallelMlp {
                dense_h_to_4h: ColumnParallelLinearConfig::new(H, 4 * H)
                    .with_seed(10 + i)
                    .init(tp, device)?,
                dense_h_to_4h_gate: None,
                dense_4h_to_h: RowParallelLinearConfig::new(4 * H, H)
                    .with_seed(20 + i)
                    .init(tp, device)?,
                activation: ActivationFunc::Gelu,
                recompute_act: false,
            })
        })
        .collect::<Result<_, TpError>>()?;
    Ok(Net {
        blocks,
        norm: LayerNormConfig::new(H).init(device),
    })
}

/// How the last micro-batch leaves block 1 without a gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Unused {
    /// Every block runs and counts.
    None,
    /// Block 1 is skipped in the forward.
    Skipped,
    /// Block 1 runs (its parameters are hooked) but its output does not reach the loss.
    Detached,
}

impl Net {
    fn loss(&self, dp_rank: usize, micro: usize, device: &Device) -> Tensor<1> {
        self.loss_with(dp_rank, micro, device, Unused::None)
    }

    fn loss_with(
        &self,
        dp_rank: usize,
        micro: usize,
        device: &Device,
        unused: Unused,
    ) -> Tensor<1> {
        let x: Vec<f32> = (0..4 * H)
            .map(|i| ((i * 7 + dp_rank * 13 + micro * 5) % 11) as f32 / 11.0 - 0.5)
            .collect();
        let mut x = Tensor::<3>::from_data(TensorData::new(x, [2, 2, H]), device);
        for (i, b) in self.blocks.iter().enumerate() {
            match (i, unused) {
                (1, Unused::Skipped) => {}
                (1, Unused::Detached) => {
                    let _ = b.forward(x.clone());
                }
                _ => x = x.clone() + b.forward(x),
            }
        }
        self.norm.forward(x).powi_scalar(2).mean()
    }
}

fn grads_of(model: &Net, grads: &GradientsParams) -> Vec<Vec<f32>> {
    crate::param_grads::float_params(model)
        .into_iter()
        .map(|(id, rank)| {
            crate::param_grads::with_flat(grads, id, rank, |g| {
                g.into_data().iter::<f32>().collect()
            })
            .unwrap_or_default()
        })
        .collect()
}

/// Two micro-batches of `loss` with `reducer` active (the second as the last), then
/// `finalize_model_grads` with `DpReduction::Overlapped`: the reduced gradients.
fn overlapped_step(
    reducer: &OverlapReducer,
    model: &Net,
    tp: &Comm,
    config: &DataParallelConfig,
    loss: impl Fn(usize) -> Tensor<1>,
) -> Result<GradientsParams, CommError> {
    let mut acc = GradientsAccumulator::new();
    for micro in 0..2 {
        let _active = reducer.activate(micro == 1);
        acc.accumulate(
            model,
            GradientsParams::from_grads(loss(micro).backward(), model),
        );
    }
    let mut grads = acc.grads();
    finalize_model_grads(
        model,
        &mut grads,
        DpReduction::Overlapped(std::slice::from_ref(reducer)),
        tp,
        None,
        config,
    )?;
    Ok(grads)
}

/// One rank's grads reduced after backward, and per overlapped step (grads, events, buckets).
type RankRun = (Vec<Vec<f32>>, Vec<(Vec<Vec<f32>>, Vec<Event>, usize)>);

/// Every rank of TP 2 × DP 2, two micro-batches, small buckets.
fn run() -> Vec<RankRun> {
    run_on(LaunchOptions::default())
}

fn run_on(options: LaunchOptions) -> Vec<RankRun> {
    let config = ParallelConfig::new(4, 2, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    threads(&config, options, |ctx| {
        let (tp, dp, d) = (&ctx.groups.tp, &ctx.groups.dp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        // The reference: accumulate, then reduce after backward.
        let model = net(tp, d)?;
        let mut acc = GradientsAccumulator::new();
        for micro in 0..2 {
            let g = model.loss(dp_rank, micro, d).backward();
            acc.accumulate(&model, GradientsParams::from_grads(g, &model));
        }
        let mut sync = acc.grads();
        finalize_model_grads(
            &model,
            &mut sync,
            DpReduction::AllReduce(dp),
            tp,
            None,
            &dp_config,
        )?;
        let sync = grads_of(&model, &sync);

        let model = net(tp, d)?;
        let reducer = OverlapReducer::new(&model, dp, &dp_config);
        // Two steps: the first discovers which parameters are hooked, the second runs
        // with the hooked ones bucketed apart.
        let mut steps = Vec::new();
        for _ in 0..2 {
            let overlapped = overlapped_step(&reducer, &model, tp, &dp_config, |micro| {
                model.loss(dp_rank, micro, d)
            })?;
            let buckets = reducer.num_buckets();
            steps.push((grads_of(&model, &overlapped), reducer.events(), buckets));
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((sync, steps))
    })
    .unwrap()
}

#[test]
fn overlapped_reduction_equals_the_reduction_after_backward() {
    for (rank, (sync, steps)) in run().into_iter().enumerate() {
        for (step, (overlapped, _, _)) in steps.iter().enumerate() {
            assert_eq!(sync.len(), overlapped.len());
            for (i, (a, b)) in sync.iter().zip(overlapped).enumerate() {
                assert!(!a.is_empty(), "rank {rank} param {i} has a gradient");
                assert_eq!(a, b, "rank {rank} step {step} param {i}: bit-identical");
            }
        }
    }
}

/// The same on the wgpu device (lavapipe here): the main gradients, the buckets and their
/// concatenation are CubeCL tensors, filled by each rank's thread and read by its worker.
#[test]
#[cfg_attr(
    not(feature = "wgpu"),
    ignore = "needs --features wgpu and a Vulkan driver (Mesa's lavapipe)"
)]
fn on_wgpu_the_overlapped_reduction_equals_the_reduction_after_backward() {
    let device = match burn_megatron_kernels::device::wgpu_cpu_device() {
        Ok(device) => device.autodiff(),
        Err(e) => panic!("no wgpu device: {e}; install mesa-vulkan-drivers"),
    };
    let options = LaunchOptions::default().with_device(move |_| device.clone());
    for (rank, (sync, steps)) in run_on(options).into_iter().enumerate() {
        for (step, (overlapped, _, _)) in steps.iter().enumerate() {
            for (i, (a, b)) in sync.iter().zip(overlapped).enumerate() {
                assert!(!a.is_empty(), "rank {rank} param {i} has a gradient");
                assert_eq!(
                    a, b,
                    "wgpu rank {rank} step {step} param {i}: bit-identical"
                );
            }
        }
    }
}

/// Backward's hooks and `finish` read nothing back on the rank's thread: the main gradients
/// are tensors, and only the worker reads a bucket (on the host path). The norm's gradients,
/// which no hook delivers, are added at `finish` without a read too.
#[test]
fn the_overlapped_step_reads_nothing_back_on_the_rank_thread() {
    use burn_megatron_kernels::device::thread_host_reads;
    let config = ParallelConfig::new(2, 1, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    let reads = threads(&config, LaunchOptions::default(), |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        let model = net(tp, d)?;
        let dp = ctx.chunk_data_parallel_groups(1)?.remove(0);
        let reducer = OverlapReducer::new(&model, &dp, &dp_config);
        let mut per_step = Vec::new();
        for _ in 0..2 {
            let before = thread_host_reads();
            overlapped_step(&reducer, &model, tp, &dp_config, |micro| {
                model.loss(dp_rank, micro, d)
            })?;
            per_step.push(thread_host_reads() - before);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(per_step)
    })
    .unwrap();
    assert_eq!(reads, vec![vec![0, 0]; 2], "reads per rank and step");
}

/// A hooked gradient is held once, in its FP32 main gradient: Burn's gradients have no copy
/// of it between backward and `finish` (only the norm's, which no hook takes), and `finish`
/// writes every reduced gradient back, in the gradient's dtype.
#[test]
fn a_hooked_gradient_lives_only_in_its_main_gradient_until_finish() {
    let config = ParallelConfig::new(2, 1, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    threads(&config, LaunchOptions::default(), |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        let dp = ctx.chunk_data_parallel_groups(1)?.remove(0);
        let model = net(tp, d)?;
        let reducer = OverlapReducer::new(&model, &dp, &dp_config);
        for step in 0..2 {
            let mut grads = accumulate(&reducer, &model, dp_rank, 2, d, |micro| Some(micro == 1));
            let held = grads_of(&model, &grads);
            let (linears, norm) = held.split_at(held.len() - 2);
            assert!(
                linears.iter().all(Vec::is_empty),
                "step {step}: no linear gradient outside the reducer"
            );
            assert!(
                norm.iter().all(|g| !g.is_empty()),
                "step {step}: the norm's"
            );
            reducer.finish(&mut grads)?;
            let written = grads_of(&model, &grads);
            assert!(
                written.iter().all(|g| !g.is_empty()),
                "step {step}: all back"
            );
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap();
}

#[test]
fn buckets_are_handed_to_the_reduction_while_backward_still_runs() {
    for (rank, (_, steps)) in run().into_iter().enumerate() {
        // The second step, with the buckets laid out by hooks.
        let (_, events, buckets) = &steps[1];
        let (events, buckets) = (events.clone(), *buckets);
        assert!(buckets >= 3, "small buckets: {buckets}");
        let launches: Vec<usize> = events
            .iter()
            .filter_map(|e| match e {
                Event::Launch(b) => Some(*b),
                _ => None,
            })
            .collect();
        let mut sorted = launches.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            (0..buckets).collect::<Vec<_>>(),
            "rank {rank}: each bucket once"
        );
        // The worker may get the CPU late; what matters is that buckets are handed to it
        // (complete) while gradients are still being produced.
        let first_ready = events
            .iter()
            .position(|e| matches!(e, Event::Ready(_)))
            .unwrap();
        let hooks_after = events[first_ready..]
            .iter()
            .filter(|e| **e == Event::Hook)
            .count();
        assert!(
            hooks_after >= 4,
            "rank {rank}: a bucket must start before backward ends: {events:?}"
        );
    }
}

#[test]
fn finish_without_a_last_micro_batch_is_an_error_and_one_rank_needs_no_collective() {
    let config = ParallelConfig::new(1, 1, 1);
    threads(&config, LaunchOptions::default(), |ctx| {
        let (tp, dp, d) = (&ctx.groups.tp, &ctx.groups.dp, &ctx.device);
        let model = net(tp, d)?;
        let reducer = OverlapReducer::new(&model, dp, &DataParallelConfig::default());
        let mut grads = GradientsParams::new();
        let err = reducer.finish(&mut grads).unwrap_err().to_string();
        assert!(err.contains("no last micro-batch"), "{err}");
        let active = reducer.activate(true);
        let g = model.loss(0, 0, d).backward();
        drop(active);
        let mut grads = GradientsParams::from_grads(g, &model);
        assert_eq!(reducer.finish(&mut grads)?, 0);
        // The hooked gradients are back, as an equal model's plain backward has them.
        let reference = net(tp, d)?;
        let plain = GradientsParams::from_grads(reference.loss(0, 0, d).backward(), &reference);
        assert_eq!(grads_of(&model, &grads), grads_of(&reference, &plain));
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap();
}

/// A hooked layer without a gradient in the last micro-batch — skipped there, or run with
/// its output unused — neither hangs the reduction nor counts its earlier gradients twice:
/// the result equals the reduction after backward, bit for bit.
#[test]
fn a_layer_without_gradient_in_the_last_micro_batch_neither_hangs_nor_double_counts() {
    let config = ParallelConfig::new(4, 2, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    // A regression shows as a timeout error here, not as a hung test.
    let options = LaunchOptions::default().with_timeout(std::time::Duration::from_secs(20));
    threads(&config, options, |ctx| {
        let (tp, dp, d) = (&ctx.groups.tp, &ctx.groups.dp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        for unused in [Unused::Skipped, Unused::Detached] {
            let last = |micro: usize| if micro == 1 { unused } else { Unused::None };
            let model = net(tp, d)?;
            let mut acc = GradientsAccumulator::new();
            for micro in 0..2 {
                let g = model.loss_with(dp_rank, micro, d, last(micro)).backward();
                acc.accumulate(&model, GradientsParams::from_grads(g, &model));
            }
            let mut sync = acc.grads();
            finalize_model_grads(
                &model,
                &mut sync,
                DpReduction::AllReduce(dp),
                tp,
                None,
                &dp_config,
            )?;
            let reducer = OverlapReducer::new(&model, dp, &dp_config);
            for step in 0..2 {
                let overlapped = overlapped_step(&reducer, &model, tp, &dp_config, |micro| {
                    model.loss_with(dp_rank, micro, d, last(micro))
                })?;
                let (a, b) = (grads_of(&model, &sync), grads_of(&model, &overlapped));
                assert_eq!(a, b, "{unused:?} step {step}: as after backward");
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap();
}

/// One rank's accumulated gradients over `micros` micro-batches of `model.loss`, with
/// `activate(micro)` saying whether (and with which `last`) the reducer is active for each.
fn accumulate(
    reducer: &OverlapReducer,
    model: &Net,
    dp_rank: usize,
    micros: usize,
    device: &Device,
    activate: impl Fn(usize) -> Option<bool>,
) -> GradientsParams {
    let mut acc = GradientsAccumulator::new();
    for micro in 0..micros {
        let _active = activate(micro).map(|last| reducer.activate(last));
        let g = model.loss(dp_rank, micro, device).backward();
        acc.accumulate(model, GradientsParams::from_grads(g, model));
    }
    acc.grads()
}

/// The usual `no_sync` mistake: the reducer activated on the last micro-batch only. Its
/// hooked gradients would hold that micro-batch alone; `finish` refuses the step instead,
/// names a parameter and leaves the gradients as they were. The same reducer then reduces
/// a correct step exactly as `finalize_model_grads`.
#[test]
fn a_reducer_activated_on_the_last_micro_batch_only_is_an_error() {
    let config = ParallelConfig::new(2, 1, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    let options = LaunchOptions::default().with_timeout(std::time::Duration::from_secs(20));
    threads(&config, options, |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        let dp = ctx.chunk_data_parallel_groups(1)?.remove(0);
        for micros in [2, 3] {
            let model = net(tp, d)?;
            let reducer = OverlapReducer::new(&model, &dp, &dp_config);
            let mut grads = accumulate(&reducer, &model, dp_rank, micros, d, |micro| {
                (micro + 1 == micros).then_some(true)
            });
            let before = grads_of(&model, &grads);
            let err = reducer.finish(&mut grads).unwrap_err().to_string();
            let inactive = format!(
                "received {} gradient(s) while the reducer was inactive",
                micros - 1
            );
            assert!(err.contains(&inactive), "{err}");
            assert!(err.contains("parameter blocks.0.dense_h_to_4h."), "{err}");
            assert!(err.contains("1 micro-batch(es) activated"), "{err}");
            assert_eq!(grads_of(&model, &grads), before, "gradients untouched");

            // The correct use, on the same reducer, matches the reduction after backward
            // (of an equal model: a backward through the reducer's own parameters while
            // it is inactive would count against its step).
            let reference = net(tp, d)?;
            let mut sync = accumulate(&reducer, &reference, dp_rank, micros, d, |_| None);
            finalize_model_grads(
                &reference,
                &mut sync,
                DpReduction::AllReduce(&ctx.groups.dp),
                tp,
                None,
                &dp_config,
            )?;
            let mut overlapped = accumulate(&reducer, &model, dp_rank, micros, d, |micro| {
                Some(micro + 1 == micros)
            });
            reducer.finish(&mut overlapped)?;
            assert_eq!(grads_of(&model, &overlapped), grads_of(&reference, &sync));
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap();
}

/// `last` on every micro-batch: the first one's backward hands buckets to the reduction,
/// and the next micro-batch's gradients come after them. An error, not a dropped gradient.
#[test]
fn gradients_after_their_bucket_went_out_are_an_error() {
    let config = ParallelConfig::new(2, 1, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    let options = LaunchOptions::default().with_timeout(std::time::Duration::from_secs(20));
    threads(&config, options, |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        let dp = ctx.chunk_data_parallel_groups(1)?.remove(0);
        let model = net(tp, d)?;
        let reducer = OverlapReducer::new(&model, &dp, &dp_config);
        let mut grads = accumulate(&reducer, &model, dp_rank, 2, d, |_| Some(true));
        let err = reducer.finish(&mut grads).unwrap_err().to_string();
        assert!(
            err.contains("after its bucket was handed to the reduction"),
            "{err}"
        );
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap();
}

/// The reducer's communicator is a channel of its own: a caller's all-reduce on
/// `groups.dp` while the worker reduces buckets pairs with the other ranks' all-reduce,
/// not with a bucket. Rank 1 all-reduces before its last backward (its worker has sent
/// nothing yet), rank 0 once its worker has started on a bucket: on a shared channel,
/// rank 1's call would meet rank 0's bucket.
#[test]
fn a_caller_collective_on_dp_is_not_paired_with_the_reducer_worker() {
    let config = ParallelConfig::new(2, 1, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    let options = LaunchOptions::default().with_timeout(std::time::Duration::from_secs(20));
    threads(&config, options, |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let dp_rank = ctx.state.data_parallel_rank();
        let model = net(tp, d)?;
        let mut sync = accumulate_plain(&model, dp_rank, d);
        finalize_model_grads(
            &model,
            &mut sync,
            DpReduction::AllReduce(&ctx.groups.dp),
            tp,
            None,
            &dp_config,
        )?;

        let dp = ctx.chunk_data_parallel_groups(1)?.remove(0);
        let reducer = OverlapReducer::new(&model, &dp, &dp_config);
        let caller = || -> Result<Vec<f32>, CommError> {
            let mut buf = Buffer::F32(vec![dp_rank as f32 + 1.0; 4]);
            ctx.groups.dp.all_reduce(&mut buf, ReduceOp::Sum)?;
            match buf {
                Buffer::F32(v) => Ok(v),
                _ => unreachable!("an f32 reduction returns f32"),
            }
        };
        let mut acc = GradientsAccumulator::new();
        let mut summed = None;
        for micro in 0..2 {
            let _active = reducer.activate(micro == 1);
            let loss = model.loss(dp_rank, micro, d);
            if micro == 1 && dp_rank == 1 {
                summed = Some(caller()?);
            }
            acc.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            if micro == 1 && dp_rank == 0 {
                // Once the worker has taken a bucket (and had time to start on it).
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !reducer
                    .events()
                    .iter()
                    .any(|e| matches!(e, Event::Launch(_)))
                {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "no bucket was launched"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
                summed = Some(caller()?);
            }
        }
        let mut grads = acc.grads();
        assert!(
            reducer.finish(&mut grads)? >= 3,
            "several buckets were reduced"
        );
        assert_eq!(summed, Some(vec![3.0; 4]), "the caller's own sum");
        assert_eq!(grads_of(&model, &grads), grads_of(&model, &sync));
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .unwrap();
}

/// Two micro-batches of `model.loss`, accumulated without a reducer.
fn accumulate_plain(model: &Net, dp_rank: usize, device: &Device) -> GradientsParams {
    let mut acc = GradientsAccumulator::new();
    for micro in 0..2 {
        let g = model.loss(dp_rank, micro, device).backward();
        acc.accumulate(model, GradientsParams::from_grads(g, model));
    }
    acc.grads()
}

mod join;
