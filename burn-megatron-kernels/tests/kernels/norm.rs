//! Sums of squares of many tensors: against exact f64 host sums over sizes that are not
//! multiples of a cube or a chunk (0, 1, 3, 37, 1000, 4097, 70001), large magnitudes,
//! non-finite inputs and f16 inputs, on Flex (reference path) and, with a Cube feature (`wgpu` or `cuda`),
//! the CubeCL kernels on the Cube device.

use crate::common;

use burn::tensor::{DType, Device, FloatDType, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{KernelError, multi_tensor_sum_of_squares, segment_sum_of_squares};
use common::values;

const SIZES: [usize; 9] = [0, 1, 3, 37, 1000, 0, 4097, 70001, 2];

fn tensor(device: &Device, v: &[f32]) -> Tensor<1> {
    Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), device)
}

fn exact(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

/// max relative error of the per-tensor sums against exact f64, for inputs of `scale`.
fn relative_error(device: &Device, scale: f32) -> f32 {
    let inputs: Vec<Vec<f32>> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| values(n, i as u64 + 11, scale))
        .collect();
    let tensors: Vec<Tensor<1>> = inputs.iter().map(|v| tensor(device, v)).collect();
    let sums = multi_tensor_sum_of_squares(&tensors).expect("one device");
    assert_eq!(sums.dtype(), DType::F32);
    let got: Vec<f32> = sums.into_data().iter::<f32>().collect();
    assert_eq!(got.len(), SIZES.len());
    inputs
        .iter()
        .zip(&got)
        .map(|(v, &g)| {
            let want = exact(v);
            if want == 0.0 {
                assert_eq!(g, 0.0, "empty tensor");
                0.0
            } else {
                ((f64::from(g) - want).abs() / want) as f32
            }
        })
        .fold(0.0, f32::max)
}

fn check(device: &Device, what: &str) {
    // 1e15: squares near 1e30, sums near 7e34, still inside f32 (1e18 would square to
    // 1e36 and sum past f32::MAX; documented overflow).
    for scale in [1.0, 3.0e3, 1.0e15] {
        let err = relative_error(device, scale);
        // f32 accumulation: ~16 serial adds per unit, an 8-level tree, then ≤ 18 partials;
        // each add is off by ≤ 2⁻²⁴ relative, so a few 1e-6 at most; 1e-5 leaves margin
        // and still fails on any lost element (≥ 1/70001 ≈ 1.4e-5 of a sum of positives).
        assert!(err <= 1e-5, "{what} ×{scale}: relative error {err}");
        eprintln!("{what} ×{scale}: max relative error {err:.2e}");
    }
    // Segments of one buffer, given by lengths.
    let v = values(1000, 5, 2.0);
    let sums = segment_sum_of_squares(tensor(device, &v), &[0, 400, 0, 599, 1]).unwrap();
    let got: Vec<f32> = sums.into_data().iter::<f32>().collect();
    let want = [
        0.0,
        exact(&v[..400]),
        0.0,
        exact(&v[400..999]),
        exact(&v[999..]),
    ];
    for (g, w) in got.iter().zip(want) {
        assert!(
            (f64::from(*g) - w).abs() <= 1e-5 * w,
            "{what}: {got:?} vs {want:?}"
        );
    }
    // Inf, NaN and an overflowing square reach only their own tensor's sum.
    let bad = [
        tensor(device, &[1.0, f32::INFINITY]),
        tensor(device, &[2.0]),
        tensor(device, &[f32::NAN, 0.0, 1.0]),
        tensor(device, &[3.0e19]),
    ];
    let got: Vec<f32> = multi_tensor_sum_of_squares(&bad)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect();
    assert!(got[0] == f32::INFINITY && got[1] == 4.0, "{what}: {got:?}");
    assert!(
        got[2].is_nan() && got[3] == f32::INFINITY,
        "{what}: {got:?}"
    );
    // Only empty tensors, and half-precision inputs (exact f64 of the stored halves).
    let empty = multi_tensor_sum_of_squares(&[tensor(device, &[]), tensor(device, &[])]).unwrap();
    assert_eq!(
        empty.into_data().iter::<f32>().collect::<Vec<_>>(),
        [0.0, 0.0]
    );
    if device.supports_dtype(FloatDType::F16) {
        let opts = TensorCreationOptions::new(device.clone()).with_dtype(DType::F16);
        let v = values(5000, 9, 100.0);
        let halves: Vec<burn::tensor::f16> =
            v.iter().map(|&x| burn::tensor::f16::from_f32(x)).collect();
        let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        let t = Tensor::<1>::from_data(TensorData::new(halves, [5000]), opts);
        let got: f32 = multi_tensor_sum_of_squares(&[t]).unwrap().into_scalar();
        let want = exact(&widened);
        // Accumulated in f32 like the f32 inputs (squares of 100 would overflow f16).
        assert!(
            (f64::from(got) - want).abs() <= 1e-5 * want,
            "{what} f16: {got} vs {want}"
        );
    } else {
        eprintln!("{what}: no f16 on this device, f16 inputs not tested");
    }
}

#[test]
fn reference_path_matches_exact_sums_on_flex() {
    check(&common::flex(), "flex");
}

#[test]
fn bad_inputs_are_refused_before_any_launch() {
    let device = common::flex();
    let e = multi_tensor_sum_of_squares(&[]).unwrap_err();
    assert!(matches!(e, KernelError::Argument(_)), "{e}");
    let e = segment_sum_of_squares(tensor(&device, &[1.0, 2.0]), &[1, 2]).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
}

#[cfg(feature = "cube")]
#[test]
fn kernels_match_exact_sums_on_cube() {
    let device = common::cube_device("norm");
    check(&device, "cube");
    let other = tensor(&common::flex(), &[1.0]);
    let here = tensor(&device, &[1.0]);
    let e = multi_tensor_sum_of_squares(&[here, other]).unwrap_err();
    assert!(matches!(e, KernelError::Argument(_)), "{e}");
}
