//! The local cross-entropy passes (row max; predicted logit + sum of logits; sum of exps;
//! backward) against exact f64 host values and against the reference composition on the
//! same device, on Flex (its native loops for f32, the reference for f16/bf16) and, with
//! feature `wgpu`, the kernels on lavapipe.

mod common;

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{
    KernelError, LabelSmoothing, cross_entropy_backward, cross_entropy_predicted_and_sum,
    cross_entropy_row_max, cross_entropy_sum_exp, reference_cross_entropy_backward,
    reference_cross_entropy_predicted_and_sum,
};
use common::{max_abs_diff, to_vec, values};

const ROWS: [usize; 4] = [0, 1, 3, 37];
const COLS: [usize; 5] = [1, 3, 33, 1000, 5000];

/// One rank's inputs: logits (as stored, rounded to their dtype), targets, and the
/// all-reduced row max / sum of exps as other ranks would shift them.
struct Case {
    n: usize,
    v: usize,
    logits: Vec<f32>,
    target: Vec<i64>,
    in_range: Vec<f32>,
    grad: Vec<f32>,
    smoothing: LabelSmoothing,
}

/// Rank 0 of `tp` ranks; global targets spread over the whole vocabulary so that, for
/// tp > 1, most rows' targets lie elsewhere (local column 0, in_range 0); tp = 1 with
/// `all_out` masks every row.
fn case(n: usize, v: usize, tp: usize, scale: f32, eps: f32, all_out: bool) -> Case {
    let logits = values(n * v, (n * 31 + v) as u64, scale);
    let global: Vec<usize> = (0..n).map(|r| (r * 7919 + v / 2) % (v * tp)).collect();
    let in_range: Vec<f32> = global
        .iter()
        .map(|&g| f32::from(u8::from(g < v && !all_out)))
        .collect();
    let target = global
        .iter()
        .zip(&in_range)
        .map(|(&g, &w)| if w > 0.0 { g as i64 } else { 0 })
        .collect();
    let smoothing = LabelSmoothing {
        epsilon: eps,
        global_vocab: v * tp,
    };
    let grad = values(n, 99, 1.0);
    Case {
        n,
        v,
        logits,
        target,
        in_range,
        grad,
        smoothing,
    }
}

fn row(c: &Case, r: usize) -> impl Iterator<Item = f64> + '_ {
    c.logits[r * c.v..(r + 1) * c.v]
        .iter()
        .map(|&x| f64::from(x))
}

/// Exact f64 values: (max, [predicted, sum], sum_exp, backward) with `max_g`/`sum_exp_g`
/// the "global" row max and sum of exps the backward is given.
fn exact(c: &Case, max_g: &[f64], sum_exp_g: &[f64]) -> [Vec<f32>; 4] {
    let (mut max, mut packed, mut sum_exp, mut back) = (vec![], vec![], vec![], vec![]);
    let eps = f64::from(c.smoothing.epsilon);
    for r in 0..c.n {
        let m = row(c, r).fold(f64::NEG_INFINITY, f64::max);
        max.push(m as f32);
        let w = f64::from(c.in_range[r]);
        let t = c.target[r] as usize;
        packed.push(((f64::from(c.logits[r * c.v + t]) - m) * w) as f32);
        packed.push(row(c, r).map(|x| x - m).sum::<f64>() as f32);
        sum_exp.push(row(c, r).map(|x| (x - m).exp()).sum::<f64>() as f32);
        for (col, x) in row(c, r).enumerate() {
            let hot = if col == t { (1.0 - eps) * w } else { 0.0 };
            let soft = (x - max_g[r]).exp() / sum_exp_g[r];
            let uniform = eps / c.smoothing.global_vocab as f64;
            back.push(((soft - hot - uniform) * f64::from(c.grad[r])) as f32);
        }
    }
    [max, packed, sum_exp, back]
}

/// Max |Δ| against the exact values, per output: (max, packed, sum_exp, backward), and the
/// same four against the reference composition run on the same device.
fn run(dev: &Device, c: &mut Case, dt: DType) -> ([f32; 4], [f32; 4], [f32; 4]) {
    let (n, v) = (c.n, c.v);
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    let logits = Tensor::<2>::from_data(TensorData::new(c.logits.clone(), [n, v]), options);
    // The exact values are of the logits as stored (rounded to f16/bf16).
    c.logits = to_vec(logits.clone());
    let target = Tensor::<1, Int>::from_data(TensorData::new(c.target.clone(), [n]), dev);
    let in_range = Tensor::<1>::from_data(TensorData::new(c.in_range.clone(), [n]), dev);
    let grad = Tensor::<1>::from_data(TensorData::new(c.grad.clone(), [n]), dev);

    let max = cross_entropy_row_max(logits.clone()).unwrap();
    let packed = cross_entropy_predicted_and_sum(
        logits.clone(),
        max.clone(),
        target.clone(),
        in_range.clone(),
    )
    .unwrap();
    let local_sum_exp = cross_entropy_sum_exp(logits.clone(), max.clone()).unwrap();
    // Other ranks: a larger global max and extra exp mass (tp = 1: the local values).
    let tp1 = c.smoothing.global_vocab == v;
    let shift = if tp1 { 0.0 } else { 0.5 };
    let max_g: Vec<f64> = to_vec(max.clone())
        .iter()
        .map(|&m| f64::from(m) + shift)
        .collect();
    let sum_exp_g: Vec<f64> = (0..n)
        .map(|r| row(c, r).map(|x| (x - max_g[r]).exp()).sum::<f64>() + if tp1 { 0.0 } else { 1.5 })
        .collect();
    let max_t = Tensor::<1>::from_data(TensorData::new(max_g.clone(), [n]), dev);
    let sum_exp_t = Tensor::<1>::from_data(TensorData::new(sum_exp_g.clone(), [n]), dev);
    let back = cross_entropy_backward(
        logits.clone(),
        max_t.clone(),
        sum_exp_t.clone(),
        target.clone(),
        in_range.clone(),
        grad.clone(),
        c.smoothing,
    )
    .unwrap();
    assert_eq!(back.dtype(), dt, "the backward keeps the logits' dtype");
    assert_eq!(max.dtype(), DType::F32, "reductions come back in f32");

    let fused = [
        to_vec(max),
        to_vec(packed),
        to_vec(local_sum_exp),
        to_vec(back),
    ];
    let ex = exact(c, &max_g, &sum_exp_g);
    let vs_exact = std::array::from_fn(|i| max_abs_diff(&fused[i], &ex[i]));
    // Burn's own kernels panic on empty Cube tensors, so empty inputs skip the composition.
    if n == 0 {
        return (vs_exact, [0.0; 4], [0.0; 4]);
    }
    let reference = reference_all(
        logits,
        target,
        in_range,
        grad,
        max_t,
        sum_exp_t,
        c.smoothing,
    );
    let vs_ref = std::array::from_fn(|i| max_abs_diff(&fused[i], &reference[i]));
    let scale = std::array::from_fn(|i| ex[i].iter().fold(0.0f32, |a, x| a.max(x.abs())));
    (vs_exact, vs_ref, scale)
}

/// The reference composition of every pass on the same device (through `Dispatch`).
fn reference_all(
    logits: Tensor<2>,
    target: Tensor<1, Int>,
    in_range: Tensor<1>,
    grad: Tensor<1>,
    max_g: Tensor<1>,
    sum_exp_g: Tensor<1>,
    smoothing: LabelSmoothing,
) -> [Vec<f32>; 4] {
    use burn_megatron_kernels::{reference_cross_entropy_row_max, reference_cross_entropy_sum_exp};
    let d = |t: Tensor<2>| t.into_dispatch();
    let max = reference_cross_entropy_row_max::<Dispatch>(d(logits.clone()));
    let max = Tensor::<1>::from_dispatch(max);
    let packed = reference_cross_entropy_predicted_and_sum::<Dispatch>(
        d(logits.clone()),
        max.clone().into_dispatch(),
        target.clone().into_dispatch(),
        in_range.clone().into_dispatch(),
    );
    let sum_exp =
        reference_cross_entropy_sum_exp::<Dispatch>(d(logits.clone()), max.clone().into_dispatch());
    let back = reference_cross_entropy_backward::<Dispatch>(
        d(logits),
        max_g.into_dispatch(),
        sum_exp_g.into_dispatch(),
        target.into_dispatch(),
        in_range.into_dispatch(),
        grad.into_dispatch(),
        smoothing,
    );
    [
        to_vec(max),
        to_vec(Tensor::<2>::from_dispatch(packed)),
        to_vec(Tensor::<1>::from_dispatch(sum_exp)),
        to_vec(Tensor::<2>::from_dispatch(back)),
    ]
}

/// Runs every case on `dev` with logits of dtype `dt` and returns the worst relative errors
/// (vs exact, vs the reference) per output, after checking them against the tolerances.
fn check(dev: &Device, what: &str, dt: DType) -> [f32; 8] {
    let mut worst = [0.0f32; 8];
    for n in ROWS {
        for v in COLS {
            for (tp, all_out) in [(1, false), (1, true), (4, false)] {
                for scale in [3.0, 1e4] {
                    for eps in [0.0, 0.1] {
                        let mut c = case(n, v, tp, scale, eps, all_out);
                        let (ex, rf, mag) = run(dev, &mut c, dt);
                        let what = format!(
                            "{what} {dt:?} [{n}, {v}] tp {tp} all_out {all_out} ×{scale} ε {eps}: \
                             vs exact {ex:?} vs reference {rf:?} magnitudes {mag:?}"
                        );
                        for i in 0..4 {
                            // The backward's values are ≤ ~1 and often ~0: its |Δ| is reported as is.
                            let rel = |d: f32| if i == 3 { d } else { d / mag[i].max(1e-30) };
                            worst[i] = worst[i].max(rel(ex[i]));
                            worst[4 + i] = worst[4 + i].max(rel(rf[i]));
                            assert!(
                                ex[i] <= tolerance(i, dt, mag[i])
                                    && rf[i] <= tolerance(i, dt, mag[i]),
                                "output {i}: {what}"
                            );
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "{what} {dt:?}: worst |Δ| (relative; backward absolute) vs exact [max, packed, sum_exp, backward] {:?}, vs reference {:?}",
        &worst[..4],
        &worst[4..]
    );
    worst
}

/// Tolerance of output `i` (max, packed, sum_exp, backward) whose exact values reach `mag`.
fn tolerance(i: usize, dt: DType, mag: f32) -> f32 {
    match i {
        // The max of stored values is one of them: exact.
        0 => 0.0,
        // Sums of up to 5000 f32 terms of one sign: ~20 sequential adds per unit, then an
        // 8-level tree (the reference sums in another order); measured ≤ ~3e-7 relative.
        1 | 2 => 2e-6 * mag,
        // One exp (a few ulp), a division, a subtraction in f32; values up to ~1 in size.
        // f16 output adds half an ulp of 2⁻¹¹ relative, bf16 of 2⁻⁸.
        _ => match dt {
            DType::F16 => 1e-6 + mag * 4.9e-4,
            DType::BF16 => 1e-6 + mag * 3.9e-3,
            _ => 1e-6 + mag * 1e-6,
        },
    }
}

#[test]
fn flex_matches_exact_values_and_the_reference() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        check(&common::flex(), "flex", dt);
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn kernels_match_exact_values_and_the_reference_on_wgpu() {
    let dev = common::wgpu_device("cross_entropy");
    check(&dev, "wgpu", DType::F32);
    if dev.supports_dtype(DType::F16) {
        check(&dev, "wgpu", DType::F16);
    } else {
        eprintln!("\n!!! wgpu adapter has no f16: f16 logits NOT tested on wgpu !!!\n");
    }
}

/// Targets that are garbage where `in_range` is 0 (negative, past the slice) must not be
/// read by the kernel: the predicted logit is 0 there.
#[cfg(feature = "wgpu")]
#[test]
fn kernel_ignores_out_of_range_targets_on_wgpu() {
    let dev = common::wgpu_device("cross_entropy out-of-range targets");
    let logits = Tensor::<2>::from_data(TensorData::new(values(3 * 5, 4, 2.0), [3, 5]), &dev);
    let target = Tensor::<1, Int>::from_data(TensorData::new(vec![-3i64, 7, 1_000_000], [3]), &dev);
    let in_range = Tensor::<1>::zeros([3], &dev);
    let max = cross_entropy_row_max(logits.clone()).unwrap();
    let packed = to_vec(cross_entropy_predicted_and_sum(logits, max, target, in_range).unwrap());
    assert_eq!([packed[0], packed[2], packed[4]], [0.0; 3], "{packed:?}");
}

fn shape<T>(r: Result<T, KernelError>) -> bool {
    matches!(r, Err(KernelError::Shape(_)))
}

#[test]
fn bad_inputs_are_refused_before_any_launch() {
    let dev = common::flex();
    let logits = Tensor::<2>::zeros([4, 6], &dev);
    let (row4, row3) = (Tensor::<1>::zeros([4], &dev), Tensor::<1>::zeros([3], &dev));
    let target = Tensor::<1, Int>::zeros([4], &dev);
    assert!(shape(cross_entropy_row_max(Tensor::<2>::zeros(
        [4, 0],
        &dev
    ))));
    assert!(shape(cross_entropy_sum_exp(logits.clone(), row3.clone())));
    assert!(shape(cross_entropy_predicted_and_sum(
        logits.clone(),
        row4.clone(),
        Tensor::<1, Int>::zeros([3], &dev),
        row4.clone()
    )));
    let back = |smoothing, grad: Tensor<1>| {
        cross_entropy_backward(
            logits.clone(),
            row4.clone(),
            row4.clone(),
            target.clone(),
            row4.clone(),
            grad,
            smoothing,
        )
    };
    let ok = LabelSmoothing {
        epsilon: 0.1,
        global_vocab: 12,
    };
    assert!(back(ok, row4.clone()).is_ok());
    assert!(shape(back(ok, row3)));
    for bad in [
        LabelSmoothing {
            epsilon: 1.0,
            global_vocab: 12,
        },
        LabelSmoothing {
            epsilon: -0.1,
            global_vocab: 12,
        },
        LabelSmoothing {
            epsilon: 0.1,
            global_vocab: 5,
        },
    ] {
        assert!(
            matches!(back(bad, row4.clone()), Err(KernelError::Argument(_))),
            "{bad:?}"
        );
    }
}
