use super::*;
use crate::data_parallel::{finalize_model_grads, finalize_model_grads_overlapped};
use crate::launch::{LaunchOptions, threads};
use crate::models::ParallelMlp;
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
                dense_4h_to_h: RowParallelLinearConfig::new(4 * H, H)
                    .with_seed(20 + i)
                    .init(tp, device)?,
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
    float_params(model)
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
/// `finalize_model_grads_overlapped`: the reduced gradients.
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
    finalize_model_grads_overlapped(
        std::slice::from_ref(reducer),
        model,
        &mut grads,
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
    let config = ParallelConfig::new(4, 2, 1);
    let dp_config = DataParallelConfig {
        bucket_size: Some(100),
        ..DataParallelConfig::default()
    };
    threads(&config, LaunchOptions::default(), |ctx| {
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
        finalize_model_grads(&model, &mut sync, dp, tp, None, &dp_config)?;
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
        let before = grads_of(&model, &grads);
        assert_eq!(reducer.finish(&mut grads)?, 0);
        assert_eq!(grads_of(&model, &grads), before);
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
            finalize_model_grads(&model, &mut sync, dp, tp, None, &dp_config)?;
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
