//! `MegatronOptimizer` around the fused Adam (flat FP32 buffers, one fused kernel per parameter group)
//! against burn-optim's `AdamW` behind the same wrapper: TP × DP traces and weights, bf16
//! master weights, Megatron's parameter groups, and parameters it must leave alone.

use burn::module::ParamGroup;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron::optimizer::*;
use burn_megatron_tests::mlp::*;
use burn_megatron_tests::*;

/// `a` within `rel` of `b`, relative to `b`'s magnitude (at least 1e-3 for tiny values).
fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-3)
}

#[test]
fn fused_adamw_matches_burn_adamw_on_every_layout() {
    let reference = run_layout(1, 1, Kind::Burn).remove(0);
    for (tp, dp) in [(1, 1), (2, 1), (2, 2), (4, 2)] {
        let burn = run_layout(tp, dp, Kind::Burn);
        let fused = run_layout(tp, dp, Kind::Fused);
        for (rank, ((f_trace, f_w), (b_trace, b_w))) in fused.iter().zip(&burn).enumerate() {
            let at = format!("{tp}×{dp} rank {rank}");
            // Same layout: the same f32 operations in the same order, so the same bits
            // (the per-parameter sums of squares and the clipped, unscaled gradient included).
            assert_eq!(f_trace, b_trace, "{at}: (loss, norm) per step");
            assert_eq!(f_w, b_w, "{at}: fc1 weight shard after {STEPS} steps");
            // And the parallel fused run tracks the single-rank reference.
            for (step, ((fl, fnorm), (rl, rnorm))) in f_trace.iter().zip(&reference.0).enumerate() {
                assert!(
                    (fl - rl).abs() <= 1e-5,
                    "{at} step {step}: loss {fl} vs TP1 {rl}"
                );
                assert!(
                    close(*fnorm, *rnorm, 1e-5),
                    "{at} step {step}: norm {fnorm} vs TP1 {rnorm}"
                );
            }
        }
        // Clipping was active (norms above 0.25) and the model learned.
        let trace = &fused[0].0;
        assert!(
            trace[0].1 > 0.25,
            "clipping must act in the first step: {trace:?}"
        );
        assert!(
            trace[STEPS - 1].0 < 0.8 * trace[0].0,
            "the loss must fall: {trace:?}"
        );
    }
}

#[test]
fn fused_bf16_master_weights_match_burn_adamw_master_weights() {
    let (burn_losses, burn_w) = run_dtype(DType::BF16, Kind::Burn);
    let (fused_losses, fused_w) = run_dtype(DType::BF16, Kind::Fused);
    assert_eq!(fused_losses.len(), STEPS);
    // Bit-identical masters, rounded to bf16 by the same round-to-nearest-even.
    assert_eq!(fused_losses, burn_losses);
    assert_eq!(fused_w, burn_w, "bf16 fc1 weight after {STEPS} steps");
    let (fp32_losses, _) = run_dtype(DType::F32, Kind::Fused);
    for (step, (a, b)) in fp32_losses.iter().zip(&fused_losses).enumerate() {
        assert!(
            (a - b).abs() <= 0.02 * a.abs(),
            "step {step}: fp32 {a} vs bf16 {b}"
        );
    }
}

/// A linear layer's (weight, bias) after one step.
fn linear_values(m: &Linear) -> (Vec<f32>, Vec<f32>) {
    (
        values(m.weight.val()),
        values(m.bias.as_ref().unwrap().val()),
    )
}

fn step_linear(optim: &mut MegatronOptimizer<Linear>, model: Linear, zero: bool) -> Linear {
    let device = model.weight.val().device();
    let x = data([4, 3], 0, 1, &device);
    let l = model.forward(x).powi_scalar(2).mean() * if zero { 0.0 } else { 1.0 };
    let grads = GradientsParams::from_grads(l.backward(), &model);
    optim.step(0.1, model, grads).unwrap().0
}

fn linear(device: &Device) -> Linear {
    let m = LinearConfig::new(3, 2).init(device);
    Linear {
        weight: m.weight.map(|w| w.ones_like().require_grad()),
        bias: m.bias.map(|b| b.map(|b| b.ones_like().require_grad())),
    }
}

#[test]
fn megatron_param_groups_decay_matrices_only_as_burn_groups_do() {
    let device = Device::flex().autodiff();
    // Zero gradients: only decoupled decay moves a weight, w ← w·(1 − lr·λ); biases keep 1.
    let model = linear(&device);
    let adam = FusedAdamConfig::new()
        .with_weight_decay(0.5)
        .init()
        .unwrap();
    let mut fused = MegatronOptimizer::new(adam, &model, solo(), 0);
    let (w, b) = linear_values(&step_linear(&mut fused, model, true));
    assert!(w.iter().all(|&v| (v - 0.95).abs() < 1e-6), "{w:?}");
    assert_eq!(b, vec![1.0, 1.0]);
    // With real gradients, the same groups as `megatron_param_groups`, bit for bit.
    let adamw = AdamWConfig::new().with_weight_decay(0.5);
    let (mut a, mut b) = (linear(&device), linear(&device));
    let groups = megatron_param_groups(
        &a,
        adamw.build(),
        adamw.with_weight_decay(0.0).build(),
        None,
    );
    let mut burn = MegatronOptimizer::new(groups, &a, solo(), 0);
    let adam = FusedAdamConfig::new()
        .with_weight_decay(0.5)
        .init()
        .unwrap();
    let mut fused = MegatronOptimizer::new(adam, &b, solo(), 0);
    for _ in 0..3 {
        a = step_linear(&mut burn, a, false);
        b = step_linear(&mut fused, b, false);
    }
    assert_eq!(linear_values(&b), linear_values(&a));
}

#[test]
fn frozen_and_zero_lr_groups_stay_put_while_the_rest_trains() {
    let device = Device::flex().autodiff();
    let mut model = linear(&device);
    model.bias = model.bias.map(|b| b.set_require_grad(false));
    let frozen_weight = ParamGroup::from_ids(vec![model.weight.id]);
    // lr_mult 0 on the weight: a step leaves it bit-identical even with weight decay.
    let adam = FusedAdamConfig::new()
        .with_weight_decay(0.1)
        .init()
        .unwrap();
    let mut optim = MegatronOptimizer::new(
        adam.with_param_group(frozen_weight, 0.1, 0.0),
        &model,
        solo(),
        0,
    );
    let before = linear_values(&model);
    let model = step_linear(&mut optim, model, false);
    assert_eq!(linear_values(&model), before, "lr_mult 0 and a frozen bias");
    assert!(!model.bias.as_ref().unwrap().val().is_require_grad());
    assert!(model.weight.val().is_require_grad());
    // The same model with the weight in the default group moves.
    let adam = FusedAdamConfig::new()
        .with_weight_decay(0.1)
        .init()
        .unwrap();
    let mut optim = MegatronOptimizer::new(adam, &model, solo(), 0);
    let moved = step_linear(&mut optim, model, false);
    assert_ne!(linear_values(&moved).0, before.0);
}

#[test]
fn bad_hyper_parameters_are_errors_not_panics() {
    for bad in [
        FusedAdamConfig::new().with_beta_2(1.0),
        FusedAdamConfig::new().with_epsilon(0.0),
        FusedAdamConfig::new().with_weight_decay(f32::NAN),
    ] {
        assert!(bad.init().is_err(), "{bad:?}");
    }
    let device = Device::flex().autodiff();
    let model = linear(&device);
    let adam = FusedAdamConfig::new().init().unwrap();
    let mut optim = MegatronOptimizer::new(adam, &model, solo(), 0);
    let l = model.forward(Tensor::<2>::ones([1, 3], &device)).sum();
    let grads = GradientsParams::from_grads(l.backward(), &model);
    let Err(e) = optim.step(-1.0, model, grads) else {
        panic!("a negative learning rate must be refused")
    };
    assert!(e.to_string().contains("lr must be finite and ≥ 0"), "{e}");
}
