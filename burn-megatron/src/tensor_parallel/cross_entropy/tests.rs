use super::*;
use crate::comm::CommError;
use crate::launch::{LaunchOptions, threads};
use crate::topology::ParallelConfig;
use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Device, TensorData};
use std::time::Duration;

const N: usize = 6;
const V: usize = 8;

/// Full logits with a wide range, and targets spread over every slice.
fn full_logits(device: &Device) -> Tensor<2> {
    let v: Vec<f32> = (0..N * V)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7 + if i % 9 == 0 { 30.0 } else { 0.0 })
        .collect();
    Tensor::from_data(TensorData::new(v, [N, V]), device)
}

fn targets(device: &Device) -> Tensor<1, Int> {
    Tensor::from_ints([0, 7, 3, 4, 1, 6], device)
}

/// Per-token weights on the loss, so the backward's scaling by the incoming gradient shows.
fn weights(device: &Device) -> Tensor<1> {
    Tensor::from_floats([1.0, 0.5, 2.0, 1.5, 0.25, 3.0], device)
}

fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().try_to_vec().unwrap()
}

/// Full logits and global targets of one test case.
#[derive(Clone, Copy)]
struct Case {
    logits: fn(&Device) -> Tensor<2>,
    targets: fn(&Device) -> Tensor<1, Int>,
}

const SPREAD: Case = Case {
    logits: full_logits,
    targets,
};

/// The upper half of the vocabulary is masked padding (−10⁴, as the models mask it), so at
/// TP 2 and 4 some ranks' whole slices are padding; every target lies in the lower half.
const PADDED: Case = Case {
    logits: |device| {
        let pad = Tensor::<1, Int>::arange(0..V as i64, device)
            .greater_equal_elem((V / 2) as i64)
            .unsqueeze::<2>()
            .expand([N, V]);
        full_logits(device).mask_fill(pad, -10_000.0)
    },
    targets: |device| Tensor::from_ints([0, 3, 1, 2, 3, 0], device),
};

/// Single-device smoothed cross-entropy and its gradient, from Burn ops.
fn reference(case: Case, smoothing: f32) -> (Vec<f32>, Vec<f32>) {
    reference_over(case, smoothing, V)
}

/// The same with the smoothing spread over the first `real` columns only.
fn reference_over(case: Case, smoothing: f32, real: usize) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let logits = (case.logits)(&device).require_grad();
    let logp = log_softmax(logits.clone(), 1);
    let nll = logp
        .clone()
        .gather(1, (case.targets)(&device).unsqueeze_dim(1))
        .squeeze_dim::<1>(1)
        .neg();
    let smooth = logp
        .narrow(1, 0, real)
        .mean_dim(1)
        .squeeze_dim::<1>(1)
        .neg();
    let loss = nll * (1.0 - smoothing) + smooth * smoothing;
    let grads = (loss.clone() * weights(&device)).sum().backward();
    (to_vec(loss.inner()), to_vec(logits.grad(&grads).unwrap()))
}

/// `|a − b| ≤ tol` for values up to 1, relative beyond (the smoothed loss of masked padding
/// reaches ε·10⁴/2: an absolute 1e-5 would be finer than its f32 ulp).
fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * y.abs().max(1.0),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

/// Every rank's losses and all-gathered logit gradients, at TP `tp`.
fn vocab_parallel(case: Case, smoothing: f32, tp: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    vocab_parallel_over(case, smoothing, V, tp)
}

/// The same with the first `real` columns the real vocabulary.
fn vocab_parallel_over(
    case: Case,
    smoothing: f32,
    real: usize,
    tp: usize,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    threads(
        &ParallelConfig::new(tp, tp, 1),
        LaunchOptions::default().with_timeout(Duration::from_secs(5)),
        |ctx| {
            let part = V / tp;
            let rank = ctx.state.tensor_model_parallel_rank();
            let local = (case.logits)(&ctx.device)
                .narrow(1, rank * part, part)
                .require_grad();
            let loss = vocab_parallel_cross_entropy_padded(
                local.clone(),
                (case.targets)(&ctx.device),
                smoothing,
                real,
                &ctx.groups.tp,
            )
            .map_err(|e| e.to_string())?;
            let grads = (loss.clone() * weights(&ctx.device)).sum().backward();
            let grad = local.grad(&grads).unwrap();
            let full = crate::comm::tensor::all_gather(&*ctx.groups.tp, grad, 1)
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((to_vec(loss.inner()), to_vec(full)))
        },
    )
    .unwrap()
}

fn check_every_tp_size(case: Case) {
    for smoothing in [0.0, 0.1] {
        let (ref_loss, ref_grad) = reference(case, smoothing);
        for tp in [1, 2, 4] {
            for (loss, grad) in vocab_parallel(case, smoothing, tp) {
                let what = |of: &str| format!("{of} tp {tp} ε {smoothing}");
                assert_close(&loss, &ref_loss, 1e-5, &what("loss"));
                assert_close(&grad, &ref_grad, 1e-5, &what("grad"));
            }
        }
    }
}

#[test]
fn equals_single_device_cross_entropy_at_every_tp_size() {
    check_every_tp_size(SPREAD);
}

/// A rank whose slice is all padding has a local max of −10⁴: its rescaled sum of exps is
/// `exp(−10⁴ − M)·sum = 0`, finite, and the loss is still single-device cross-entropy.
#[test]
fn ranks_holding_only_padding_change_nothing() {
    check_every_tp_size(PADDED);
}

/// A padded vocabulary's smoothing spreads over its real entries: the masked padding's −10⁴
/// stays out of the loss (it would add ε·10⁴/2 here) and out of the gradient, and so does
/// padding left unmasked (its columns' gradient is the softmax alone). Real sizes 4 and 6 put
/// the boundary between ranks and inside one at TP 2 and 4.
#[test]
fn smoothing_over_a_padded_vocabulary_spares_the_padding() {
    let unmasked = Case {
        logits: full_logits,
        targets: |device| Tensor::from_ints([0, 5, 3, 4, 1, 2], device),
    };
    for (case, real) in [(PADDED, V / 2), (unmasked, 6)] {
        let (ref_loss, ref_grad) = reference_over(case, 0.1, real);
        for tp in [1, 2, 4] {
            for (loss, grad) in vocab_parallel_over(case, 0.1, real, tp) {
                let what = |of: &str| format!("{of} tp {tp} real {real}");
                assert_close(&loss, &ref_loss, 1e-5, &what("loss"));
                assert_close(&grad, &ref_grad, 1e-5, &what("grad"));
            }
        }
    }
    assert!(
        ref_smoothed_padding_differs(),
        "the case must tell the padded smoothing from the plain one"
    );
}

/// The plain smoothing over the masked case's whole vocabulary is far from the padded one's.
fn ref_smoothed_padding_differs() -> bool {
    let (plain, _) = reference(PADDED, 0.1);
    let (padded, _) = reference_over(PADDED, 0.1, V / 2);
    plain
        .iter()
        .zip(&padded)
        .all(|(a, b)| (a - b).abs() > 100.0)
}

#[test]
fn a_real_vocabulary_beyond_the_padded_one_is_an_error() {
    let tp = crate::comm::solo_group("tp");
    let d = Device::flex();
    for real in [0, V + 1] {
        let e = vocab_parallel_cross_entropy_padded(full_logits(&d), targets(&d), 0.1, real, &tp)
            .unwrap_err();
        assert!(e.to_string().contains("real vocabulary size"), "{e}");
    }
}

#[test]
fn bf16_logits_get_f32_loss_and_bf16_gradient() {
    let out = threads(
        &ParallelConfig::new(2, 2, 1),
        LaunchOptions::default(),
        |ctx| {
            let rank = ctx.state.tensor_model_parallel_rank();
            let local = full_logits(&ctx.device)
                .narrow(1, rank * 4, 4)
                .cast(DType::BF16)
                .require_grad();
            let loss = vocab_parallel_cross_entropy(
                local.clone(),
                targets(&ctx.device),
                0.0,
                &ctx.groups.tp,
            )
            .unwrap();
            let grads = loss.clone().sum().backward();
            Ok::<_, CommError>((loss.dtype(), local.grad(&grads).unwrap().dtype()))
        },
    )
    .unwrap();
    assert!(
        out.iter().all(|&d| d == (DType::F32, DType::BF16)),
        "{out:?}"
    );
}

#[test]
fn invalid_smoothing_is_an_error() {
    let tp = crate::comm::solo_group("tp");
    let d = Device::flex();
    let e = vocab_parallel_cross_entropy(full_logits(&d), targets(&d), 1.0, &tp).unwrap_err();
    assert!(
        e.to_string()
            .contains("label smoothing must be in [0, 1), got 1"),
        "{e}"
    );
}
