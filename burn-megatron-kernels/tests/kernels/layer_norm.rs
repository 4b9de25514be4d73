//! LayerNorm against its reference composed of Burn ops (forward, and the gradients of `x`,
//! `gamma` and `beta` through Burn's autodiff of that composition, in f32 on the inputs as
//! stored) and, forward, against Burn's own `nn::LayerNorm` in f32, with and without a
//! shift. Rows carry a mean far from zero (a one-pass variance would cancel) and
//! five scales. Shapes as the RMSNorm tests': one row, blocks of the backward that do not
//! fill, widths that are not multiples of 16, no rows, 3-d and 4-d inputs.

use crate::common::{Worst, relative, tensor, to_vec, values};
use burn::backend::Dispatch;
use burn::module::Param;
use burn::nn::LayerNormConfig;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::{KernelError, layer_norm, reference_layer_norm_forward};

const EPS: f64 = 1e-5;

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

/// `[y, dx, dgamma, dbeta]` of `norm`, the gradients those of `Σ y·dy` (`dbeta` empty
/// without a shift).
fn run<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    dy: Tensor<D>,
    norm: impl FnOnce(Tensor<D>, Tensor<1>, Option<Tensor<1>>) -> Tensor<D>,
) -> [Vec<f32>; 4] {
    let (x, gamma) = (x.require_grad(), gamma.require_grad());
    let beta = beta.map(Tensor::require_grad);
    let y = norm(x.clone(), gamma.clone(), beta.clone());
    let grads = (y.clone() * dy).sum().backward();
    let grad = |t: &Tensor<1>| to_vec(Tensor::<1>::from_inner(t.grad(&grads).expect("tracked")));
    let dx = Tensor::<D>::from_inner(x.grad(&grads).expect("x is tracked"));
    let dbeta = beta.as_ref().map(grad).unwrap_or_default();
    [to_vec(y.detach()), to_vec(dx), grad(&gamma), dbeta]
}

fn fused<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, beta: Option<Tensor<1>>) -> Tensor<D> {
    layer_norm(x, gamma, beta, EPS).expect("valid inputs")
}

fn reference<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, beta: Option<Tensor<1>>) -> Tensor<D> {
    let beta = beta.unwrap_or_else(|| Tensor::zeros_like(&gamma).detach());
    let (y, _mean, _rstd) = reference_layer_norm_forward::<Dispatch>(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        EPS,
    );
    Tensor::from_dispatch(y)
}

/// The op on `dev` with inputs of dtype `dt`: relative errors of `[y, dx, dgamma, dbeta]`
/// against the f32 reference and of `y` against Burn's `LayerNorm` in `dt`.
fn errors<const D: usize>(dev: &Device, dims: [usize; D], dt: DType, shift: bool) -> [f32; 5] {
    let n = dims[D - 1];
    let len: usize = dims.iter().product();
    let seed = (len * 7 + n) as u64;
    let xv = values(len, seed, 2.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * (1 + i / n % 5) as f32 + 30.0)
        .collect();
    let (x, xs) = tensor(dev, xv, dims, dt);
    let (gamma, gs) = tensor(dev, values(n, seed + 1, 1.5), [n], dt);
    let (beta, bs) = tensor(dev, values(n, seed + 3, 0.5), [n], dt);
    let (dy, dys) = tensor(dev, values(len, seed + 2, 1.0), dims, dt);
    let beta = shift.then_some(beta);
    let got = run(x.clone(), gamma.clone(), beta.clone(), dy, fused);
    assert_eq!(fused(x.clone(), gamma.clone(), beta.clone()).dtype(), dt);
    if len == 0 {
        assert!(got[0].is_empty() && got[1].is_empty(), "{got:?}");
        assert_eq!(got[2], vec![0.0; n], "no rows, no gamma gradient");
        return [0.0; 5];
    }

    let (xr, _) = tensor(dev, xs, dims, DType::F32);
    let (gr, _) = tensor(dev, gs, [n], DType::F32);
    let br = shift.then(|| tensor(dev, bs, [n], DType::F32).0);
    let (dyr, _) = tensor(dev, dys, dims, DType::F32);
    let want = run(xr, gr, br, dyr, reference);

    let mut burn_norm = LayerNormConfig::new(n)
        .with_epsilon(EPS)
        .with_bias(shift)
        .init(dev);
    burn_norm.gamma = Param::from_tensor(gamma);
    burn_norm.beta = beta.map(Param::from_tensor);
    let burn_y = to_vec(burn_norm.forward(x));
    [
        relative(&got[0], &want[0]),
        relative(&got[1], &want[1]),
        relative(&got[2], &want[2]),
        relative(&got[3], &want[3]),
        relative(&got[0], &burn_y),
    ]
}

/// Tolerances of `[y, dx, dgamma, dbeta, y vs Burn]`, relative to the largest value.
fn tolerances(dt: DType) -> [f32; 5] {
    match dt {
        // f32 sums in another order (16 lanes, blocks of rows vs Flex's reductions), and
        // the reference's gradient is Burn's autodiff of the composition (other roundings).
        // The rows sit at 30, where one ulp is 1.9e-6: either side's row mean is off by a
        // few ulps, which `x − μ` passes on to `y` relative to the row's spread (≥ 1).
        // `dbeta` sums up to 5000 rows in blocks (measured 1.2e-6).
        DType::F32 => [5e-6, 5e-6, 5e-6, 2e-6, 5e-6],
        // One rounding to bf16 (2⁻⁸ relative) of f32 values. Not held to Burn's bf16
        // LayerNorm: it computes the statistics in bf16, where an ulp at 30 is 0.125 (it
        // differs from the f32 reference by 2.2 %, ours by 0.29 %).
        DType::BF16 => [4e-3, 4e-3, 4e-3, 4e-3, f32::INFINITY],
        _ => [1e-3, 1e-3, 1e-3, 1e-3, 2e-3],
    }
}

fn check(dev: &Device, what: &str, dt: DType) {
    let names = "[y, dx, dgamma, dbeta, y vs Burn]";
    let mut worst = Worst::new(format!("layer_norm {what} {dt:?}"), names, tolerances(dt));
    for shift in [true, false] {
        for dims in SHAPES {
            worst.record(&format!("{dims:?} {shift}"), errors(dev, dims, dt, shift));
        }
        worst.record("[2, 3, 17]", errors(dev, [2, 3, 17], dt, shift));
        worst.record("[2, 3, 4, 40]", errors(dev, [2, 3, 4, 40], dt, shift));
    }
    worst.report();
}

#[test]
fn layer_norm_flex_matches_the_reference_and_burns_layer_norm() {
    for dt in [DType::F32, DType::BF16] {
        check(&crate::common::flex(), "flex", dt);
    }
}

#[cfg(feature = "cube")]
#[test]
fn layer_norm_kernels_match_the_reference_on_cube() {
    let dev = crate::common::cube_device("layer_norm");
    check(&dev, "cube", DType::F32);
    if dev.supports_dtype(DType::F16) {
        check(&dev, "cube", DType::F16);
    } else {
        eprintln!(
            "\n!!! the Cube device has no f16: f16 LayerNorm NOT tested on the Cube device !!!\n"
        );
    }
}

/// `dgamma` and `dbeta` are reduced over fixed blocks of rows added in block order: the
/// same bits on one thread as on several.
#[test]
fn layer_norm_flex_backward_does_not_depend_on_the_thread_count() {
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
            let (beta, _) = tensor(&dev, values(16, 8, 1.0), [16], DType::F32);
            let (dy, _) = tensor(&dev, values(5000 * 16, 7, 1.0), dims, DType::F32);
            run(x, gamma, Some(beta), dy, fused)
                .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        })
    };
    let (one, four) = (on(1), on(4));
    for (what, (a, b)) in ["y", "dx", "dgamma", "dbeta"]
        .iter()
        .zip(one.iter().zip(&four))
    {
        let differ = a.iter().zip(b).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "{what}: {differ} values differ between 1 and 4 threads"
        );
    }
}

#[test]
fn layer_norm_refuses_bad_inputs() {
    let dev = crate::common::flex();
    let x = Tensor::<2>::zeros([4, 6], &dev);
    let shape = |r: Result<Tensor<2>, KernelError>| matches!(r, Err(KernelError::Shape(_)));
    let ones = |n| Tensor::<1>::ones([n], &dev);
    assert!(shape(layer_norm(x.clone(), ones(5), None, EPS)));
    assert!(shape(layer_norm(x.clone(), ones(6), Some(ones(5)), EPS)));
    assert!(shape(layer_norm(
        Tensor::<2>::zeros([4, 0], &dev),
        ones(0),
        None,
        EPS
    )));
    for eps in [-1e-5, f64::NAN, f64::INFINITY] {
        let r = layer_norm(x.clone(), ones(6), None, eps);
        assert!(matches!(r, Err(KernelError::Argument(_))), "ε {eps}");
    }
    assert!(layer_norm(x, ones(6), Some(ones(6)), 0.0).is_ok());
}
