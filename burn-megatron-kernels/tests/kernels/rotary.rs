//! The fused rotary embedding against exact f64 values (from the inputs as stored, the
//! tables rounded to the activations' dtype) and against its reference composed of Burn
//! ops: forward, the gradient through Burn's autodiff of the reference, and the reference's
//! handwritten backward. f32, bf16 and f16; rot < hn and rot = hn; tables shared by the batch and
//! per sample; rotary tables (each frequency twice) and arbitrary ones (the backward is the
//! exact transpose either way); odd sizes, many rows, empty shapes; non-contiguous inputs;
//! bad shapes refused.

use crate::common::{max_abs_diff, to_vec, values};
use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData, bf16, f16};
use burn_megatron_kernels::{
    KernelError, apply_rotary, reference_apply_rotary, reference_apply_rotary_backward,
};

/// One case: `x` `[s, b, heads, hn]`, tables `[s, b or 1, 1, rot]`.
#[derive(Debug, Clone, Copy)]
struct Case {
    s: usize,
    b: usize,
    heads: usize,
    hn: usize,
    rot: usize,
    /// Tables with a row per sample (else shared by the batch).
    per_sample: bool,
    /// Arbitrary table values (else cos/sin of angles, each frequency twice).
    arbitrary: bool,
}

const fn case(dims: [usize; 5], per_sample: bool, arbitrary: bool) -> Case {
    let [s, b, heads, hn, rot] = dims;
    Case {
        s,
        b,
        heads,
        hn,
        rot,
        per_sample,
        arbitrary,
    }
}

/// One rotated pair; rot = hn; rot < hn (odd hn too); b = 1 with "per-sample" tables; 131072
/// elements (several rayon tasks); no positions; no samples.
const CASES: [Case; 11] = [
    case([1, 1, 1, 2, 2], false, false),
    case([5, 3, 2, 8, 8], false, false),
    case([7, 2, 3, 10, 6], true, false),
    case([13, 3, 5, 12, 4], true, true),
    case([5, 2, 3, 9, 6], true, true),
    case([4, 2, 2, 64, 64], false, true),
    case([3, 1, 2, 6, 2], true, false),
    case([33, 2, 4, 70, 66], true, false),
    case([64, 4, 8, 64, 64], false, false),
    case([0, 2, 2, 8, 8], false, false),
    case([3, 0, 2, 8, 4], true, false),
];

impl Case {
    fn dims(&self) -> [usize; 4] {
        [self.s, self.b, self.heads, self.hn]
    }

    fn table_dims(&self) -> [usize; 4] {
        let tb = if self.per_sample { self.b } else { 1 };
        [self.s, tb, 1, self.rot]
    }

    /// (cos, sin) as f32: `position · inv_freq` angles (position `3i + 5·sample`), each
    /// frequency twice, or arbitrary values in [-1, 1].
    fn tables(&self) -> (Vec<f32>, Vec<f32>) {
        let [s, tb, _, rot] = self.table_dims();
        if self.arbitrary {
            let n = s * tb * rot;
            return (values(n, 11, 1.0), values(n, 12, 1.0));
        }
        let (mut cos, mut sin) = (vec![], vec![]);
        for i in 0..s {
            for sample in 0..tb {
                let p = (3 * i + 5 * sample) as f32;
                let half: Vec<f32> = (0..rot / 2)
                    .map(|k| p / 10000f32.powf((2 * k) as f32 / rot as f32))
                    .collect();
                for _ in 0..2 {
                    cos.extend(half.iter().map(|a| a.cos()));
                    sin.extend(half.iter().map(|a| a.sin()));
                }
            }
        }
        (cos, sin)
    }

    /// Exact `(y, dx)` in f64 for `x`, the output gradient `g` and the tables as the op
    /// uses them, per element.
    fn exact(&self, x: &[f32], g: &[f32], cos: &[f32], sin: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let [_, tb, _, rot] = self.table_dims();
        let (hn, half) = (self.hn, rot / 2);
        let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        for row in 0..x.len() / hn {
            let (pos, sample) = (row / self.heads / self.b, row / self.heads % self.b);
            let t = (pos * tb + if tb == 1 { 0 } else { sample }) * rot;
            let at = |v: &[f32], c: usize| f64::from(v[row * hn + c]);
            let tab = |v: &[f32], c: usize| f64::from(v[t + c]);
            for c in 0..hn {
                let i = row * hn + c;
                (y[i], dx[i]) = if c >= rot {
                    (at(x, c), at(g, c))
                } else if c < half {
                    (
                        at(x, c) * tab(cos, c) - at(x, c + half) * tab(sin, c),
                        at(g, c) * tab(cos, c) + at(g, c + half) * tab(sin, c + half),
                    )
                } else {
                    (
                        at(x, c) * tab(cos, c) + at(x, c - half) * tab(sin, c),
                        at(g, c) * tab(cos, c) - at(g, c - half) * tab(sin, c - half),
                    )
                };
            }
        }
        (y, dx)
    }
}

/// A tensor of `dims` holding `v` in dtype `dt` on `dev`, and its values as stored.
fn tensor(dev: &Device, v: Vec<f32>, dims: [usize; 4], dt: DType) -> (Tensor<4>, Vec<f32>) {
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    let t = Tensor::<4>::from_data(TensorData::new(v, dims), options);
    let stored = to_vec(t.clone());
    (t, stored)
}

/// `(y, dx)` of `rotate`, `dx` that of `Σ y·g` through `.backward()`.
fn run(
    x: Tensor<4>,
    g: Tensor<4>,
    rotate: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> (Vec<f32>, Vec<f32>) {
    let x = x.require_grad();
    let y = rotate(x.clone());
    let grads = (y.clone() * g).sum().backward();
    let dx = Tensor::<4>::from_inner(x.grad(&grads).expect("x is tracked"));
    (to_vec(y.detach()), to_vec(dx))
}

fn reference(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    Tensor::from_dispatch(reference_apply_rotary::<Dispatch>(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
    ))
}

fn max_err(got: &[f32], exact: &[f64]) -> f64 {
    assert_eq!(got.len(), exact.len());
    got.iter()
        .zip(exact)
        .map(|(g, e)| (f64::from(*g) - e).abs())
        .fold(0.0, f64::max)
}

/// Worst `(|got − exact| − floor) / |exact|`: `got` is within that many times `|exact|` of
/// `exact`, but for `floor` (half the smallest f16 subnormal, where products underflow).
fn max_rel_err(got: &[f32], exact: &[f64], floor: f64) -> f64 {
    got.iter()
        .zip(exact)
        .map(|(g, e)| ((f64::from(*g) - e).abs() - floor).max(0.0) / e.abs().max(1e-30))
        .fold(0.0, f64::max)
}

/// Unit roundoff of a half type (one rounding: relative error at most this), and the floor
/// of [`max_rel_err`].
fn half_precision(dt: DType) -> (f64, f64) {
    match dt {
        DType::BF16 => (1.0 / 256.0, 0.0),
        DType::F16 => (1.0 / 2048.0, 2f64.powi(-25)),
        _ => unreachable!("f32 is checked in absolute terms"),
    }
}

fn check(dev: &Device, what: &str, dt: DType) {
    let mut worst = [0.0f64; 4];
    for c in CASES {
        let case = format!("{what} {dt:?} {c:?}");
        let n: usize = c.dims().iter().product();
        let (cos_v, sin_v) = c.tables();
        let f32_tables = |v: Vec<f32>| tensor(dev, v, c.table_dims(), DType::F32).0;
        let (cos, sin) = (f32_tables(cos_v.clone()), f32_tables(sin_v.clone()));
        let (x, xv) = tensor(dev, values(n, 1, 1.0), c.dims(), dt);
        let (g, gv) = tensor(dev, values(n, 2, 1.0), c.dims(), dt);

        let rotate = |x| apply_rotary(x, cos.clone(), sin.clone()).expect("valid shapes");
        let (y, dx) = run(x.clone(), g.clone(), rotate);
        let out = apply_rotary(x.clone(), cos.clone(), sin.clone()).unwrap();
        assert_eq!((out.dims(), out.dtype()), (c.dims(), dt), "{case}");

        // The op rounds the tables to the activations' dtype, as the reference casts them.
        let round = |v: &[f32]| -> Vec<f32> {
            match dt {
                DType::BF16 => v.iter().map(|&t| bf16::from_f32(t).to_f32()).collect(),
                DType::F16 => v.iter().map(|&t| f16::from_f32(t).to_f32()).collect(),
                _ => v.to_vec(),
            }
        };
        let (y_ex, dx_ex) = c.exact(&xv, &gv, &round(&cos_v), &round(&sin_v));
        if dt == DType::F32 {
            // Two products and a sum of terms ≤ 1 in f32: ≤ 1.5 ulp of 2.
            let (ey, edx) = (max_err(&y, &y_ex), max_err(&dx, &dx_ex));
            assert!(ey <= 5e-7, "{case}: y error {ey}");
            assert!(edx <= 5e-7, "{case}: dx error {edx}");
            worst[0] = worst[0].max(ey);
            worst[1] = worst[1].max(edx);
        } else {
            // f32 arithmetic, one rounding to the half type: within its unit roundoff.
            let (u, floor) = half_precision(dt);
            let (ey, edx) = (
                max_rel_err(&y, &y_ex, floor),
                max_rel_err(&dx, &dx_ex, floor),
            );
            assert!(ey <= 1.01 * u, "{case}: y relative error {ey}");
            assert!(edx <= 1.01 * u, "{case}: dx relative error {edx}");
            worst[0] = worst[0].max(ey);
            worst[1] = worst[1].max(edx);
        }
        // The pass-through channels are copies, bit for bit.
        for i in (0..n).filter(|i| i % c.hn >= c.rot) {
            assert_eq!(
                y[i].to_bits(),
                xv[i].to_bits(),
                "{case}: y[{i}] passed through"
            );
            assert_eq!(
                dx[i].to_bits(),
                gv[i].to_bits(),
                "{case}: dx[{i}] passed through"
            );
        }
        if n == 0 {
            continue;
        }
        let (yr, dxr) = run(x, g.clone(), |x| reference(x, cos.clone(), sin.clone()));
        let dxh = reference_apply_rotary_backward::<Dispatch>(
            g.into_dispatch(),
            cos.into_dispatch(),
            sin.into_dispatch(),
        );
        let dxh = to_vec(Tensor::<4>::from_dispatch(dxh));
        let vs_ref = [
            max_abs_diff(&y, &yr),
            max_abs_diff(&dx, &dxr),
            max_abs_diff(&dxh, &dxr),
        ];
        // f32: the same products and sums (bit-exact in practice); half types: the
        // reference rounds each product and the sum, |terms| ≤ 1: a few ulps of 2.
        let tol = match dt {
            DType::F32 => 5e-7,
            dt => 8.0 * half_precision(dt).0 as f32,
        };
        for (name, d) in ["y", "autodiff dx", "handwritten reference dx"]
            .iter()
            .zip(vs_ref)
        {
            assert!(d <= tol, "{case}: {name} vs the reference: {d}");
        }
        worst[2] = worst[2].max(f64::from(vs_ref[0]));
        worst[3] = worst[3].max(f64::from(vs_ref[1].max(vs_ref[2])));
    }
    eprintln!(
        "rotary {what} {dt:?}: vs exact y {:.2e} dx {:.2e} ({}), vs reference y {:.2e} dx {:.2e}",
        worst[0],
        worst[1],
        if dt == DType::F32 {
            "absolute"
        } else {
            "relative"
        },
        worst[2],
        worst[3]
    );
}

#[test]
fn rotary_flex_matches_exact_values_and_the_reference() {
    let dev = crate::common::flex();
    check(&dev, "flex", DType::F32);
    check(&dev, "flex", DType::BF16);
    check(&dev, "flex", DType::F16);
}

#[cfg(feature = "cube")]
#[test]
fn rotary_kernel_matches_exact_values_and_the_reference_on_cube() {
    let dev = crate::common::cube_device("rotary");
    check(&dev, "cube", DType::F32);
    if dev.supports_dtype(DType::F16) {
        check(&dev, "cube", DType::F16);
    } else {
        eprintln!(
            "\n!!! the Cube device has no f16: f16 rotary NOT tested on the Cube device !!!\n"
        );
    }
}

/// Activations viewed through a narrow and a permutation (as attention's query and key are
/// cut from the fused projection) give what their contiguous copy gives, bit for bit.
fn strided_inputs_match_contiguous(dev: &Device, what: &str) {
    let c = case([6, 3, 4, 10, 8], true, false);
    let (cos_v, sin_v) = c.tables();
    let f32_tables = |v: Vec<f32>| tensor(dev, v, c.table_dims(), DType::F32).0;
    let (cos, sin) = (f32_tables(cos_v), f32_tables(sin_v));
    // [s, heads, b, 2·hn] → narrow the channels, swap heads and batch.
    let wide = Tensor::<4>::from_data(
        TensorData::new(values(6 * 4 * 3 * 20, 5, 1.0), [6, 4, 3, 20]),
        dev,
    );
    let strided = wide.narrow(3, 3, 10).swap_dims(1, 2);
    let contiguous = Tensor::<4>::from_data(strided.to_data(), dev);
    let g = Tensor::<4>::from_data(
        TensorData::new(values(6 * 3 * 4 * 10, 6, 1.0), c.dims()),
        dev,
    );
    let g_strided = Tensor::<4>::from_data(
        TensorData::new(values(6 * 3 * 4 * 10, 6, 1.0), [6, 4, 3, 10]),
        dev,
    )
    .swap_dims(1, 2);
    let g_contiguous = Tensor::<4>::from_data(g_strided.to_data(), dev);
    let rotate = |x| apply_rotary(x, cos.clone(), sin.clone()).unwrap();
    assert_eq!(
        run(strided, g.clone(), rotate),
        run(contiguous.clone(), g, rotate),
        "{what}: strided activations"
    );
    // A strided output gradient reaches the backward as is.
    assert_eq!(
        run(contiguous.clone(), g_strided, rotate),
        run(contiguous, g_contiguous, rotate),
        "{what}: strided gradient"
    );
}

#[test]
fn rotary_strided_inputs_match_contiguous_on_flex() {
    strided_inputs_match_contiguous(&crate::common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn rotary_kernel_strided_inputs_match_contiguous_on_cube() {
    strided_inputs_match_contiguous(&crate::common::cube_device("rotary strided"), "cube");
}

#[test]
fn rotary_refuses_tables_that_do_not_fit() {
    let dev = Device::flex();
    let x = Tensor::<4>::zeros([5, 3, 2, 8], &dev);
    let t = |dims: [usize; 4]| Tensor::<4>::zeros(dims, &dev);
    for (cos, sin) in [
        ([5, 1, 1, 8], [5, 1, 1, 6]),   // cos and sin differ
        ([4, 1, 1, 8], [4, 1, 1, 8]),   // positions
        ([5, 2, 1, 8], [5, 2, 1, 8]),   // batch neither 1 nor b
        ([5, 3, 2, 8], [5, 3, 2, 8]),   // a heads dimension
        ([5, 1, 1, 5], [5, 1, 1, 5]),   // odd rotary channels
        ([5, 1, 1, 10], [5, 1, 1, 10]), // more than the head
        ([5, 1, 1, 0], [5, 1, 1, 0]),   // none
    ] {
        let e = apply_rotary(x.clone(), t(cos), t(sin)).unwrap_err();
        assert!(matches!(e, KernelError::Shape(_)), "{cos:?} {sin:?}: {e}");
        assert!(
            e.to_string().contains('['),
            "the message names the shapes: {e}"
        );
    }
    assert!(apply_rotary(x.clone(), t([5, 3, 1, 8]), t([5, 3, 1, 8])).is_ok());
    assert!(apply_rotary(x, t([5, 1, 1, 2]), t([5, 1, 1, 2])).is_ok());
}
