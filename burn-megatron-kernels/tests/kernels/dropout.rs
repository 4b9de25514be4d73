//! Plain dropout (`dropout`): the forward is exactly `keep ? x / (1 − p) : 0` with the host
//! mask of `dropout_keep`, the gradient exactly the same dropout of the incoming gradient, on
//! Flex (the reference path) and on the Cube kernel; bad arguments are errors.

use crate::common;

use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron_kernels::{KernelError, dropout, dropout_keep};
use common::{to_vec, values};

/// `keep ? v · (1 / (1 − p)) : 0`, in the f32 operations every backend uses.
fn expected(v: &[f32], prob: f32, seed: u64) -> Vec<f32> {
    let scale = 1.0f32 / (1.0 - prob);
    v.iter()
        .enumerate()
        .map(|(i, &v)| {
            if prob == 0.0 {
                v
            } else if dropout_keep(seed, i as u32, prob) {
                v * scale
            } else {
                0.0
            }
        })
        .collect()
}

fn check<const D: usize>(device: &Device, what: &str, shape: [usize; D]) {
    let n = shape.iter().product();
    for (k, prob) in [0.0f32, 0.1, 0.5, 0.9].into_iter().enumerate() {
        let seed = 0x5EED_0000_0000_0001 ^ (k as u64 * 7919);
        let x_values = values(n, k as u64 + 1, 1e4);
        let w_values = values(n, k as u64 + 100, 1.0);
        let x =
            Tensor::<D>::from_data(TensorData::new(x_values.clone(), shape), device).require_grad();
        let w = Tensor::<D>::from_data(TensorData::new(w_values.clone(), shape), device);
        let y = dropout(x.clone(), prob, seed).unwrap();
        let at = format!("{what} {shape:?} p {prob}");
        assert_eq!(
            to_vec(y.clone()),
            expected(&x_values, prob, seed),
            "{at}: forward"
        );
        assert_eq!(
            to_vec(dropout(x.clone(), prob, seed).unwrap()),
            to_vec(y.clone()),
            "{at}: the same seed gives the same mask"
        );
        if n > 0 {
            let grads = (y * w).sum().backward();
            let gx = x.grad(&grads).expect("x takes part in the loss");
            assert_eq!(
                to_vec(gx),
                expected(&w_values, prob, seed),
                "{at}: gradient"
            );
        }
    }
}

fn check_all(device: &Device, what: &str) {
    check(device, what, [0]);
    check(device, what, [7]);
    check(device, what, [3, 1000]);
    check(device, what, [2, 3, 5, 7]);
    // Another seed, another mask.
    let x = Tensor::<1>::ones([256], device);
    let (a, b) = (
        dropout(x.clone(), 0.5, 1).unwrap(),
        dropout(x, 0.5, 2).unwrap(),
    );
    assert_ne!(to_vec(a), to_vec(b), "{what}: seeds 1 and 2");
}

#[test]
fn reference_is_exact_on_flex() {
    check_all(&common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_is_exact_on_cube() {
    let device = common::cube_device("kernel_is_exact_on_cube");
    check_all(&device, "cube");
}

#[test]
fn bad_probabilities_are_refused() {
    let x = Tensor::<1>::ones([4], &Device::flex());
    for prob in [1.0, -0.1, f32::NAN] {
        assert!(
            matches!(dropout(x.clone(), prob, 0), Err(KernelError::Argument(_))),
            "p {prob}"
        );
    }
}

/// Flex's native loops (dropout, and bias + dropout + residual) give the reference's bits,
/// over several chunks of the parallel split, with and without bias.
#[test]
fn flex_native_loops_equal_the_reference_bit_for_bit() {
    use burn::backend::Dispatch;
    use burn_megatron_kernels::{bias_dropout_add, reference_bias_dropout_add, reference_dropout};
    let device = Device::flex();
    let shape = [3, 70_001];
    let n = 3 * 70_001;
    let t = |seed| Tensor::<2>::from_data(TensorData::new(values(n, seed, 10.0), shape), &device);
    let bias = Tensor::<1>::from_data(TensorData::new(values(70_001, 9, 1.0), [70_001]), &device);
    for (prob, seed) in [(0.0f32, 3u64), (0.1, 0xABCD_EF01_2345), (0.7, u64::MAX)] {
        let reference = Tensor::<2>::from_dispatch(reference_dropout::<Dispatch>(
            t(1).into_dispatch(),
            prob,
            seed,
            burn_megatron_kernels::MaskWindow::WHOLE,
        ));
        assert_eq!(
            to_vec(dropout(t(1), prob, seed).unwrap()),
            to_vec(reference),
            "dropout p {prob}"
        );
        for with_bias in [false, true] {
            let b = if with_bias {
                bias.clone()
            } else {
                t(1).reshape([-1]).narrow(0, 0, 70_001)
            };
            let reference = Tensor::<2>::from_dispatch(reference_bias_dropout_add::<Dispatch>(
                t(1).into_dispatch(),
                b.clone().into_dispatch(),
                with_bias,
                t(2).into_dispatch(),
                prob,
                seed,
            ));
            let native = bias_dropout_add(t(1), with_bias.then_some(b), t(2), prob, seed).unwrap();
            assert_eq!(
                to_vec(native),
                to_vec(reference),
                "bias_dropout_add p {prob} bias {with_bias}"
            );
        }
    }
}
