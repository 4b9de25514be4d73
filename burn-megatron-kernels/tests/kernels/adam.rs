//! Fused Adam / AdamW over a flat buffer: against exact f64 host Adam over several steps,
//! against the Burn-op reference on the same device, and (Flex) against burn-optim's own
//! `AdamW` / `Adam`; with loss-scale unscaling, a clipping coefficient, weight decay off /
//! decoupled / L2, inf and NaN gradients (flag), sizes 0, 1, 3, 1000, 100003 (not multiples
//! of a cube), on Flex (reference path) and, with a Cube feature (`wgpu` or `cuda`), the kernel on the Cube device.

use crate::common;

use burn::module::Param;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{
    AdamHyper, FlatAdamState, KernelError, WeightDecay, fused_adam_step,
    multi_tensor_fused_adam_step,
};
use common::{max_abs_diff, to_vec, values};

const SIZES: [usize; 5] = [0, 1, 3, 1000, 100_003];
const STEPS: u32 = 5;

fn tensor(device: &Device, v: &[f32]) -> Tensor<1> {
    Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), device)
}

/// One exact step in f64 on the host; the gradient `g` is what the device reads.
fn host_step(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f32], h: &AdamHyper) {
    let t = i32::try_from(h.step).unwrap();
    let (b1, b2) = (f64::from(h.beta1), f64::from(h.beta2));
    for i in 0..p.len() {
        let mut gi = f64::from(g[i]) * f64::from(h.inv_scale) * f64::from(h.clip_coef);
        if let WeightDecay::L2(w) = h.weight_decay {
            gi += f64::from(w) * p[i];
        }
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        let v_hat = v[i] / (1.0 - b2.powi(t));
        let update = (m[i] / (1.0 - b1.powi(t))) / (v_hat.sqrt() + f64::from(h.eps));
        let keep = match h.weight_decay {
            WeightDecay::Decoupled(w) => 1.0 - h.lr * f64::from(w),
            _ => 1.0,
        };
        p[i] = p[i] * keep - h.lr * update;
    }
}

/// max |got − want| / max |want|: the error on the scale of the buffer.
fn scaled_error(got: &[f32], want: &[f64]) -> f64 {
    let scale = want
        .iter()
        .fold(0.0f64, |a, w| a.max(w.abs()))
        .max(f64::MIN_POSITIVE);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .fold(0.0, f64::max)
        / scale
}

fn hypers() -> Vec<AdamHyper> {
    let base = AdamHyper {
        lr: 1e-2,
        ..Default::default()
    };
    vec![
        base,
        // Loss scale 1024 (gradients arrive ×1024) and a clipping coefficient, AdamW.
        AdamHyper {
            inv_scale: 1.0 / 1024.0,
            clip_coef: 0.37,
            weight_decay: WeightDecay::Decoupled(0.1),
            eps: 1e-8,
            ..base
        },
        AdamHyper {
            weight_decay: WeightDecay::L2(0.05),
            beta1: 0.8,
            beta2: 0.95,
            ..base
        },
    ]
}

/// Several steps of the fused op on `device` from the same start as the host: returns the
/// largest scaled errors of (param, exp_avg, exp_avg_sq) against f64, and of the param
/// against the Burn-op reference on Flex fed the same inputs.
fn against_exact(device: &Device, n: usize, h0: AdamHyper) -> [f64; 4] {
    let p0 = values(n, 1, 1.0);
    let mut state = FlatAdamState::new(tensor(device, &p0));
    let mut reference = FlatAdamState::new(tensor(&common::flex(), &p0));
    let (mut p, mut m, mut v) = (
        p0.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        vec![0.0; n],
        vec![0.0; n],
    );
    let mut worst = [0.0f64; 4];
    for step in 1..=STEPS {
        let h = AdamHyper { step, ..h0 };
        let g = values(n, 100 + u64::from(step), 1.0 / h.inv_scale);
        let (next, non_finite) = fused_adam_step(state.clone(), tensor(device, &g), &h).unwrap();
        assert_eq!(non_finite.into_scalar::<f32>(), 0.0, "finite gradients");
        let (next_ref, _) =
            fused_adam_step(reference.clone(), tensor(&common::flex(), &g), &h).unwrap();
        host_step(&mut p, &mut m, &mut v, &g, &h);
        let got = [&next.param, &next.exp_avg, &next.exp_avg_sq].map(|t| to_vec(t.clone()));
        for (k, want) in [&p, &m, &v].into_iter().enumerate() {
            worst[k] = worst[k].max(scaled_error(&got[k], want));
        }
        let d = max_abs_diff(&got[0], &to_vec(next_ref.param.clone()));
        worst[3] = worst[3].max(f64::from(d));
        (state, reference) = (next, next_ref);
    }
    worst
}

fn check(device: &Device, what: &str) {
    for h in hypers() {
        for n in SIZES {
            let [p, m, v, vs_ref] = against_exact(device, n, h);
            // f32 state against f64 over 5 steps: each step rounds m, v and p (≤ 2⁻²⁴
            // relative each) and the update's divide/sqrt (a few ulps on GPUs); 2e-6 of the
            // buffer's scale is ~30 ulps, far below a wrong formula (≥ 1e-3).
            let what = format!(
                "{what} n={n} {h:?}: param {p:.1e} m {m:.1e} v {v:.1e} vs-ref {vs_ref:.1e}"
            );
            assert!(p <= 2e-6 && m <= 2e-6 && v <= 2e-6, "{what}");
            // Same f32 operations in the same order: a few ulps of |param| ≤ ~1.1 (FMA
            // contraction or GPU division/sqrt may differ in the last bits).
            assert!(vs_ref <= 1e-6, "{what}");
            if n == 100_003 {
                eprintln!("{what}");
            }
        }
    }
    // Inf and NaN in the gradient, and a finite gradient whose unscaling overflows: the
    // count says how many, whatever else the buffer holds.
    let n = 3000;
    let state = FlatAdamState::new(tensor(device, &values(n, 3, 1.0)));
    for (bad, inv_scale, expected) in [
        (vec![(7, f32::INFINITY)], 1.0, 1.0),
        (
            vec![(0, f32::NAN), (2999, f32::NEG_INFINITY), (1500, f32::NAN)],
            1.0,
            3.0,
        ),
        (vec![(1024, 3.0e38)], 4.0, 1.0),
    ] {
        let mut g = values(n, 4, 1.0);
        for &(i, x) in &bad {
            g[i] = x;
        }
        let h = AdamHyper {
            inv_scale,
            ..Default::default()
        };
        let (_, found) = fused_adam_step(state.clone(), tensor(device, &g), &h).unwrap();
        assert_eq!(found.into_scalar::<f32>(), expected, "{what}: {bad:?}");
    }
    // Half-precision gradients, read as they are stored (f16 on devices that hold it).
    for dtype in [FloatDType::F16, FloatDType::BF16] {
        if !device.supports_dtype(dtype) {
            eprintln!("{what}: no {dtype:?} on this device, {dtype:?} gradients not tested");
            continue;
        }
        let g = values(1000, 8, 3.0);
        let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::from(dtype));
        let g_half = Tensor::<1>::from_data(TensorData::new(g.clone(), [1000]), opts);
        let widened = to_vec(g_half.clone().cast(DType::F32));
        let state = FlatAdamState::new(tensor(device, &values(1000, 9, 1.0)));
        let (from_half, _) = fused_adam_step(state.clone(), g_half, &AdamHyper::default()).unwrap();
        let (from_f32, _) = fused_adam_step(
            state.clone(),
            tensor(device, &widened),
            &AdamHyper::default(),
        )
        .unwrap();
        // The kernel widens exactly; the same f32 inputs give the same step.
        let d = max_abs_diff(&to_vec(from_half.param), &to_vec(from_f32.param));
        assert!(d <= 1e-7, "{what} {dtype:?}: {d}");
    }
}

#[test]
fn reference_path_matches_exact_adam_on_flex() {
    check(&common::flex(), "flex");
}

/// The reference reproduces burn-optim's `AdamW` (decoupled) and `Adam` + L2 step for step.
#[test]
fn reference_matches_burn_optim() {
    let device = common::flex();
    let n = 257;
    let p0 = tensor(&device, &values(n, 21, 1.0));
    for (decay, mut optim) in [
        (
            WeightDecay::Decoupled(0.1),
            AdamWConfig::new().with_weight_decay(0.1).init(),
        ),
        (
            WeightDecay::L2(0.1),
            AdamConfig::new()
                .with_weight_decay(Some(WeightDecayConfig::new(0.1)))
                .init(),
        ),
        (
            WeightDecay::None,
            AdamWConfig::new().with_weight_decay(0.0).init(),
        ),
    ] {
        let mut param = Param::from_tensor(p0.clone().require_grad());
        let mut state = FlatAdamState::new(p0.clone());
        let mut worst = 0.0f32;
        for step in 1..=STEPS {
            let g = tensor(&device, &values(n, 30 + u64::from(step), 2.0));
            let mut grads = GradientsParams::new();
            grads.register(param.id, g.clone());
            param = optim.step(3e-3, param, grads);
            let h = AdamHyper {
                lr: 3e-3,
                step,
                weight_decay: decay,
                ..Default::default()
            };
            state = fused_adam_step(state, g, &h).unwrap().0;
            worst = worst.max(max_abs_diff(
                &to_vec(param.val()),
                &to_vec(state.param.clone()),
            ));
        }
        // Same f32 operations in the same order on the same backend: identical bits.
        assert_eq!(worst, 0.0, "{decay:?} differs from burn-optim by {worst}");
    }
}

#[test]
fn bad_inputs_are_refused_before_any_launch() {
    let device = common::flex();
    let state = FlatAdamState::new(tensor(&device, &[1.0, 2.0]));
    let h = AdamHyper::default();
    let e = fused_adam_step(state.clone(), tensor(&device, &[1.0]), &h).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
    for bad in [
        AdamHyper { step: 0, ..h },
        AdamHyper { beta1: 1.0, ..h },
        AdamHyper { eps: 0.0, ..h },
        AdamHyper {
            inv_scale: f32::INFINITY,
            ..h
        },
        AdamHyper {
            weight_decay: WeightDecay::L2(-1.0),
            ..h
        },
    ] {
        let e = fused_adam_step(state.clone(), tensor(&device, &[1.0, 1.0]), &bad).unwrap_err();
        assert!(matches!(e, KernelError::Argument(_)), "{bad:?}: {e}");
    }
    let half_state = FlatAdamState {
        param: state.param.clone().cast(DType::F16),
        ..state
    };
    let e = fused_adam_step(half_state.clone(), tensor(&device, &[1.0, 1.0]), &h).unwrap_err();
    assert!(matches!(e, KernelError::Argument(_)), "{e}");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_matches_exact_adam_and_reference_on_cube() {
    let device = common::cube_device("adam");
    check(&device, "cube");
}

/// The gradient in pieces (one an f16 tensor, one empty, one a strided view) steps the
/// buffer exactly as the same gradient concatenated does, over several steps, and counts
/// the non-finite elements of every piece; a piece on another device, or pieces that do
/// not add up to the buffer, are refused.
fn pieces_step_as_the_flat_gradient(device: &Device, what: &str) {
    let n = [700, 0, 64, 2000];
    let total: usize = n.iter().sum();
    let param: Vec<f32> = values(total, 7, 1.0);
    let mut whole = FlatAdamState::new(tensor(device, &param));
    let mut split = whole.clone();
    let h = AdamHyper {
        weight_decay: WeightDecay::Decoupled(0.1),
        clip_coef: 0.5,
        ..AdamHyper::default()
    };
    for step in 1..=STEPS {
        let h = AdamHyper { step, ..h };
        let g: Vec<f32> = values(total, u64::from(step), 0.01);
        // The f16 piece's values, as the flat gradient holds them.
        let half = to_vec(tensor(device, &g[..700]).cast(DType::F16).cast(DType::F32));
        // Every other element of a [64, 2] tensor whose rows repeat the value.
        let twice: Vec<f32> = g[700..764].iter().flat_map(|&v| [v, v]).collect();
        let strided = tensor(device, &twice)
            .reshape([64, 2])
            .narrow(1, 0, 1)
            .reshape([64]);
        let pieces = vec![
            tensor(device, &half).cast(DType::F16),
            tensor(device, &[]),
            strided,
            tensor(device, &g[764..]),
        ];
        let flat = tensor(device, &[half.as_slice(), &g[700..]].concat());
        whole = fused_adam_step(whole, flat, &h).unwrap().0;
        let found;
        (split, found) = multi_tensor_fused_adam_step(split, pieces, &h).unwrap();
        assert_eq!(to_vec(found), vec![0.0], "{what}: step {step}");
        for (a, b) in [
            (&whole.param, &split.param),
            (&whole.exp_avg, &split.exp_avg),
        ] {
            let (a, b) = (to_vec(a.clone()), to_vec(b.clone()));
            let first = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert_eq!(first, None, "{what}: step {step}, first differing element");
        }
    }
    let bad = vec![
        tensor(device, &[f32::INFINITY, 1.0]),
        tensor(device, &[f32::NAN; 3]),
    ];
    let small = FlatAdamState::new(tensor(device, &[1.0; 5]));
    let (_, found) = multi_tensor_fused_adam_step(small.clone(), bad, &h).unwrap();
    assert_eq!(to_vec(found), vec![4.0], "{what}: inf + 3 NaN");
    let short = vec![tensor(device, &[1.0; 4])];
    let e = multi_tensor_fused_adam_step(small.clone(), short, &h).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{what}: {e}");
    if *device != Device::flex() {
        let elsewhere = vec![tensor(&Device::flex(), &[1.0; 5])];
        let e = multi_tensor_fused_adam_step(small, elsewhere, &h).unwrap_err();
        assert!(matches!(e, KernelError::Argument(_)), "{what}: {e}");
    }
}

#[test]
fn gradient_pieces_step_as_the_flat_gradient_on_flex() {
    pieces_step_as_the_flat_gradient(&Device::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn gradient_pieces_step_as_the_flat_gradient_on_cube() {
    pieces_step_as_the_flat_gradient(&common::cube_device("adam"), "cube");
}
