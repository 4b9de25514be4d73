use super::*;
use crate::comm::solo_group;
use crate::launch::{LaunchOptions, threads};
use crate::module_path::{PathVisitor, visit_paths};
use crate::topology::ParallelConfig;
use burn::tensor::{DType, Tensor, TensorData};

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Samples `first..first + n` of a `[*, 2, 4]` batch, and the weights of a loss over them
/// (a sum alone would give the input no gradient through the normalisation).
fn batch(first: usize, n: usize, device: &Device) -> (Tensor<3>, Tensor<3>) {
    let make = |k: usize, m: usize| {
        let v: Vec<f32> = (first * 8..(first + n) * 8)
            .map(|i| ((i * k) % m) as f32 / m as f32 - 0.5)
            .collect();
        Tensor::<3>::from_data(TensorData::new(v, [n, 2, 4]), device)
    };
    (make(37, 23) * 3.0 + 1.0, make(11, 7))
}

/// Burn's `BatchNorm` (momentum 0.3) over `x`: its output, the input's gradient, gamma's and
/// beta's, and its running mean and variance once updated.
fn normalise(layer: &BatchNorm, x: Tensor<3>, w: Tensor<3>) -> [Vec<f32>; 6] {
    let x = x.require_grad();
    let y = layer.forward(x.clone());
    let grads = (y.clone() * w).sum().backward();
    let gamma = layer.gamma.val().grad(&grads).expect("gamma's gradient");
    let beta = layer.beta.val().grad(&grads).expect("beta's gradient");
    let layer = layer.valid();
    [
        values(y),
        values(x.grad(&grads).expect("x's gradient")),
        values(gamma),
        values(beta),
        values(layer.running_mean.value()),
        values(layer.running_var.value()),
    ]
}

/// Three samples on one rank and five on the other: each rank's output and input gradient
/// are the rows of one rank's over all eight, gamma's and beta's gradients sum to its, and
/// the running statistics are its on both ranks.
#[test]
fn a_synchronised_batch_norm_at_dp_2_normalises_as_one_rank_over_both_batches() {
    let ranks = threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let d = &ctx.device;
            let rank = ctx.state.data_parallel_rank();
            let burns = burn::nn::BatchNormConfig::new(2).with_momentum(0.3);
            let layer = sync_batch_norm(BatchNorm::from(burns.init(d)), &ctx.groups.dp_cp)?;
            let (first, n) = [(0, 3), (3, 5)][rank];
            let (x, w) = batch(first, n, d);
            let synced = normalise(&layer, x, w);
            let (x, w) = batch(0, 8, d);
            let whole = normalise(&BatchNorm::from(burns.init(d)), x, w);
            Ok::<_, CommError>((first * 8..(first + n) * 8, synced, whole))
        },
    )
    .expect("both ranks normalise");
    let whole = &ranks[0].2;
    let mut param_grads = [vec![0.0; 2], vec![0.0; 2]];
    for (rank, (rows, synced, _)) in ranks.iter().enumerate() {
        for (i, what) in ["output", "input gradient"].into_iter().enumerate() {
            let diff = max_diff(&synced[i], &whole[i][rows.clone()]);
            assert!(diff < 1e-5, "rank {rank}'s {what} off by {diff}");
        }
        for (i, what) in [(4, "running mean"), (5, "running variance")] {
            let diff = max_diff(&synced[i], &whole[i]);
            assert!(diff < 1e-6, "rank {rank}'s {what} off by {diff}");
        }
        for (sum, grad) in param_grads.iter_mut().zip(&synced[2..4]) {
            sum.iter_mut().zip(grad).for_each(|(s, g)| *s += g);
        }
    }
    for (i, what) in ["gamma", "beta"].into_iter().enumerate() {
        let diff = max_diff(&param_grads[i], &whole[2 + i]);
        assert!(diff < 1e-5, "{what}'s gradients summed off by {diff}");
    }
}

/// Until a group is set, the layer is Burn's: the same values bit for bit, and the same
/// parameter paths (so the same record).
#[test]
fn an_unsynchronised_batch_norm_is_burns() {
    let d = Device::flex().autodiff();
    let burns = burn::nn::BatchNormConfig::new(2)
        .with_momentum(0.3)
        .init(&d);
    let ours = sync_batch_norm(BatchNorm::from(burns.clone()), &solo_group("dp")).expect("ours");
    let (x, w) = batch(0, 5, &d);
    let run = |y: Tensor<3>, x: Tensor<3>| {
        let grads = (y.clone() * w.clone()).sum().backward();
        [values(y), values(x.grad(&grads).expect("x's gradient"))]
    };
    let x1 = x.clone().require_grad();
    let theirs = run(burns.forward(x1.clone()), x1);
    let x2 = x.require_grad();
    assert_eq!(run(ours.forward(x2.clone()), x2), theirs);
    let (burns, ours) = (burns.valid(), ours.valid());
    assert_eq!(
        values(ours.running_var.value()),
        values(burns.running_var.value())
    );
    struct Paths(Vec<String>);
    impl PathVisitor for Paths {
        fn visit<const D: usize>(&mut self, path: &str, _: &burn::module::Param<Tensor<D>>) {
            self.0.push(path.to_string());
        }
    }
    let (mut a, mut b) = (Paths(Vec::new()), Paths(Vec::new()));
    visit_paths(&burns, &mut a);
    visit_paths(&ours, &mut b);
    assert_eq!(a.0, b.0);
}

#[derive(Module, Debug)]
struct Mixed {
    ours: BatchNorm,
    blocks: Vec<burn::nn::BatchNorm>,
}

#[test]
fn burns_own_batch_norm_is_refused_naming_it() {
    let d = Device::flex();
    let model = Mixed {
        ours: BatchNormConfig::new(2).init(&d),
        blocks: vec![burn::nn::BatchNormConfig::new(2).init(&d)],
    };
    let e = sync_batch_norm(model, &solo_group("dp")).expect_err("Burn's layer");
    let message = e.to_string();
    assert!(
        message.contains("`blocks.0` is Burn's own BatchNorm") && message.contains("dropin::nn"),
        "{message}"
    );
}

/// In bf16 the statistics are still summed in f32: over 512 values near 11 per channel, the
/// output is the f32 layer's on the same rounded input within bf16's rounding of it (0.004;
/// statistics summed in bf16 put it 0.016 off), and the running statistics keep their own
/// dtype.
#[test]
fn a_synchronised_batch_norm_in_bf16_sums_its_statistics_in_f32() {
    let ranks = threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let d = &ctx.device;
            let rank = ctx.state.data_parallel_rank();
            let burns = burn::nn::BatchNormConfig::new(2);
            let layer = sync_batch_norm(BatchNorm::from(burns.init(d)), &ctx.groups.dp_cp)?;
            let (x, _) = batch(64 * rank, 64, d);
            let x = (x + 10.0).cast(DType::BF16);
            let y = layer.forward(x.clone());
            let dtype = y.dtype();
            let f32_layer = sync_batch_norm(BatchNorm::from(burns.init(d)), &ctx.groups.dp_cp)?;
            let want = f32_layer.forward(x.cast(DType::F32));
            let stats = layer.valid().running_var.value().dtype();
            Ok::<_, CommError>((values(y.cast(DType::F32)), values(want), dtype, stats))
        },
    )
    .expect("both ranks normalise");
    for (rank, (got, want, dtype, stats)) in ranks.into_iter().enumerate() {
        assert_eq!((dtype, stats), (DType::BF16, DType::F32), "rank {rank}");
        let diff = max_diff(&got, &want);
        assert!(diff < 6e-3, "rank {rank}'s bf16 output off by {diff}");
    }
}
