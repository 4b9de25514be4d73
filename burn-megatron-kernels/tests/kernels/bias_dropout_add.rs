//! Bias + dropout + residual: the host hash (keep rate, seed independence, pinned values), the
//! fused op against exact f64 values (forward, x / bias / residual gradients) and against
//! Burn's composition with the host mask, the kernel's mask bit for bit against the host's,
//! and argument checks; on Flex (reference path) and, with a Cube feature (`wgpu` or `cuda`), on the Cube device.

use crate::common;

use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron_kernels::{
    KernelError, bias_dropout_add, dropout_hash, dropout_keep, dropout_mask, dropout_threshold,
};
use common::{max_abs_diff, to_vec, values};

/// Seeds with both 32-bit halves in play.
const SEEDS: [u64; 3] = [0, 0xDEAD_BEEF_1234_5678, u64::MAX];

#[test]
fn hash_values_are_pinned() {
    // The mask must not change between versions: checkpoints resume with the same seeds.
    assert_eq!(
        [0, 1, 2, 1000].map(|i| dropout_hash(0, i)),
        [0x16A6_A54D, 0x1959_48FE, 0x306A_B7F2, 0x7786_9C13],
    );
    assert_eq!(
        [0, 1].map(|i| dropout_hash(0xDEAD_BEEF_1234_5678, i)),
        [0xF0C7_49AA, 0xE2B6_555A],
    );
    assert_eq!(dropout_threshold(0.0), 0);
    assert_eq!(dropout_threshold(0.5), 1 << 31);
    assert_eq!(dropout_threshold(0.25), 1 << 30);
    // The largest f32 below 1 still leaves 2^8 hashes kept.
    assert_eq!(dropout_threshold(1.0 - f32::EPSILON / 2.0), u32::MAX - 255);
}

#[test]
fn keep_rate_is_within_binomial_tolerance() {
    let n = 1u32 << 20;
    for seed in SEEDS {
        for prob in [0.01f32, 0.1, 0.5, 0.9] {
            let kept = (0..n).filter(|&i| dropout_keep(seed, i, prob)).count() as f64;
            let (n, p) = (f64::from(n), f64::from(prob));
            // Kept count ~ Binomial(n, 1 − p): five standard deviations (p ≈ 6e-7 per case).
            let sd = (n * p * (1.0 - p)).sqrt();
            let err = (kept - n * (1.0 - p)).abs();
            assert!(
                err <= 5.0 * sd,
                "seed {seed:#x} p {p}: kept {kept}, {err} > 5σ = {sd}"
            );
        }
    }
}

#[test]
fn masks_of_neighbouring_seeds_are_uncorrelated() {
    let n = 1u32 << 20;
    for (a, b) in [(7u64, 8u64), (7, 7 + (1 << 32)), (u64::MAX - 1, u64::MAX)] {
        let p = 0.5;
        let mask = |s| (0..n).map(move |i| f64::from(u8::from(dropout_keep(s, i, p))));
        let (ma, mb): (Vec<f64>, Vec<f64>) = (mask(a).collect(), mask(b).collect());
        let mean = |v: &[f64]| v.iter().sum::<f64>() / f64::from(n);
        let (ea, eb) = (mean(&ma), mean(&mb));
        let cov: f64 = ma
            .iter()
            .zip(&mb)
            .map(|(x, y)| (x - ea) * (y - eb))
            .sum::<f64>();
        let var = |v: &[f64], e: f64| v.iter().map(|x| (x - e).powi(2)).sum::<f64>();
        let corr = cov / (var(&ma, ea) * var(&mb, eb)).sqrt();
        // Independent masks: corr ~ N(0, 1/n), so 5/√n is five standard deviations.
        assert!(
            corr.abs() < 5.0 / f64::from(n).sqrt(),
            "seeds {a:#x} / {b:#x}: correlation {corr}"
        );
        // Same rate but not a shifted copy either: positions agree about half the time.
        let agree = ma.iter().zip(&mb).filter(|(x, y)| x == y).count() as f64;
        assert!(
            (agree / f64::from(n) - 0.5).abs() < 0.01,
            "seeds {a} / {b}: {agree}"
        );
    }
}

/// Shapes as [rows, cols] (cols = bias size): one element, sizes that are not multiples of
/// a cube, empty tensors (no rows, empty rows) and a long row.
const SHAPES: [[usize; 2]; 7] = [
    [1, 1],
    [3, 5],
    [37, 33],
    [0, 4],
    [4, 0],
    [4, 1000],
    [1031, 3],
];

/// Per element: (y, grad x) in f64 from the host mask, and the bias gradient.
fn exact(
    x: &[f32],
    b: Option<&[f32]>,
    r: &[f32],
    g: &[f32],
    prob: f32,
    seed: u64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let cols = b.map_or(0, <[f32]>::len);
    let c = cols.max(1); // x is empty when cols is 0
    let scale = 1.0 / (1.0 - f64::from(prob));
    let (mut y, mut gx, mut gb) = (vec![], vec![], vec![0.0; cols]);
    for i in 0..x.len() {
        let keep = if dropout_keep(seed, i as u32, prob) {
            scale
        } else {
            0.0
        };
        let v = f64::from(x[i]) + b.map_or(0.0, |b| f64::from(b[i % c]));
        y.push(f64::from(r[i]) + keep * v);
        gx.push(keep * f64::from(g[i]));
        if cols > 0 {
            gb[i % c] += keep * f64::from(g[i]);
        }
    }
    (y, gx, gb)
}

fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// max over elements of |got − exact| / bound: ≤ 1 passes.
fn worst(got: &[f32], exact: &[f64], bound: impl Fn(usize) -> f64) -> f64 {
    assert_eq!(got.len(), exact.len());
    (0..got.len())
        .map(|i| (f64::from(got[i]) - exact[i]).abs() / bound(i).max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

fn check(device: &Device, what: &str) {
    let mut max_rel = [0.0f64; 3];
    for shape in SHAPES {
        let [rows, cols] = shape;
        let n = rows * cols;
        for (k, (prob, seed)) in [(0.0, 5), (0.1, SEEDS[1]), (0.5, SEEDS[2])]
            .into_iter()
            .enumerate()
        {
            for magnitude in [1.0f32, 1e4] {
                for with_bias in [true, false] {
                    let (xv, bv, rv, gv) = (
                        values(n, 10 + k as u64, magnitude),
                        values(cols, 20, magnitude),
                        values(n, 30, magnitude),
                        values(n, 40, 1.0),
                    );
                    let bias_ref = with_bias.then_some(&bv[..]);
                    let (y_ex, gx_ex, gb_ex) = exact(&xv, bias_ref, &rv, &gv, prob, seed);
                    let x = tensor(xv.clone(), shape, device).require_grad();
                    let b = tensor(bv.clone(), [cols], device).require_grad();
                    let r = tensor(rv.clone(), shape, device).require_grad();
                    let g = tensor(gv, shape, device);
                    let bias = with_bias.then(|| b.clone());
                    let y = bias_dropout_add(x.clone(), bias, r.clone(), prob, seed).unwrap();
                    let grads = (y.clone() * g.clone()).sum().backward();
                    let y = to_vec(y.detach());
                    let s = 1.0 / (1.0 - f64::from(prob));
                    // Forward: up to three f32 roundings (x + b, ·scale, + r), each ≤ 2⁻²⁴ of
                    // a value bounded by (|x| + |b|)·s + |r|; allow 4·2⁻²⁴ of that bound.
                    let bound = |i: usize| {
                        let bi = if with_bias { bv[i % cols].abs() } else { 0.0 };
                        4.0 * f64::from(f32::EPSILON) / 2.0
                            * ((f64::from(xv[i].abs() + bi)) * s + f64::from(rv[i].abs()))
                    };
                    let rel = worst(&y, &y_ex, bound);
                    // grad x = g·s on kept elements: one rounding of a value ≤ s.
                    let gx = to_vec(Tensor::<2>::from_inner(x.grad(&grads).unwrap()));
                    let rel_gx = worst(&gx, &gx_ex, |_| f64::from(f32::EPSILON) * s);
                    let gr = to_vec(Tensor::<2>::from_inner(r.grad(&grads).unwrap()));
                    let g_vec = to_vec(g.clone());
                    assert_eq!(
                        gr, g_vec,
                        "{what} {shape:?}: residual gradient is the gradient"
                    );
                    // grad bias: f32 sums of up to 1031 terms ≤ s; a rows·2⁻²⁴·s bound.
                    let rel_gb = if with_bias {
                        let gb = to_vec(Tensor::<1>::from_inner(b.grad(&grads).unwrap()));
                        worst(&gb, &gb_ex, |_| rows as f64 * f64::from(f32::EPSILON) * s)
                    } else {
                        assert!(
                            b.grad(&grads).is_none(),
                            "{what}: an unused bias has no gradient"
                        );
                        0.0
                    };
                    let worst_case = rel.max(rel_gx).max(rel_gb);
                    for (m, v) in max_rel.iter_mut().zip([rel, rel_gx, rel_gb]) {
                        *m = m.max(v);
                    }
                    assert!(
                        worst_case <= 1.0,
                        "{what} {shape:?} p {prob} ×{magnitude} bias {with_bias}: \
                         y {rel} gx {rel_gx} gb {rel_gb} (fractions of the bound)"
                    );
                    if n > 0 && prob > 0.0 {
                        // Burn's composition with the public host mask, on the same device.
                        let kept = dropout_mask(seed, shape, prob, device);
                        let v = x.clone().detach()
                            + b.clone()
                                .detach()
                                .unsqueeze::<2>()
                                .mul_scalar(if with_bias { 1.0 } else { 0.0 });
                        let composed = r.clone().detach()
                            + v.mul_scalar(1.0 / (1.0 - prob))
                                .mask_fill(kept.bool_not(), 0.0);
                        let d = max_abs_diff(&y, &to_vec(composed));
                        let scale_of = magnitude * 4.0 / (1.0 - prob);
                        // Same f32 ops except the bias-free case (+0·b): a few ulps.
                        assert!(
                            d <= 4.0 * f32::EPSILON * scale_of,
                            "{what} {shape:?}: composed {d}"
                        );
                    }
                }
            }
        }
    }
    eprintln!("{what}: worst error / bound: y, grad x, grad bias = {max_rel:.3?}");
}

#[test]
fn reference_path_matches_exact_values_on_flex() {
    check(&common::flex(), "flex");
}

#[test]
fn bad_arguments_are_refused_before_any_launch() {
    let device = common::flex();
    let x = Tensor::<2>::zeros([2, 3], &device);
    let b = Tensor::<1>::zeros([3], &device);
    for prob in [1.0, 1.5, -0.1, f32::NAN] {
        let e = bias_dropout_add(x.clone(), Some(b.clone()), x.clone(), prob, 0).unwrap_err();
        assert!(matches!(e, KernelError::Argument(_)), "p {prob}: {e}");
    }
    let r = Tensor::<2>::zeros([3, 2], &device);
    let e = bias_dropout_add(x.clone(), None, r, 0.1, 0).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
    let b2 = Tensor::<1>::zeros([2], &device);
    let e = bias_dropout_add(x.clone(), Some(b2), x.clone(), 0.1, 0).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
}

/// The kept positions the fused op applied (`x = 1`, `residual = 0`: kept ⇔ y ≠ 0).
fn applied_mask(device: &Device, n: usize, prob: f32, seed: u64) -> Vec<bool> {
    let ones = Tensor::<1>::ones([n], device);
    let y = bias_dropout_add(ones, None, Tensor::zeros([n], device), prob, seed).unwrap();
    to_vec(y).into_iter().map(|v| v != 0.0).collect()
}

fn mask_is_the_host_mask(device: &Device, what: &str) {
    // 70 000 · 64 elements span more than 65 535 cubes in one grid axis.
    for n in [1, 37, 1000, 70_000 * 64] {
        for seed in SEEDS {
            for prob in [0.1, 0.5, 0.97] {
                let host: Vec<bool> = (0..n).map(|i| dropout_keep(seed, i as u32, prob)).collect();
                let got = applied_mask(device, n, prob, seed);
                let bad = host.iter().zip(&got).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "{what} n {n} seed {seed:#x} p {prob}: {bad} differ");
            }
        }
    }
}

/// A transposed `x` is dropped by its logical (row-major) index, as its contiguous copy is.
fn strided_input_matches_contiguous(device: &Device, what: &str) {
    let t = tensor(values(37 * 33, 8, 2.0), [37, 33], device);
    let strided = t.transpose();
    let contiguous = Tensor::<2>::from_data(strided.to_data(), device);
    let r = tensor(values(33 * 37, 9, 2.0), [33, 37], device);
    let b = tensor(values(37, 10, 2.0), [37], device);
    let run = |x| to_vec(bias_dropout_add(x, Some(b.clone()), r.clone(), 0.3, 11).unwrap());
    assert_eq!(run(strided), run(contiguous), "{what}: strided x");
}

#[test]
fn strided_input_matches_contiguous_on_flex() {
    strided_input_matches_contiguous(&common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_strided_input_matches_contiguous_on_cube() {
    let device = common::cube_device("bias_dropout_add strided");
    strided_input_matches_contiguous(&device, "cube");
}

#[test]
fn reference_mask_is_the_host_mask_on_flex() {
    mask_is_the_host_mask(&common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_matches_exact_values_on_cube() {
    let device = common::cube_device("bias_dropout_add");
    check(&device, "cube");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_mask_is_the_host_mask_bit_for_bit_on_cube() {
    let device = common::cube_device("bias_dropout_add mask");
    mask_is_the_host_mask(&device, "cube");
}
