//! Scaled masked softmax against an exact f64 host softmax (forward) and the exact host
//! gradient formula (backward), against the attention layer's composition of Burn ops, with
//! padding, causal (sq = sk and sq ≠ sk), all-masked rows, large magnitudes and empty shapes;
//! on Flex (its native row loops) and, with a Cube feature (`wgpu` or `cuda`), the row-per-cube kernels on
//! lavapipe. Flex's loops also against the reference composed of Burn ops, forward, Burn's
//! autodiff of it and the reference backward, in f32 and bf16.

use crate::common;

use burn::backend::Dispatch;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{
    KernelError, MASKED_SCORE, reference_scaled_masked_softmax,
    reference_scaled_masked_softmax_backward, scaled_masked_softmax,
};
use common::{max_abs_diff, to_vec, values};

/// [b, heads, sq, sk]: row lengths 1, 3, 37, 128, 1000 (not multiples of a cube), sq ≠ sk
/// both ways, b and heads > 1, more rows than one grid axis holds, and empty shapes.
const SHAPES: [[usize; 4]; 11] = [
    [1, 1, 1, 1],
    [2, 3, 4, 3],
    [2, 2, 5, 37],
    [1, 2, 37, 37],
    [2, 1, 3, 128],
    [1, 1, 4, 1000],
    [2, 2, 8, 5],
    [1, 1, 70_000, 2],
    [0, 2, 3, 4],
    [2, 2, 3, 0],
    [2, 2, 0, 3],
];

/// Padded keys: batch 0 pads its last third, batch 1 (when present) pads every key, so its
/// rows are all masked.
fn padding(b: usize, sk: usize) -> Vec<bool> {
    (0..b * sk)
        .map(|k| {
            if k / sk == 0 {
                3 * (k % sk) >= 2 * sk
            } else {
                true
            }
        })
        .collect()
}

fn masked(pad: Option<&[bool]>, causal: bool, dims: [usize; 4], row: usize, j: usize) -> bool {
    let [_, h, sq, sk] = dims;
    let (bi, i) = (row / (h * sq), row % sq);
    pad.is_some_and(|p| p[bi * sk + j]) || (causal && j + sq > i + sk)
}

/// (y, dx) in f64 per element: the definition evaluated exactly, from `x · scale` rounded to
/// f32 as every implementation does (at |x| = 1e4 an unrounded product would move the
/// exponent by up to 5e-4, which no f32 implementation can reproduce).
fn exact(
    x: &[f32],
    dy: &[f32],
    pad: Option<&[bool]>,
    scale: f32,
    causal: bool,
    dims: [usize; 4],
) -> (Vec<f64>, Vec<f64>) {
    let sk = dims[3];
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    for row in 0..x.len().checked_div(sk).unwrap_or(0) {
        let r = row * sk..(row + 1) * sk;
        let v: Vec<f64> = (0..sk)
            .map(|j| {
                let s = if masked(pad, causal, dims, row, j) {
                    MASKED_SCORE
                } else {
                    x[r.start + j] * scale
                };
                f64::from(s)
            })
            .collect();
        let max = v.iter().copied().fold(f64::MIN, f64::max);
        let sum: f64 = v.iter().map(|v| (v - max).exp()).sum();
        let yr: Vec<f64> = v.iter().map(|v| (v - max).exp() / sum).collect();
        let dot: f64 = (0..sk).map(|j| f64::from(dy[r.start + j]) * yr[j]).sum();
        for j in 0..sk {
            y[r.start + j] = yr[j];
            if !masked(pad, causal, dims, row, j) {
                dx[r.start + j] = f64::from(scale) * yr[j] * (f64::from(dy[r.start + j]) - dot);
            }
        }
    }
    (y, dx)
}

fn max_err(got: &[f32], exact: &[f64]) -> f64 {
    assert_eq!(got.len(), exact.len());
    got.iter()
        .zip(exact)
        .map(|(g, e)| (f64::from(*g) - e).abs())
        .fold(0.0, f64::max)
}

fn check(device: &Device, what: &str) {
    let (mut worst_y, mut worst_dx) = (0.0f64, 0.0f64);
    for dims in SHAPES {
        let [b, _, _, sk] = dims;
        let n: usize = dims.iter().product();
        // Large magnitudes at scale 1: scores ±1e4 around the masked value itself.
        for (scale, magnitude) in [(0.125f32, 8.0f32), (1.0, 1e4)] {
            for (with_pad, causal) in [(false, false), (true, false), (false, true), (true, true)] {
                let (xv, gv) = (values(n, 1, magnitude), values(n, 2, 1.0));
                let pv = padding(b, sk);
                let pad_ref = with_pad.then_some(&pv[..]);
                let (y_ex, dx_ex) = exact(&xv, &gv, pad_ref, scale, causal, dims);
                let x = Tensor::<4>::from_data(TensorData::new(xv, dims), device).require_grad();
                let pad = with_pad.then(|| {
                    Tensor::<2, Bool>::from_data(TensorData::new(pv.clone(), [b, sk]), device)
                });
                let g = Tensor::<4>::from_data(TensorData::new(gv, dims), device);
                let y = scaled_masked_softmax(x.clone(), pad.clone(), scale, causal).unwrap();
                assert_eq!(y.dims(), dims);
                let grads = (y.clone() * g).sum().backward();
                let dx = to_vec(Tensor::<4>::from_inner(x.grad(&grads).unwrap()));
                let y = to_vec(y.detach());
                let (ey, edx) = (max_err(&y, &y_ex), max_err(&dx, &dx_ex));
                worst_y = worst_y.max(ey);
                worst_dx = worst_dx.max(edx);
                let case = format!(
                    "{what} {dims:?} scale {scale} ×{magnitude} pad {with_pad} causal {causal}"
                );
                // y ∈ [0, 1]: f32 exp (a few ulps), a sum of ≤ 1000 terms in a tree, one
                // division: 4e-7 absolute is ~7 ulps just below 1, far below any real error
                // (a wrong mask or max moves values by ≥ 1/sk).
                assert!(ey <= 4e-7, "{case}: y error {ey}");
                // dx = scale·y·(dy − dot), |dy| ≤ 1: the y error times ≤ 2·scale, plus the
                // dot's rounding over ≤ 1000 terms.
                assert!(edx <= 1e-6 * f64::from(scale), "{case}: dx error {edx}");
                for (i, &d) in dx.iter().enumerate() {
                    if masked(pad_ref, causal, dims, i / sk, i % sk) {
                        assert_eq!(d, 0.0, "{case}: masked position {i} has gradient");
                    }
                }
                if n > 0 {
                    // The attention layer's composition: mask_fill(·scale, −10000), softmax.
                    let mut s = x.clone().detach().mul_scalar(scale);
                    if let Some(pad) = pad {
                        s = s.mask_fill(
                            pad.unsqueeze_dim::<3>(1).unsqueeze_dim::<4>(1),
                            MASKED_SCORE,
                        );
                    }
                    if causal {
                        let [_, _, sq, sk] = dims;
                        let m: Vec<bool> =
                            (0..sq * sk).map(|k| k % sk + sq > k / sk + sk).collect();
                        let m = Tensor::<2, Bool>::from_data(TensorData::new(m, [sq, sk]), device);
                        s = s.mask_fill(m.unsqueeze::<4>(), MASKED_SCORE);
                    }
                    let d = max_abs_diff(&y, &to_vec(softmax(s, 3)));
                    assert!(d <= 4e-7, "{case}: vs composition {d}");
                }
            }
        }
    }
    eprintln!("{what}: max |Δy| {worst_y:.3e}, max |Δdx| {worst_dx:.3e}");
}

#[test]
fn native_path_matches_exact_values_on_flex() {
    check(&common::flex(), "flex");
}

fn all_masked_rows_are_uniform(device: &Device, what: &str) {
    for sk in [1, 3, 37, 1000] {
        let dims = [1, 2, 3, sk];
        let x = Tensor::<4>::from_data(TensorData::new(values(6 * sk, 3, 50.0), dims), device)
            .require_grad();
        let pad = Tensor::<2, Bool>::from_data(TensorData::new(vec![true; sk], [1, sk]), device);
        let y = scaled_masked_softmax(x.clone(), Some(pad), 1.0, false).unwrap();
        let grads = y.clone().sum().backward();
        for v in to_vec(y.detach()) {
            // Equal inputs: every exp is exactly 1, so y is 1/sk up to the division's rounding.
            assert!(
                (f64::from(v) - 1.0 / sk as f64).abs() <= 1e-7,
                "{what} sk {sk}: {v}"
            );
        }
        let dx = to_vec(Tensor::<4>::from_inner(x.grad(&grads).unwrap()));
        assert!(
            dx.iter().all(|&d| d == 0.0),
            "{what} sk {sk}: masked inputs got gradient"
        );
    }
}

#[test]
fn all_masked_rows_are_uniform_on_flex() {
    all_masked_rows_are_uniform(&common::flex(), "flex");
}

/// Scores from a transposed product (not row-major) give what their contiguous copy gives.
fn strided_scores_match_contiguous(device: &Device, what: &str) {
    let dims = [2, 3, 37, 5];
    let t = Tensor::<4>::from_data(
        TensorData::new(values(2 * 3 * 37 * 5, 7, 4.0), dims),
        device,
    );
    let strided = t.swap_dims(2, 3);
    let contiguous = Tensor::<4>::from_data(strided.to_data(), device);
    let pad = Tensor::<2, Bool>::from_data(TensorData::new(padding(2, 37), [2, 37]), device);
    let run = |x: Tensor<4>| {
        let x = x.require_grad();
        let y = scaled_masked_softmax(x.clone(), Some(pad.clone()), 0.5, true).unwrap();
        let grads = (y.clone() * y.clone()).sum().backward();
        let dx = Tensor::<4>::from_inner(x.grad(&grads).unwrap());
        (to_vec(y.detach()), to_vec(dx))
    };
    let ((y1, dx1), (y2, dx2)) = (run(strided), run(contiguous));
    // Same values in the same order: the same arithmetic, bit for bit.
    assert_eq!(y1, y2, "{what}: forward on strided scores");
    assert_eq!(dx1, dx2, "{what}: backward on strided scores");
}

#[test]
fn strided_scores_match_contiguous_on_flex() {
    strided_scores_match_contiguous(&common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_strided_scores_match_contiguous_on_cube() {
    let device = common::cube_device("softmax strided");
    strided_scores_match_contiguous(&device, "cube");
}

/// Unmasked scores at the masked value's level: the masked keys' probabilities are not
/// negligible, and the backward's `Σ dy·y` must count them (the module docs).
fn masked_keys_count_in_the_backward_sum(device: &Device, what: &str) {
    let dims = [1, 2, 3, 5];
    let n = 30;
    let xv: Vec<f32> = values(n, 9, 2.0).iter().map(|v| MASKED_SCORE + v).collect();
    let gv = values(n, 10, 1.0);
    let pv = vec![false, false, true, false, false];
    let (y_ex, dx_ex) = exact(&xv, &gv, Some(&pv), 1.0, true, dims);
    let x = Tensor::<4>::from_data(TensorData::new(xv, dims), device).require_grad();
    let pad = Tensor::<2, Bool>::from_data(TensorData::new(pv, [1, 5]), device);
    let g = Tensor::<4>::from_data(TensorData::new(gv, dims), device);
    let y = scaled_masked_softmax(x.clone(), Some(pad), 1.0, true).unwrap();
    let grads = (y.clone() * g).sum().backward();
    let dx = to_vec(Tensor::<4>::from_inner(x.grad(&grads).unwrap()));
    let (ey, edx) = (max_err(&to_vec(y.detach()), &y_ex), max_err(&dx, &dx_ex));
    assert!(
        ey <= 4e-7 && edx <= 1e-6,
        "{what}: y error {ey}, dx error {edx}"
    );
}

#[test]
fn masked_keys_count_in_the_backward_sum_on_flex() {
    masked_keys_count_in_the_backward_sum(&common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_masked_keys_count_in_the_backward_sum_on_cube() {
    masked_keys_count_in_the_backward_sum(&common::cube_device("softmax masked sum"), "cube");
}

#[test]
fn bad_arguments_are_refused_before_any_launch() {
    let device = common::flex();
    let x = Tensor::<4>::zeros([2, 1, 3, 4], &device);
    let pad = Tensor::<2, Bool>::empty([2, 3], &device);
    let e = scaled_masked_softmax(x.clone(), Some(pad), 1.0, false).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
    for scale in [f32::NAN, f32::INFINITY] {
        let e = scaled_masked_softmax(x.clone(), None, scale, true).unwrap_err();
        assert!(matches!(e, KernelError::Argument(_)), "{e}");
    }
}

#[cfg(feature = "cube")]
#[test]
fn kernel_matches_exact_values_on_cube() {
    let device = common::cube_device("softmax");
    check(&device, "cube");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_all_masked_rows_are_uniform_on_cube() {
    let device = common::cube_device("softmax all-masked");
    all_masked_rows_are_uniform(&device, "cube");
}

/// [b, heads, sq, sk] for Flex's loops against the reference: causal with sq = sk, sq < sk
/// (queries after a cache) and sq > sk (the first rows fully masked); rows that are not
/// multiples of 16 lanes; rows over several rayon tasks; long rows. With padding, batch 1
/// pads every key (fully masked rows).
const NATIVE_SHAPES: [[usize; 4]; 6] = [
    [2, 3, 5, 5],
    [2, 2, 3, 7],
    [2, 2, 7, 3],
    [2, 2, 16, 37],
    [2, 4, 64, 64],
    [2, 1, 2, 1000],
];

/// A tensor of `dims` holding `v` in dtype `dt`.
fn stored(device: &Device, v: Vec<f32>, dims: [usize; 4], dt: DType) -> Tensor<4> {
    let options = TensorCreationOptions::new(device.clone()).with_dtype(dt);
    Tensor::<4>::from_data(TensorData::new(v, dims), options)
}

/// `(y, dx)` of `f`, `dx` that of `Σ y·g` through `.backward()`.
fn run(x: Tensor<4>, g: Tensor<4>, f: impl FnOnce(Tensor<4>) -> Tensor<4>) -> (Vec<f32>, Vec<f32>) {
    let x = x.detach().require_grad();
    let y = f(x.clone());
    let grads = (y.clone() * g).sum().backward();
    let dx = Tensor::<4>::from_inner(x.grad(&grads).expect("x is tracked"));
    (to_vec(y.detach()), to_vec(dx))
}

/// Worst differences of Flex's loops from the reference: (y, dx vs Burn's autodiff of the
/// reference, dx vs the reference backward), each over `scale` for dx.
fn native_vs_reference(dt: DType) -> [f32; 3] {
    let device = common::flex();
    let mut worst = [0.0f32; 3];
    for dims in NATIVE_SHAPES {
        let [b, _, _, sk] = dims;
        let n: usize = dims.iter().product();
        for (scale, magnitude) in [(0.125f32, 8.0f32), (1.0, 1e4)] {
            for (with_pad, causal) in [(false, false), (true, false), (false, true), (true, true)] {
                let case = format!(
                    "{dt:?} {dims:?} scale {scale} ×{magnitude} pad {with_pad} causal {causal}"
                );
                let x = stored(&device, values(n, 1, magnitude), dims, dt);
                let g = stored(&device, values(n, 2, 1.0), dims, dt);
                let pv = padding(b, sk);
                let pad_t =
                    Tensor::<2, Bool>::from_data(TensorData::new(pv.clone(), [b, sk]), &device);
                let pad = with_pad.then(|| pad_t.clone());
                let native = |x| scaled_masked_softmax(x, pad.clone(), scale, causal).unwrap();
                let (y, dx) = run(x.clone(), g.clone(), native);
                let reference = |x: Tensor<4>| {
                    Tensor::<4>::from_dispatch(reference_scaled_masked_softmax::<Dispatch>(
                        x.into_dispatch(),
                        pad_t.clone().into_dispatch(),
                        with_pad,
                        scale,
                        causal,
                    ))
                };
                let (yr, dxr) = run(x.clone(), g.clone(), reference);
                let dxh = reference_scaled_masked_softmax_backward::<Dispatch>(
                    reference(x.clone()).detach().into_dispatch(),
                    g.into_dispatch(),
                    pad_t.into_dispatch(),
                    with_pad,
                    scale,
                    causal,
                );
                let dxh = to_vec(Tensor::<4>::from_dispatch(dxh));
                let pad_ref = with_pad.then_some(&pv[..]);
                for (i, &d) in dx.iter().enumerate() {
                    if masked(pad_ref, causal, dims, i / sk, i % sk) {
                        assert_eq!(d, 0.0, "{case}: masked position {i} has gradient");
                    }
                }
                let d = [
                    max_abs_diff(&y, &yr),
                    max_abs_diff(&dx, &dxr) / scale,
                    max_abs_diff(&dx, &dxh) / scale,
                ];
                // f32: the same formulas, a vectorised exp within 2 ulp and other summation
                // orders: ~1e-7 (y ≤ 1, |dx| ≤ 2·scale). bf16: y rounded once on each side
                // from f32 values that differ by ulps: they may round apart, by one bf16 ulp
                // (2⁻⁸ just below 1); the reference's backward also rounds g − dot, the
                // product and the scaling to bf16 (≤ 2⁻⁸·2 each).
                let tol = if dt == DType::F32 {
                    [1e-6, 1e-6, 1e-6]
                } else {
                    [2.0 / 256.0, 3.0 / 64.0, 3.0 / 64.0]
                };
                for (k, name) in ["y", "dx vs autodiff", "dx vs backward"].iter().enumerate() {
                    assert!(d[k] <= tol[k], "{case}: {name} differs by {}", d[k]);
                    worst[k] = worst[k].max(d[k]);
                }
            }
        }
    }
    eprintln!(
        "flex {dt:?} vs reference: max |Δy| {:.2e}, max |Δdx|/scale {:.2e} (autodiff) {:.2e} (backward)",
        worst[0], worst[1], worst[2]
    );
    worst
}

#[test]
fn native_matches_the_reference_in_f32_on_flex() {
    native_vs_reference(DType::F32);
}

#[test]
fn native_matches_the_reference_in_bf16_on_flex() {
    native_vs_reference(DType::BF16);
}
