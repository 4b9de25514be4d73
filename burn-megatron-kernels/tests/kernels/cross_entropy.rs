//! The local cross-entropy ops (the one-pass row statistics, and the backward) against
//! exact f64 host values and against the reference composition on the same device, on Flex
//! (its native loops: every float dtype for the row statistics, f32 for the backward, the
//! reference for its f16/bf16) and, with a Cube feature (`wgpu` or `cuda`), the kernels on the Cube device.

use crate::common;

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Int, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{
    KernelError, LabelSmoothing, cross_entropy_backward, cross_entropy_row_stats,
    reference_cross_entropy_backward, reference_cross_entropy_row_stats,
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
fn exact(c: &Case, max_g: &[f64], sum_exp_g: &[f64]) -> Vec<f32> {
    let mut back = vec![];
    let eps = f64::from(c.smoothing.epsilon);
    for r in 0..c.n {
        let w = f64::from(c.in_range[r]);
        let t = c.target[r] as usize;
        for (col, x) in row(c, r).enumerate() {
            let hot = if col == t { (1.0 - eps) * w } else { 0.0 };
            let soft = (x - max_g[r]).exp() / sum_exp_g[r];
            let uniform = eps / c.smoothing.global_vocab as f64;
            back.push(((soft - hot - uniform) * f64::from(c.grad[r])) as f32);
        }
    }
    back
}

/// The backward's max |Δ| against the exact values and against the reference composition
/// run on the same device (through `Dispatch`), with the exact values' magnitude.
fn run(dev: &Device, c: &mut Case, dt: DType) -> (f32, f32, f32) {
    let (n, v) = (c.n, c.v);
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    let logits = Tensor::<2>::from_data(TensorData::new(c.logits.clone(), [n, v]), options);
    // The exact values are of the logits as stored (rounded to f16/bf16).
    c.logits = to_vec(logits.clone());
    let target = Tensor::<1, Int>::from_data(TensorData::new(c.target.clone(), [n]), dev);
    let in_range = Tensor::<1>::from_data(TensorData::new(c.in_range.clone(), [n]), dev);
    let grad = Tensor::<1>::from_data(TensorData::new(c.grad.clone(), [n]), dev);
    // Other ranks: a larger global max and extra exp mass (tp = 1: the local values).
    let tp1 = c.smoothing.global_vocab == v;
    let shift = if tp1 { 0.0 } else { 0.5 };
    let max_g: Vec<f64> = (0..n)
        .map(|r| row(c, r).fold(f64::NEG_INFINITY, f64::max) + shift)
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
    let back = to_vec(back);
    let ex = exact(c, &max_g, &sum_exp_g);
    let vs_exact = max_abs_diff(&back, &ex);
    let scale = ex.iter().fold(0.0f32, |a, x| a.max(x.abs()));
    // Burn's own kernels panic on empty Cube tensors, so empty inputs skip the composition.
    if n == 0 {
        return (vs_exact, 0.0, scale);
    }
    let reference = reference_cross_entropy_backward::<Dispatch>(
        logits.into_dispatch(),
        max_t.into_dispatch(),
        sum_exp_t.into_dispatch(),
        target.into_dispatch(),
        in_range.into_dispatch(),
        grad.into_dispatch(),
        c.smoothing,
    );
    let vs_ref = max_abs_diff(&back, &to_vec(Tensor::<2>::from_dispatch(reference)));
    (vs_exact, vs_ref, scale)
}

/// Runs every case on `dev` with logits of dtype `dt` and returns the backward's worst
/// absolute errors (vs exact, vs the reference), after checking them against the tolerance.
fn check(dev: &Device, what: &str, dt: DType) -> [f32; 2] {
    let mut worst = [0.0f32; 2];
    for n in ROWS {
        for v in COLS {
            for (tp, all_out) in [(1, false), (1, true), (4, false)] {
                for scale in [3.0, 1e4] {
                    for eps in [0.0, 0.1] {
                        let mut c = case(n, v, tp, scale, eps, all_out);
                        let (ex, rf, mag) = run(dev, &mut c, dt);
                        let what = format!(
                            "{what} {dt:?} [{n}, {v}] tp {tp} all_out {all_out} ×{scale} ε {eps}: \
                             backward vs exact {ex} vs reference {rf} magnitude {mag}"
                        );
                        // The backward's values are ≤ ~1 and often ~0: |Δ| is reported as is.
                        worst = [worst[0].max(ex), worst[1].max(rf)];
                        let tol = tolerance(dt, mag);
                        assert!(ex <= tol && rf <= tol, "{what}");
                    }
                }
            }
        }
    }
    eprintln!(
        "{what} {dt:?}: worst backward |Δ| vs exact {}, vs reference {}",
        worst[0], worst[1]
    );
    worst
}

/// Tolerance of the backward, whose exact values reach `mag`: one exp (a few ulp), a
/// division, a subtraction in f32, values up to ~1 in size; f16 output adds half an ulp of
/// 2⁻¹¹ relative, bf16 of 2⁻⁸.
fn tolerance(dt: DType, mag: f32) -> f32 {
    match dt {
        DType::F16 => 1e-6 + mag * 4.9e-4,
        DType::BF16 => 1e-6 + mag * 3.9e-3,
        _ => 1e-6 + mag * 1e-6,
    }
}

#[test]
fn flex_backward_matches_exact_values_and_the_reference() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        check(&common::flex(), "flex", dt);
    }
}

#[cfg(feature = "cube")]
#[test]
fn backward_kernel_matches_exact_values_and_the_reference_on_cube() {
    let dev = common::cube_device("cross_entropy");
    check(&dev, "cube", DType::F32);
    if dev.supports_dtype(DType::F16) {
        check(&dev, "cube", DType::F16);
    } else {
        eprintln!(
            "\n!!! the Cube device has no f16: f16 logits NOT tested on the Cube device !!!\n"
        );
    }
}

/// Exact f64 row statistics `[m, Σ exp(z − m), z_t·in_range, Σ z]` of the logits as
/// stored, and per row the scale of each column's rounding error: `Σ exp` for the sum of
/// exps, `Σ |z|` for the (mixed-sign) sum of logits.
fn exact_stats(c: &Case) -> (Vec<f32>, Vec<[f64; 4]>) {
    let (mut stats, mut scales) = (vec![], vec![]);
    for r in 0..c.n {
        let m = row(c, r).fold(f64::NEG_INFINITY, f64::max);
        let sum_exp = row(c, r).map(|x| (x - m).exp()).sum::<f64>();
        let t = f64::from(c.logits[r * c.v + c.target[r] as usize]);
        let sum = row(c, r).sum::<f64>();
        let predicted = t * f64::from(c.in_range[r]);
        stats.extend([m, sum_exp, predicted, sum].map(|x| x as f32));
        scales.push([0.0, sum_exp, 0.0, row(c, r).map(f64::abs).sum()]);
    }
    (stats, scales)
}

/// Worst `|Δ| / scale` per column of `[N, 4]` stats against `want`; a column whose scale is
/// 0 must match exactly (reported as ∞ otherwise).
fn stats_error(got: &[f32], want: &[f32], scales: &[[f64; 4]]) -> [f64; 4] {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let mut worst = [0.0f64; 4];
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (r, k) = (i / 4, i % 4);
        let d = (f64::from(*g) - f64::from(*w)).abs();
        let e = match scales[r][k] {
            0.0 if d == 0.0 => 0.0,
            0.0 => f64::INFINITY,
            s => d / s,
        };
        worst[k] = worst[k].max(e);
    }
    worst
}

/// The row statistics on `dev` in dtype `dt` against the exact values and the reference
/// composition on the same device, over every shape and scale; returns the worst relative
/// errors of the two sums (vs exact, vs the reference).
fn check_stats(dev: &Device, what: &str, dt: DType) -> [f64; 4] {
    let mut worst = [0.0f64; 4];
    for n in ROWS {
        for v in COLS {
            for (tp, all_out) in [(1, false), (1, true), (4, false)] {
                for scale in [3.0, 1e4] {
                    let mut c = case(n, v, tp, scale, 0.0, all_out);
                    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
                    let data = TensorData::new(c.logits.clone(), [n, v]);
                    let logits = Tensor::<2>::from_data(data, options);
                    c.logits = to_vec(logits.clone());
                    let target = TensorData::new(c.target.clone(), [n]);
                    let target = Tensor::<1, Int>::from_data(target, dev);
                    let in_range = TensorData::new(c.in_range.clone(), [n]);
                    let in_range = Tensor::<1>::from_data(in_range, dev);
                    let stats =
                        cross_entropy_row_stats(logits.clone(), target.clone(), in_range.clone())
                            .unwrap();
                    assert_eq!((stats.dtype(), stats.dims()), (DType::F32, [n, 4]));
                    let stats = to_vec(stats);
                    let (exact, scales) = exact_stats(&c);
                    let vs_exact = stats_error(&stats, &exact, &scales);
                    // Burn's own kernels panic on empty Cube tensors: no composition there.
                    let vs_ref = if n == 0 {
                        [0.0; 4]
                    } else {
                        let reference = reference_cross_entropy_row_stats::<Dispatch>(
                            logits.into_dispatch(),
                            target.into_dispatch(),
                            in_range.into_dispatch(),
                        );
                        let reference = to_vec(Tensor::<2>::from_dispatch(reference));
                        stats_error(&stats, &reference, &scales)
                    };
                    let what = format!(
                        "{what} {dt:?} [{n}, {v}] tp {tp} all_out {all_out} ×{scale}: \
                         |Δ|/scale [max, sum_exp, predicted, sum] vs exact {vs_exact:?} \
                         vs reference {vs_ref:?}"
                    );
                    // The max and the masked target logit are stored values: exact. The sums:
                    // ~300 sequential f32 adds per lane, then a join (the reference and the
                    // kernels' trees sum in other orders), plus the exp's few ulp.
                    for (k, tol) in [0.0, 2e-6, 0.0, 2e-6].into_iter().enumerate() {
                        assert!(vs_exact[k] <= tol && vs_ref[k] <= tol, "column {k}: {what}");
                        worst[k] = worst[k].max(vs_exact[k]);
                    }
                }
            }
        }
    }
    eprintln!("{what} {dt:?}: row stats worst |Δ|/scale vs exact {worst:?}");
    worst
}

#[test]
fn row_stats_match_exact_values_and_the_reference_on_flex() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        check_stats(&common::flex(), "flex", dt);
    }
}

#[cfg(feature = "cube")]
#[test]
fn row_stats_kernel_matches_exact_values_and_the_reference_on_cube() {
    let dev = common::cube_device("cross_entropy row stats");
    check_stats(&dev, "cube", DType::F32);
    for dt in [DType::F16, DType::BF16] {
        if dev.supports_dtype(dt) {
            check_stats(&dev, "cube", dt);
        } else {
            eprintln!(
                "\n!!! the Cube device has no {dt:?}: {dt:?} logits NOT tested on the Cube device !!!\n"
            );
        }
    }
}

/// The online-softmax identity over slices of odd widths (one of them masked padding, as
/// a rank holding only padding): `M = max m_k`, `Σ_k exp(m_k − M)·s_k` is the whole row's
/// `Σ exp(z − M)`, and the target logit and sum of logits add up.
fn check_slices_combine(dev: &Device) {
    let (n, widths) = (5, [7usize, 1, 333, 64]);
    let v: usize = widths.iter().sum();
    let mut x = values(n * v, 17, 8.0);
    for r in 0..n {
        x[r * v + v - 64..(r + 1) * v].fill(-10_000.0);
    }
    let whole = |r: usize| x[r * v..(r + 1) * v].iter().map(|&z| f64::from(z));
    let logits = Tensor::<2>::from_data(TensorData::new(x.clone(), [n, v]), dev);
    let (mut max, mut sum_exp, mut sum) = (vec![f64::NEG_INFINITY; n], vec![0.0; n], vec![0.0; n]);
    let (mut start, mut stats) = (0, vec![]);
    for w in widths {
        let slice = logits.clone().narrow(1, start, w);
        let zeros = Tensor::<1, Int>::zeros([n], dev);
        let part = cross_entropy_row_stats(slice, zeros, Tensor::zeros([n], dev)).unwrap();
        stats.push(to_vec(part));
        start += w;
    }
    for r in 0..n {
        for st in &stats {
            max[r] = max[r].max(f64::from(st[4 * r]));
            sum[r] += f64::from(st[4 * r + 3]);
        }
        for st in &stats {
            sum_exp[r] += f64::from(st[4 * r + 1]) * (f64::from(st[4 * r]) - max[r]).exp();
        }
        let m = whole(r).fold(f64::NEG_INFINITY, f64::max);
        let want = whole(r).map(|z| (z - m).exp()).sum::<f64>();
        assert_eq!(max[r], m, "row {r}");
        assert!(
            sum_exp[r].is_finite() && (sum_exp[r] - want).abs() <= 1e-6 * want,
            "row {r}"
        );
        let abs: f64 = whole(r).map(f64::abs).sum();
        assert!(
            (sum[r] - whole(r).sum::<f64>()).abs() <= 1e-6 * abs,
            "row {r}"
        );
    }
}

#[test]
fn row_stats_of_slices_combine_into_the_whole_row_on_flex() {
    check_slices_combine(&common::flex());
}

#[cfg(feature = "cube")]
#[test]
fn row_stats_of_slices_combine_into_the_whole_row_on_cube() {
    check_slices_combine(&common::cube_device("cross_entropy row stats of slices"));
}

/// Rows with −∞ (a slice masked with −∞): an all −∞ row has max −∞ and a sum of exps of 0,
/// not NaN; −∞ among finite logits adds ~0 (Flex's `exp` saturates at 1.2e-38).
fn check_infinite_rows(dev: &Device) {
    let inf = f32::NEG_INFINITY;
    let x = vec![inf, inf, inf, 1.0, inf, 1.0, inf, 2.0, 0.0];
    let logits = Tensor::<2>::from_data(TensorData::new(x, [3, 3]), dev);
    let target = Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 1, 2], [3]), dev);
    let in_range = Tensor::<1>::ones([3], dev);
    let stats = to_vec(cross_entropy_row_stats(logits, target, in_range).unwrap());
    assert_eq!(stats[..4], [inf, 0.0, inf, inf], "{stats:?}");
    assert_eq!(stats[4..7], [1.0, 2.0, inf], "{stats:?}");
    assert_eq!(
        (stats[8], stats[10], stats[11]),
        (2.0, 0.0, inf),
        "{stats:?}"
    );
    assert!(
        (stats[9] - (1.0 + (-2.0f32).exp())).abs() < 1e-6,
        "{stats:?}"
    );
}

#[test]
fn row_stats_of_infinite_rows_are_not_nan_on_flex() {
    check_infinite_rows(&common::flex());
}

#[cfg(feature = "cube")]
#[test]
fn row_stats_of_infinite_rows_are_not_nan_on_cube() {
    check_infinite_rows(&common::cube_device("cross_entropy row stats of −∞"));
}

/// Garbage targets where `in_range` is 0 (negative, past the slice) must not be read by
/// the kernel: the target logit is 0 there.
#[cfg(feature = "cube")]
#[test]
fn row_stats_kernel_ignores_out_of_range_targets_on_cube() {
    let dev = common::cube_device("cross_entropy row stats out-of-range targets");
    let logits = Tensor::<2>::from_data(TensorData::new(values(3 * 5, 4, 2.0), [3, 5]), &dev);
    let target = Tensor::<1, Int>::from_data(TensorData::new(vec![-3i64, 7, 1_000_000], [3]), &dev);
    let in_range = Tensor::<1>::zeros([3], &dev);
    let stats = to_vec(cross_entropy_row_stats(logits, target, in_range).unwrap());
    assert_eq!([stats[2], stats[6], stats[10]], [0.0; 3], "{stats:?}");
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
    assert!(shape(cross_entropy_row_stats(
        logits.clone(),
        target.clone(),
        row3.clone()
    )));
    assert!(shape(cross_entropy_row_stats(
        Tensor::<2>::zeros([4, 0], &dev),
        target.clone(),
        row4.clone()
    )));
    assert!(shape(cross_entropy_row_stats(
        logits.clone(),
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
