//! The linear layers' GEMMs on the Cube device against exact products: f32 as IEEE f32 (TF32
//! would round `1 + 2⁻²⁰` to 1), f16 and bf16 within their output's rounding, for every
//! layout of the operands (contiguous and transposed views), forward and both gradients.
//! On CUDA they are cuBLASLt's, and the tests fail unless cuBLASLt ran them.

use crate::common::{self, to_vec, values};
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{batched_matmul, linear};

fn tensor(v: Vec<f32>, shape: [usize; 2], dev: &Device, dt: DType) -> Tensor<2> {
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    Tensor::from_data(TensorData::new(v, shape), options)
}

/// `a·b` exactly (`a` `[m, k]`, `b` `[k, n]`), and each element's `Σ|a·b|`.
fn exact(a: &[f32], b: &[f32], [m, k, n]: [usize; 3]) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut size = vec![0.0; m * n];
    for r in 0..m {
        for c in 0..n {
            for j in 0..k {
                let p = f64::from(a[r * k + j]) * f64::from(b[j * n + c]);
                out[r * n + c] += p;
                size[r * n + c] += p.abs();
            }
        }
    }
    (out, size)
}

fn transpose(v: &[f32], [r, c]: [usize; 2]) -> Vec<f32> {
    (0..r * c).map(|i| v[(i % r) * c + i / r]).collect()
}

/// Worst `|got − exact| / Σ|terms|` over the elements.
fn worst(got: &[f32], (exact, size): &(Vec<f64>, Vec<f64>)) -> f64 {
    got.iter()
        .zip(exact)
        .zip(size)
        .map(|((&g, &e), &s)| (f64::from(g) - e).abs() / s.max(1e-30))
        .fold(0.0, f64::max)
}

/// The stored values of `x` `[t, i]`, `w` `[i, o]` and `g` `[t, o]` in `dt` for `shape`.
fn inputs(dev: &Device, dt: DType, [t, i, o]: [usize; 3]) -> [Tensor<2>; 3] {
    let seed = (t * 10_000 + i * 100 + o) as u64;
    [
        tensor(values(t * i, seed, 1.0), [t, i], dev, dt),
        tensor(values(i * o, seed + 1, 0.5), [i, o], dev, dt),
        tensor(values(t * o, seed + 2, 1.0), [t, o], dev, dt),
    ]
}

/// `y = x·w` and its gradients `(dx, dw)` under `Σ y·g`, `x` and `w` given as themselves or
/// as transposed views of transposed copies (the same matrices, read column-major).
fn products([x, w, g]: [Tensor<2>; 3], (x_t, w_t): (bool, bool)) -> [Vec<f32>; 3] {
    let [t, i] = x.dims();
    let o = w.dims()[1];
    let leaf = |m: Tensor<2>, on: bool| {
        let m = if on {
            let ([r, c], dt, dev) = (m.dims(), m.dtype(), m.device());
            tensor(transpose(&to_vec(m), [r, c]), [c, r], &dev, dt)
        } else {
            m
        };
        m.require_grad()
    };
    let (x_leaf, w_leaf) = (leaf(x, x_t), leaf(w, w_t));
    let xs = if x_t {
        x_leaf.clone().transpose()
    } else {
        x_leaf.clone()
    };
    let ws = if w_t {
        w_leaf.clone().transpose()
    } else {
        w_leaf.clone()
    };
    let y = linear(xs, ws).unwrap();
    let grads = (y.clone() * g).sum().backward();
    let mut dx = to_vec(x_leaf.grad(&grads).unwrap());
    let mut dw = to_vec(w_leaf.grad(&grads).unwrap());
    if x_t {
        dx = transpose(&dx, [i, t]);
    }
    if w_t {
        dw = transpose(&dw, [o, i]);
    }
    [to_vec(y), dx, dw]
}

/// The bound on each relative error: f32 sums of ≤ 300 products, well inside 2e-5 (TF32's
/// 10-bit inputs are ~1e-3 per product); half outputs rounded once (2⁻⁹ for bf16, 2⁻¹¹ for
/// f16), with room for the sum.
fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::BF16 => 4e-3,
        DType::F16 => 1e-3,
        _ => 2e-5,
    }
}

/// Up to 300 products per sum; the step's shapes run in the GPU benchmark.
const SHAPES: [[usize; 3]; 4] = [[1, 1, 1], [37, 33, 70], [130, 200, 96], [5, 300, 2]];

fn check(dev: &Device, what: &str) {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        if !dev.supports_dtype(dt) {
            eprintln!("\n!!! {what} has no {dt:?}: NOT tested there !!!\n");
            continue;
        }
        for shape in SHAPES {
            let [t, i, o] = shape;
            let data = inputs(dev, dt, shape);
            let [xv, wv, gv] = data.clone().map(to_vec);
            let want = [
                exact(&xv, &wv, [t, i, o]),
                exact(&gv, &transpose(&wv, [i, o]), [t, o, i]),
                exact(&transpose(&xv, [t, i]), &gv, [i, t, o]),
            ];
            for layout in [(false, false), (false, true), (true, false), (true, true)] {
                let got = products(data.clone(), layout);
                let e: Vec<f64> = got.iter().zip(&want).map(|(g, w)| worst(g, w)).collect();
                let tol = tolerance(dt);
                assert!(
                    e.iter().all(|&e| e <= tol),
                    "{what} {dt:?} {shape:?} transposed (x, w) {layout:?}: relative errors \
                     (y, dx, dw) {e:?} above {tol:e}"
                );
            }
        }
    }
}

/// `(1 + 2⁻²⁰)·1` plus 63 products of zero: exactly `1 + 2⁻²⁰` in f32 whatever the order of
/// the sum, 1 through TF32 (whose inputs keep 10 mantissa bits).
fn tf32_probe(dev: &Device) -> f32 {
    let mut x = vec![0.0; 64];
    x[0] = 1.0 + 2f32.powi(-20);
    let x = tensor(x, [1, 64], dev, DType::F32);
    let w = tensor(vec![1.0; 64], [64, 1], dev, DType::F32);
    to_vec(linear(x, w).unwrap())[0]
}

#[test]
fn gemms_match_exact_products_on_flex() {
    check(&common::flex(), "flex");
    assert_eq!(tf32_probe(&common::flex()), 1.0 + 2f32.powi(-20));
}

#[cfg(feature = "cube")]
#[test]
fn gemms_match_exact_products_on_cube() {
    let dev = common::cube_device("gemm");
    #[cfg(feature = "cuda")]
    let before = burn_megatron_kernels::cuda::gemm_stats();
    check(&dev, "cube");
    assert_eq!(
        tf32_probe(&dev),
        1.0 + 2f32.powi(-20),
        "f32 GEMMs must stay IEEE f32"
    );
    #[cfg(feature = "cuda")]
    if common::on_cuda() {
        common::assert_cublaslt_ran(&before, "GEMMs");
    }
}

/// `(c, da, db)` of `c = a·b` under `Σ c·g` for 4-d `a` `[2, 3, m, k]` and `b` `[2, 3, k, n]`
/// (given as a transposed view of `[2, 3, n, k]` when `b_t`), through `product`.
fn batched(
    dev: &Device,
    dt: DType,
    [m, k, n]: [usize; 3],
    b_t: bool,
    product: &dyn Fn(Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> [Vec<f32>; 3] {
    let opts = || TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    let make = |v: Vec<f32>, d: [usize; 4]| Tensor::<4>::from_data(TensorData::new(v, d), opts());
    let a = make(values(6 * m * k, 41, 1.0), [2, 3, m, k]).require_grad();
    let b = if b_t {
        make(values(6 * k * n, 42, 0.5), [2, 3, n, k]).require_grad()
    } else {
        make(values(6 * k * n, 42, 0.5), [2, 3, k, n]).require_grad()
    };
    let bs = if b_t {
        b.clone().swap_dims(2, 3)
    } else {
        b.clone()
    };
    let g = make(values(6 * m * n, 43, 1.0), [2, 3, m, n]);
    let c = product(a.clone(), bs);
    let grads = (c.clone() * g).sum().backward();
    [
        to_vec(c),
        to_vec(a.grad(&grads).unwrap()),
        to_vec(b.grad(&grads).unwrap()),
    ]
}

#[test]
fn batched_products_are_burns_matmul_bit_for_bit_on_flex() {
    let dev = common::flex();
    for b_t in [false, true] {
        for dt in [DType::F32, DType::BF16] {
            let ours = batched(&dev, dt, [5, 7, 4], b_t, &|a, b| batched_matmul(a, b));
            let burn = batched(&dev, dt, [5, 7, 4], b_t, &|a, b| a.matmul(b));
            assert_eq!(ours, burn, "{dt:?}, b transposed {b_t}");
        }
    }
}

/// Each of the six matrices of the batch against Flex's product, forward and gradients.
#[cfg(feature = "cube")]
#[test]
fn batched_products_match_flex_on_cube() {
    let dev = common::cube_device("batched gemm");
    #[cfg(feature = "cuda")]
    let before = burn_megatron_kernels::cuda::gemm_stats();
    let [m, k, n] = [5, 7, 4];
    for b_t in [false, true] {
        let got = batched(&dev, DType::F32, [m, k, n], b_t, &|a, b| {
            batched_matmul(a, b)
        });
        let want = batched(&common::flex(), DType::F32, [m, k, n], b_t, &|a, b| {
            a.matmul(b)
        });
        // Flex's f32 products of ≤ 7 terms, as the reference: within f32 roundings of Σ|terms|
        // (the values are at most 1 and 0.5, so Σ|terms| ≤ 7 · 0.5 · 1).
        for (part, (g, w)) in ["c", "da", "db"].iter().zip(got.iter().zip(&want)) {
            let diff = common::max_abs_diff(g, w);
            assert!(diff <= 1e-5, "{part}, b transposed {b_t}: max |Δ| {diff:e}");
        }
    }
    #[cfg(feature = "cuda")]
    if common::on_cuda() {
        let after = burn_megatron_kernels::cuda::gemm_stats();
        assert!(
            after.cublaslt >= before.cublaslt + 6 && after.fallbacks == before.fallbacks,
            "cuBLASLt ran {} batched GEMMs and failed {} (first: {:?})",
            after.cublaslt - before.cublaslt,
            after.fallbacks - before.fallbacks,
            after.first_failure
        );
    }
}
