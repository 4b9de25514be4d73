//! A Burn CNN (the layers of tracel-ai's ResNet: `Conv2d`, `BatchNorm`, pooling, `Linear`;
//! its second norm chosen by config, through Burn's `Normalization` wrapper)
//! trained data-parallel through `ParallelTraining`, as a Burn user builds it: on each rank,
//! from Burn's initializers. Those draw apart on every rank, so the replicas are refused
//! until `broadcast_params` gives them the first rank's weights and buffers; then DP 2 trains
//! as one rank that averages the losses of the two ranks' batches (each `BatchNorm`
//! normalising over its own half, as under data parallelism).

use super::Error;
use burn::module::{Module, RunningState};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::dropin::nn::conv::{Conv2d, Conv2dConfig};
use burn_megatron::dropin::nn::loss::CrossEntropyLossConfig;
use burn_megatron::dropin::nn::norm::{Normalization, NormalizationConfig};
use burn_megatron::dropin::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn_megatron::dropin::nn::{
    BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d,
};
use burn_megatron::dropin::save_gathered;
use burn_megatron::launch::{LaunchOptions, RankContext, threads};
use burn_megatron::optimizer::{InnerOptimizer, MegatronOptimizer};
use burn_megatron::topology::ParallelConfig;
use burn_megatron::training::{ParallelTraining, ParallelTrainingConfig};
use burn_megatron_tests::values;
use std::path::Path;
use std::sync::Arc;

/// Samples per data-parallel rank and step.
const LOCAL: usize = 4;
const STEPS: usize = 3;

#[derive(Module, Debug)]
struct Cnn {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: Normalization,
    pool: AdaptiveAvgPool2d,
    head: Linear,
}

impl Cnn {
    fn new(device: &Device) -> Self {
        let conv = |i, o| {
            Conv2dConfig::new([i, o], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        Self {
            conv1: conv(3, 8),
            bn1: BatchNormConfig::new(8).init(device),
            conv2: conv(8, 8),
            bn2: NormalizationConfig::Batch(BatchNormConfig::new(8)).init(device),
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(8, 4).init(device),
        }
    }

    /// The mean cross-entropy of images `first..first + n` (3 × 8 × 8, four classes).
    fn loss(&self, first: usize, n: usize, device: &Device) -> Tensor<1> {
        let x: Vec<f32> = (first * 192..(first + n) * 192)
            .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
            .collect();
        let x = Tensor::<4>::from_data(TensorData::new(x, [n, 3, 8, 8]), device);
        let y: Vec<i64> = (first..first + n).map(|i| (i % 4) as i64).collect();
        let y = Tensor::<1, Int>::from_data(TensorData::new(y, [n]), device);
        let relu = burn::tensor::activation::relu;
        let h = relu(self.bn1.forward(self.conv1.forward(x)));
        let h = relu(self.bn2.forward(self.conv2.forward(h)));
        let logits = self.head.forward(self.pool.forward(h).reshape([n, 8]));
        CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits, y)
            .reshape([1])
    }

    /// The trained weights compared between runs.
    fn weights(&self) -> Vec<f32> {
        [
            values(self.conv1.weight.val()),
            values(self.bn1.gamma.val()),
            values(self.conv2.weight.val()),
            values(self.head.weight.val()),
        ]
        .concat()
    }

    /// Both `BatchNorm`s' running means and variances, their last update included.
    fn statistics(&self) -> Vec<f32> {
        let model = self.valid();
        let Normalization::Batch(bn2) = &model.bn2 else {
            panic!("bn2 is built as a batch norm")
        };
        let bn1 = &model.bn1;
        [
            &bn1.running_mean,
            &bn1.running_var,
            &bn2.running_mean,
            &bn2.running_var,
        ]
        .map(|state| values(state.value()))
        .concat()
    }
}

/// `config`'s training state of a model in one stage: checkpoints name its parameters by
/// their module paths.
fn init<M: Module>(
    config: &ParallelTrainingConfig,
    ctx: &RankContext,
    chunks: &[M],
) -> Result<ParallelTraining, Error> {
    let names = Arc::new(|path: &str| path.to_string());
    Ok(config.init(ctx, chunks, names)?)
}

/// Burn's AdamW, the optimizer every run here steps.
fn adamw() -> InnerOptimizer {
    AdamWConfig::new().init().into()
}

/// One data-parallel step on this rank's images: the model after it, and its loss averaged
/// over the ranks.
fn dp_step(
    ctx: &RankContext,
    training: &ParallelTraining,
    optimizer: &mut MegatronOptimizer<Vec<Cnn>>,
    chunks: Vec<Cnn>,
) -> Result<(Vec<Cnn>, f32), Error> {
    let rank = ctx.state.data_parallel_rank();
    let loss = chunks[0].loss(rank * LOCAL, LOCAL, &ctx.device);
    let mut value = vec![loss.clone().into_scalar::<f32>()];
    let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
    training.finalize(&chunks, &mut grads)?;
    let (chunks, _) = optimizer.step(1e-2, chunks, grads)?;
    ctx.groups.dp.all_reduce_vec(&mut value, ReduceOp::Avg)?;
    Ok((chunks, value[0]))
}

/// What a rank of [`train`] ends with.
#[derive(Debug)]
struct Trained {
    /// Each step's loss, averaged over the data-parallel ranks.
    losses: Vec<f32>,
    weights: Vec<f32>,
    /// `bn1`'s running mean as training began, as it ended (its last update included), and
    /// before the last step (rank 0).
    initial_mean: Vec<f32>,
    final_mean: Vec<f32>,
    plain_mean: Vec<f32>,
}

/// Each rank of a DP 2 run (with the distributed optimizer when `distributed`) of models
/// drawn on each rank, with each rank's own running
/// mean set to its rank (as a record loaded per rank would set it). With `broadcast`, the
/// replicas are broadcast first and rank 0 saves its model at `record`; the run ends with a
/// checkpoint under `root`, and rank 0 saves its plain record at `root/plain` before the last
/// step.
fn train(
    distributed: bool,
    broadcast: bool,
    record: &Path,
    root: &Path,
) -> Result<Vec<Trained>, Error> {
    let out = threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let (d, rank) = (&ctx.device, ctx.state.data_parallel_rank());
            let mut cnn = Cnn::new(d);
            cnn.bn1.running_mean = RunningState::new(Tensor::full([8], rank as f32, d));
            let mut chunks = vec![cnn];
            let config = ParallelTrainingConfig::new().with_use_distributed_optimizer(distributed);
            let training = init(&config, &ctx, &chunks)?;
            if broadcast {
                chunks = training.broadcast_params(chunks)?;
            }
            let initial_mean = values(chunks[0].bn1.running_mean.value());
            if broadcast && rank == 0 {
                chunks[0].clone().save_file(record)?;
            }
            let mut optimizer = training.optimizer(adamw(), &chunks)?;
            let mut losses = Vec::new();
            let mut plain_mean = Vec::new();
            for step in 0..STEPS {
                if step == STEPS - 1 && rank == 0 {
                    // Back to a plain record before the last step, which Burn's own
                    // `load_file` reads (the checkpoint below must commit its own update).
                    std::fs::create_dir_all(root)?;
                    save_gathered(&chunks[0], root.join("plain"), &ctx.groups.tp)?;
                    plain_mean = values(chunks[0].valid().bn1.running_mean.value());
                }
                let loss;
                (chunks, loss) = dp_step(&ctx, &training, &mut optimizer, chunks)?;
                losses.push(loss);
            }
            training.save(root, STEPS, &chunks, &optimizer, serde_json::json!({}))?;
            // `valid()` commits the statistics' last update, which Burn holds apart until
            // the next forward.
            let final_mean = values(chunks[0].valid().bn1.running_mean.value());
            Ok::<_, Error>(Trained {
                losses,
                weights: chunks[0].weights(),
                initial_mean,
                final_mean,
                plain_mean,
            })
        },
    )?;
    Ok(out)
}

/// A run's losses, weights and running statistics.
type Run = (Vec<f32>, Vec<f32>, Vec<f32>);

/// One rank from `record` over the DP 2 run's batch: each step's loss the mean of two
/// forwards, one per half (what DP 2 computes, each `BatchNorm` over its own half), or with
/// `whole` one forward over both halves (what DP 2 computes with synchronised `BatchNorm`s).
/// Its losses, weights and running statistics.
fn one_rank(record: &Path, whole: bool) -> Result<Run, Error> {
    let out = threads(
        &ParallelConfig::new(1, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let d = &ctx.device;
            let chunks = vec![Cnn::new(d).load_file(record)];
            let training = init(&ParallelTrainingConfig::new(), &ctx, &chunks)?;
            let mut optimizer = training.optimizer(adamw(), &chunks)?;
            let mut chunks = chunks;
            let mut losses = Vec::new();
            for _ in 0..STEPS {
                let loss = match whole {
                    true => chunks[0].loss(0, 2 * LOCAL, d),
                    false => {
                        let [a, b] = [0, LOCAL].map(|first| chunks[0].loss(first, LOCAL, d));
                        (a + b) / 2.0
                    }
                };
                losses.push(loss.clone().into_scalar::<f32>());
                let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
                training.finalize(&chunks, &mut grads)?;
                (chunks, _) = optimizer.step(1e-2, chunks, grads)?;
            }
            let statistics = chunks[0].statistics();
            Ok::<_, Error>((losses, chunks[0].weights(), statistics))
        },
    )?;
    Ok(out.into_iter().next().unwrap_or_default())
}

/// `bn1`'s running mean of the checkpoint under `root`, loaded at DP 1.
fn resumed_mean(root: &Path) -> Result<Vec<f32>, Error> {
    let out = threads(
        &ParallelConfig::new(1, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let chunks = vec![Cnn::new(&ctx.device)];
            let mut training = init(&ParallelTrainingConfig::new(), &ctx, &chunks)?;
            let make = |t: &ParallelTraining, m: &Vec<Cnn>| t.optimizer(adamw(), m);
            let restored = training.load(root, Some(STEPS), chunks, make, false)?;
            Ok::<_, Error>(values(restored.model[0].bn1.running_mean.value()))
        },
    )?;
    Ok(out.into_iter().next().unwrap_or_default())
}

#[test]
fn a_burn_cnn_trains_at_dp_2_as_one_rank_once_its_replicas_are_broadcast() -> Result<(), Error> {
    for distributed in [true, false] {
        let dir = super::load::scratch(&format!("cnn-{distributed}"));
        let (record, root) = (dir.join("initial"), dir.join("checkpoints"));
        let ranks = train(distributed, true, &record, &root)?;
        let what = |rank| format!("rank {rank}, distributed optimizer {distributed}");
        // The buffers came from rank 0 as well.
        for (rank, trained) in ranks.iter().enumerate() {
            assert_eq!(trained.initial_mean, vec![0.0; 8], "{}", what(rank));
        }
        let (losses, weights, _) = one_rank(&record, false)?;
        for (rank, trained) in ranks.iter().enumerate() {
            let loss_diff = super::max_abs_diff(&trained.losses, &losses);
            let weight_diff = super::max_abs_diff(&trained.weights, &weights);
            assert!(
                loss_diff < 1e-5 && weight_diff < 1e-5,
                "{}: losses {:?} against {losses:?}, weights off by {weight_diff}",
                what(rank),
                trained.losses
            );
        }
        // The checkpoint holds rank 0's statistics, their last update included, and resumes
        // at DP 1 with them; so does the plain record, from the step before.
        let resumed = resumed_mean(&root)?;
        assert_eq!(resumed, ranks[0].final_mean, "resumed, {}", what(0));
        let plain = Cnn::new(&Device::flex()).load_file(root.join("plain"));
        let plain_mean = values(plain.bn1.running_mean.value());
        assert_eq!(plain_mean, ranks[0].plain_mean, "plain record, {}", what(0));
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}

/// Each rank's losses (averaged over the ranks), weights and running statistics after a DP 2
/// run whose `BatchNorm`s are synchronised; rank 0 saves the broadcast model at `record`.
fn train_synchronised(record: &Path) -> Result<Vec<Run>, Error> {
    let out = threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let (d, rank) = (&ctx.device, ctx.state.data_parallel_rank());
            let chunks = vec![Cnn::new(d)];
            let training = init(&ParallelTrainingConfig::new(), &ctx, &chunks)?;
            let chunks = training.broadcast_params(chunks)?;
            if rank == 0 {
                chunks[0].clone().save_file(record)?;
            }
            let mut chunks = training.sync_batch_norm(chunks)?;
            let mut optimizer = training.optimizer(adamw(), &chunks)?;
            let mut losses = Vec::new();
            for _ in 0..STEPS {
                let loss;
                (chunks, loss) = dp_step(&ctx, &training, &mut optimizer, chunks)?;
                losses.push(loss);
            }
            Ok::<_, Error>((losses, chunks[0].weights(), chunks[0].statistics()))
        },
    )?;
    Ok(out)
}

/// With synchronised `BatchNorm`s, DP 2 trains as one rank over both ranks' batches at once:
/// the same losses, weights and running statistics (which every rank then holds alike).
#[test]
fn a_burn_cnn_with_synchronised_batch_norm_at_dp_2_trains_as_one_rank_over_the_whole_batch()
-> Result<(), Error> {
    let dir = super::load::scratch("cnn-sync");
    let record = dir.join("initial");
    let ranks = train_synchronised(&record)?;
    let (losses, weights, statistics) = one_rank(&record, true)?;
    for (rank, (l, w, s)) in ranks.iter().enumerate() {
        let diffs = [
            super::max_abs_diff(l, &losses),
            super::max_abs_diff(w, &weights),
            super::max_abs_diff(s, &statistics),
        ];
        assert!(
            diffs.iter().all(|d| *d < 1e-5),
            "rank {rank}: losses {l:?} against {losses:?}; weights and statistics off by {:?}",
            &diffs[1..]
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn replicas_drawn_apart_are_refused_at_the_first_finalize_naming_the_parameter() {
    let dir = super::load::scratch("cnn_apart");
    let err = train(true, false, &dir.join("unused"), &dir).expect_err("replicas that differ");
    let message = err.to_string();
    assert!(
        message.contains("conv1.weight`") && message.contains("broadcast_params"),
        "{message}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A broadcast after the optimizer was built would be undone by its first step (it copied
/// each replica's own weights): it is refused on every rank.
#[test]
fn a_broadcast_after_the_optimizer_is_built_is_refused() -> Result<(), Error> {
    let messages = threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let chunks = vec![Cnn::new(&ctx.device)];
            let training = init(&ParallelTrainingConfig::new(), &ctx, &chunks)?;
            let _optimizer = training.optimizer(adamw(), &chunks)?;
            let refused = training.broadcast_params(chunks).err();
            Ok::<_, Error>(refused.map(|e| e.to_string()).unwrap_or_default())
        },
    )?;
    for message in messages {
        assert!(message.contains("then build the optimizer"), "{message:?}");
    }
    Ok(())
}

/// A layer every rank holds whole: Burn's draw on the first pipeline stage, a constant on
/// any other.
#[derive(Module, Debug)]
struct Whole {
    layer: Linear,
}

/// Each rank's `finalize` error (empty when none) on a `layout` of [`Whole`] models, drawn by
/// Burn on the first pipeline stage only, after `broadcast_params` with `broadcast`; and the
/// layer's weight as the step began.
fn finalize_whole(
    layout: ParallelConfig,
    broadcast: bool,
) -> Result<Vec<(String, Vec<f32>)>, Error> {
    let options = LaunchOptions::default().with_timeout(std::time::Duration::from_secs(20));
    let out = threads(&layout, options, |ctx| {
        let d = &ctx.device;
        let config = LinearConfig::new(4, 4);
        let config = match ctx.state.pipeline_model_parallel_rank() {
            0 => config,
            _ => config.with_initializer(burn::nn::Initializer::Constant { value: 0.5 }),
        };
        let mut chunks = vec![Whole {
            layer: config.init(d),
        }];
        let training = init(&ParallelTrainingConfig::new(), &ctx, &chunks)?;
        if broadcast {
            chunks = training.broadcast_params(chunks)?;
        }
        let weight = values(chunks[0].layer.weight.val());
        let loss = chunks[0].layer.forward(Tensor::<2>::ones([2, 4], d)).sum();
        let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
        let refused = training.finalize(&chunks, &mut grads).err();
        Ok::<_, Error>((refused.map(|e| e.to_string()).unwrap_or_default(), weight))
    })?;
    Ok(out)
}

/// At PP 2 × DP 2 only the first stage's replicas differ: the ranks of the second stage's
/// data-parallel group fail as well, saying why, rather than wait for peers that stopped.
#[test]
fn replicas_that_differ_in_one_group_fail_every_rank() -> Result<(), Error> {
    let ranks = finalize_whole(ParallelConfig::new(4, 1, 2), false)?;
    for (rank, (message, _)) in ranks.iter().enumerate() {
        let want = match rank < 2 {
            true => "data-parallel replicas hold different values of `0.layer.weight`",
            false => "the replicas of another data-parallel group differ",
        };
        assert!(message.contains(want), "rank {rank}: {message:?}");
    }
    Ok(())
}

/// A layer no plan splits is whole on every tensor-parallel rank, which must hold the same
/// copy: Burn's draws on two TP ranks are refused, and `broadcast_params` gives the second
/// rank the first one's.
#[test]
fn a_whole_layer_drawn_apart_on_tensor_parallel_ranks_is_refused_until_broadcast()
-> Result<(), Error> {
    let apart = finalize_whole(ParallelConfig::new(2, 2, 1), false)?;
    for (rank, (message, _)) in apart.iter().enumerate() {
        let want = "tensor-parallel ranks hold different values of `0.layer.weight`";
        assert!(message.contains(want), "rank {rank}: {message:?}");
    }
    let broadcast = finalize_whole(ParallelConfig::new(2, 2, 1), true)?;
    assert_eq!(broadcast[0], (String::new(), broadcast[1].1.clone()));
    assert_eq!(broadcast[1].0, "");
    Ok(())
}

/// `dropin::nn::norm::Normalization` is Burn's wrapper: each variant has Burn's module paths,
/// loads Burn's record and computes Burn's output and input gradient bit for bit (a batch
/// norm training on the batch's statistics, unsynchronised); and a model holding Burn's own
/// wrapper of Burn's batch norm is refused by `sync_batch_norm`, naming it.
#[test]
fn the_normalization_wrapper_is_burns_and_its_batch_norm_can_sync() -> Result<(), Error> {
    use burn::nn::norm as burns;
    use burn_megatron::data_parallel::advanced::sync_batch_norm;
    let pairs = [
        (
            burns::NormalizationConfig::Identity,
            NormalizationConfig::Identity,
        ),
        (
            burns::BatchNormConfig::new(4).with_momentum(0.3).into(),
            BatchNormConfig::new(4).with_momentum(0.3).into(),
        ),
        (
            burns::GroupNormConfig::new(2, 4).into(),
            burns::GroupNormConfig::new(2, 4).into(),
        ),
        (
            burns::InstanceNormConfig::new(4).into(),
            burns::InstanceNormConfig::new(4).into(),
        ),
        (
            burns::LayerNormConfig::new(3).into(),
            burns::LayerNormConfig::new(3).into(),
        ),
        (
            burns::RmsNormConfig::new(3).into(),
            burns::RmsNormConfig::new(3).into(),
        ),
    ];
    let d = Device::flex().autodiff();
    let x: Vec<f32> = (0..24).map(|i| (i * 7 % 11) as f32 / 3.0 - 1.5).collect();
    let x = Tensor::<3>::from_data(TensorData::new(x, [2, 4, 3]), &d);
    let w = x.clone().cos();
    for (burns, ours) in pairs {
        let what = format!("{burns:?}");
        let theirs = burns.init(&d);
        let mine = ours.init(&d).load_record(theirs.clone().into_record());
        assert_eq!(super::paths(&mine), super::paths(&theirs), "{what}");
        assert_eq!(mine.num_features(), theirs.num_features(), "{what}");
        let run = |forward: &dyn Fn(Tensor<3>) -> Tensor<3>| {
            let x = x.clone().require_grad();
            let y = forward(x.clone());
            let grads = (y.clone() * w.clone()).sum().backward();
            let dx = x.grad(&grads).map(values).unwrap_or_default();
            (values(y), dx)
        };
        let want = run(&|x| theirs.forward(x));
        assert_eq!(run(&|x| mine.forward(x)), want, "{what}");
    }
    #[derive(Module, Debug)]
    struct WithBurns {
        norm: burns::Normalization,
    }
    let model = WithBurns {
        norm: burns::BatchNormConfig::new(4).init(&d).into(),
    };
    let message = sync_batch_norm(model, &super::solo())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        message.contains("norm") && message.contains("Burn's own BatchNorm"),
        "{message:?}"
    );
    Ok(())
}
