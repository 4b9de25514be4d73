//! RMSNorm against its reference composed of Burn ops (forward, and `x`'s and `gamma`'s
//! gradients through Burn's autodiff of that composition, in f32 on the inputs as stored)
//! and, forward, against Burn's own `nn::RmsNorm` in the input's dtype. (A width of 1 is
//! left out: there `dx` is all cancellation, `r·dy·γ·ε/(x² + ε)`.) Shapes with one row,
//! rows that do not fill the backward's blocks, widths that are not multiples of 16, no
//! rows, and 3-d and 4-d inputs.

use crate::common::{Worst, relative, tensor, to_vec, values};
use burn::backend::Dispatch;
use burn::module::Param;
use burn::nn::RmsNormConfig;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::{KernelError, reference_rms_norm_forward, rms_norm};

const EPS: f64 = 1e-5;

/// [rows, n]: one row; odd sizes; 1100 rows of 33 (Flex's backward: blocks of 497 rows,
/// the last one short); 300 of 100 (blocks of 164); 5000 of 16 (5 blocks, the last short);
/// a wide row; no rows.
const SHAPES: [[usize; 2]; 8] = [
    [1, 7],
    [3, 5],
    [37, 33],
    [1100, 33],
    [300, 100],
    [5000, 16],
    [4, 1000],
    [0, 8],
];

/// `(y, dx, dgamma)` of `norm`, the gradients those of `Σ y·dy` through `.backward()`.
fn run<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    dy: Tensor<D>,
    norm: impl FnOnce(Tensor<D>, Tensor<1>) -> Tensor<D>,
) -> [Vec<f32>; 3] {
    let (x, gamma) = (x.require_grad(), gamma.require_grad());
    let y = norm(x.clone(), gamma.clone());
    let grads = (y.clone() * dy).sum().backward();
    let dx = Tensor::<D>::from_inner(x.grad(&grads).expect("x is tracked"));
    let dgamma = Tensor::<1>::from_inner(gamma.grad(&grads).expect("gamma is tracked"));
    [to_vec(y.detach()), to_vec(dx), to_vec(dgamma)]
}

fn fused<const D: usize>(x: Tensor<D>, gamma: Tensor<1>) -> Tensor<D> {
    rms_norm(x, gamma, EPS).expect("valid inputs")
}

fn reference<const D: usize>(x: Tensor<D>, gamma: Tensor<1>) -> Tensor<D> {
    let (y, _inv_rms) =
        reference_rms_norm_forward::<Dispatch>(x.into_dispatch(), gamma.into_dispatch(), EPS);
    Tensor::from_dispatch(y)
}

/// The op on `dev` with inputs of dtype `dt`: relative errors of `[y, dx, dgamma]` against
/// the f32 reference and of `y` against Burn's `RmsNorm` in `dt`.
fn errors<const D: usize>(dev: &Device, dims: [usize; D], dt: DType) -> [f32; 4] {
    let n = dims[D - 1];
    let len: usize = dims.iter().product();
    let seed = (len * 7 + n) as u64;
    // Rows of five different scales, so that each row's statistics matter.
    let xv = values(len, seed, 2.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * (1 + i / n % 5) as f32)
        .collect();
    let (x, xs) = tensor(dev, xv, dims, dt);
    let (gamma, gs) = tensor(dev, values(n, seed + 1, 1.5), [n], dt);
    let (dy, dys) = tensor(dev, values(len, seed + 2, 1.0), dims, dt);
    let got = run(x.clone(), gamma.clone(), dy, fused);
    assert_eq!(rms_norm(x.clone(), gamma.clone(), EPS).unwrap().dtype(), dt);
    if len == 0 {
        // Burn's own unary kernels panic on empty Cube tensors (0.22.1): no composition.
        assert!(got[0].is_empty() && got[1].is_empty(), "{got:?}");
        assert_eq!(got[2], vec![0.0; n], "no rows, no gamma gradient");
        return [0.0; 4];
    }

    let (xr, _) = tensor(dev, xs, dims, DType::F32);
    let (gr, _) = tensor(dev, gs, [n], DType::F32);
    let (dyr, _) = tensor(dev, dys, dims, DType::F32);
    let want = run(xr, gr, dyr, reference);

    let mut burn_norm = RmsNormConfig::new(n).with_epsilon(EPS).init(dev);
    burn_norm.gamma = Param::from_tensor(gamma);
    let burn_y = to_vec(burn_norm.forward(x));
    [
        relative(&got[0], &want[0]),
        relative(&got[1], &want[1]),
        relative(&got[2], &want[2]),
        relative(&got[0], &burn_y),
    ]
}

/// Tolerances of `[y, dx, dgamma, y vs Burn]`, relative to the largest value.
fn tolerances(dt: DType) -> [f32; 4] {
    match dt {
        // f32 sums in another order (16 lanes, blocks of rows vs Flex's reductions); the
        // reference's gradient is Burn's autodiff of the composition (other roundings);
        // `dgamma` sums up to 5000 rows (measured ≤ 9.4e-7).
        DType::F32 => [1e-6, 1e-6, 2e-6, 1e-6],
        // One rounding to bf16 (2⁻⁸ relative) of f32 values; `y` is rounded three times as
        // Burn's op chain rounds it, and a sum of squares in another order can move the
        // rounded `rms` by one ulp, as it can move Burn's.
        DType::BF16 => [1.2e-2, 4e-3, 4e-3, 8e-3],
        // The kernels' f16 arithmetic (2⁻¹¹ relative) for `y`, one rounding for the rest.
        _ => [2e-3, 1e-3, 1e-3, 2e-3],
    }
}

fn check(dev: &Device, what: &str, dt: DType) {
    let names = "[y, dx, dgamma, y vs Burn]";
    let mut worst = Worst::new(format!("rms_norm {what} {dt:?}"), names, tolerances(dt));
    for dims in SHAPES {
        worst.record(&format!("{dims:?}"), errors(dev, dims, dt));
    }
    worst.record("[2, 3, 17]", errors(dev, [2, 3, 17], dt));
    worst.record("[2, 3, 4, 40]", errors(dev, [2, 3, 4, 40], dt));
    worst.report();
}

#[test]
fn rms_norm_flex_matches_the_reference_and_burns_rms_norm() {
    for dt in [DType::F32, DType::BF16] {
        check(&crate::common::flex(), "flex", dt);
    }
}

#[cfg(feature = "cube")]
#[test]
fn rms_norm_kernels_match_the_reference_on_cube() {
    let dev = crate::common::cube_device("rms_norm");
    check(&dev, "cube", DType::F32);
    if dev.supports_dtype(DType::F16) {
        check(&dev, "cube", DType::F16);
    } else {
        eprintln!(
            "\n!!! the Cube device has no f16: f16 RMSNorm NOT tested on the Cube device !!!\n"
        );
    }
}

/// `dgamma` is reduced over fixed blocks of rows added in block order: the same bits on one
/// thread as on several.
#[test]
fn rms_norm_flex_backward_does_not_depend_on_the_thread_count() {
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        pool.install(|| {
            let dev = crate::common::flex();
            let dims = [5000, 16];
            let (x, _) = tensor(&dev, values(5000 * 16, 5, 2.0), dims, DType::F32);
            let (gamma, _) = tensor(&dev, values(16, 6, 1.0), [16], DType::F32);
            let (dy, _) = tensor(&dev, values(5000 * 16, 7, 1.0), dims, DType::F32);
            run(x, gamma, dy, fused).map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        })
    };
    let (one, four) = (on(1), on(4));
    for (what, (a, b)) in ["y", "dx", "dgamma"].iter().zip(one.iter().zip(&four)) {
        let differ = a.iter().zip(b).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "{what}: {differ} values differ between 1 and 4 threads"
        );
    }
}

#[test]
fn rms_norm_refuses_bad_inputs() {
    let dev = crate::common::flex();
    let x = Tensor::<2>::zeros([4, 6], &dev);
    let shape = |r: Result<Tensor<2>, KernelError>| matches!(r, Err(KernelError::Shape(_)));
    let ones = |n| Tensor::<1>::ones([n], &dev);
    assert!(shape(rms_norm(x.clone(), ones(5), EPS)));
    assert!(shape(rms_norm(
        Tensor::<2>::zeros([4, 0], &dev),
        ones(0),
        EPS
    )));
    for eps in [-1e-5, f64::NAN, f64::INFINITY] {
        let r = rms_norm(x.clone(), ones(6), eps);
        assert!(matches!(r, Err(KernelError::Argument(_))), "ε {eps}");
    }
    assert!(rms_norm(x, ones(6), 0.0).is_ok());
}
