//! SwiGLU against exact f64 host values and against its reference composed of Burn ops
//! (forward, and both inputs' gradients through Burn's autodiff of that composition, in f32
//! on the inputs as stored). Shapes with one element, sizes that are not multiples of 16 or
//! of a cube, no elements, more than one rayon task (70 × 300), and 3-d and 4-d inputs.

use crate::common::{relative, tensor, to_vec, values};
use burn::backend::Dispatch;
use burn::tensor::activation::silu;
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions};
use burn_megatron_kernels::{KernelError, reference_swiglu, swiglu};

const SHAPES: [[usize; 2]; 6] = [[1, 1], [3, 5], [37, 33], [0, 4], [4, 1000], [70, 300]];

/// `(out, d_gate, d_up)` of `f`, the gradients those of `Σ out·dy` through `.backward()`.
fn run<const D: usize>(
    gate: Tensor<D>,
    up: Tensor<D>,
    dy: Tensor<D>,
    f: impl FnOnce(Tensor<D>, Tensor<D>) -> Tensor<D>,
) -> [Vec<f32>; 3] {
    let (gate, up) = (gate.require_grad(), up.require_grad());
    let out = f(gate.clone(), up.clone());
    let grads = (out.clone() * dy).sum().backward();
    let d_gate = Tensor::<D>::from_inner(gate.grad(&grads).expect("gate is tracked"));
    let d_up = Tensor::<D>::from_inner(up.grad(&grads).expect("up is tracked"));
    [to_vec(out.detach()), to_vec(d_gate), to_vec(d_up)]
}

/// `(silu(g)·u, dy·u·σ(g)·(1 + g·(1 − σ(g))), dy·silu(g))` in f64 on the host.
fn exact(g: &[f32], u: &[f32], dy: &[f32]) -> [Vec<f32>; 3] {
    let mut out: [Vec<f32>; 3] = Default::default();
    for ((&g, &u), &dy) in g.iter().zip(u).zip(dy) {
        let (g, u, dy) = (f64::from(g), f64::from(u), f64::from(dy));
        let s = 1.0 / (1.0 + (-g).exp());
        out[0].push((g * s * u) as f32);
        out[1].push((dy * u * s * (1.0 + g * (1.0 - s))) as f32);
        out[2].push((dy * g * s) as f32);
    }
    out
}

fn fused<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    swiglu(gate, up).expect("valid inputs")
}

fn reference<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(reference_swiglu::<Dispatch>(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// The op on `dev` with inputs of dtype `dt` and magnitude `scale`: relative errors of
/// `[out, d_gate, d_up]` against exact values, then against the f32 reference.
fn errors<const D: usize>(dev: &Device, dims: [usize; D], dt: DType, scale: f32) -> [f32; 6] {
    let len: usize = dims.iter().product();
    let seed = len as u64 * 3;
    let (gate, gs) = tensor(dev, values(len, seed, scale), dims, dt);
    let (up, us) = tensor(dev, values(len, seed + 1, scale), dims, dt);
    let (dy, dys) = tensor(dev, values(len, seed + 2, 1.0), dims, dt);
    let got = run(gate, up, dy, fused);
    let ex = exact(&gs, &us, &dys);
    if len == 0 {
        // Burn's own unary kernels panic on empty Cube tensors (0.22.1): no composition.
        assert!(got.iter().all(Vec::is_empty), "{got:?}");
        return [0.0; 6];
    }
    let (gr, _) = tensor(dev, gs, dims, DType::F32);
    let (ur, _) = tensor(dev, us, dims, DType::F32);
    let (dyr, _) = tensor(dev, dys, dims, DType::F32);
    let want = run(gr, ur, dyr, reference);
    std::array::from_fn(|i| {
        let want = if i < 3 { &ex[i] } else { &want[i - 3] };
        relative(&got[i % 3], want)
    })
}

fn check(dev: &Device, what: &str, dt: DType) {
    let tol = match dt {
        // A few f32 roundings and a ~2-ulp exp.
        DType::F32 => 1e-6,
        // One rounding of an f32-accurate value: 2⁻⁸ (bf16), 2⁻¹¹ (f16) relative.
        DType::BF16 => 4e-3,
        _ => 5e-4,
    };
    let mut worst = [0.0f32; 6];
    for scale in [3.0, 30.0] {
        let mut record = |shape: &str, e: [f32; 6]| {
            for (w, e) in worst.iter_mut().zip(e) {
                *w = w.max(e);
            }
            assert!(
                e.iter().all(|&e| e <= tol),
                "{what} {dt:?} {shape} ×{scale}: relative errors [out, d_gate, d_up] vs exact, \
                 then vs the reference: {e:?} > {tol}"
            );
        };
        for dims in SHAPES {
            record(&format!("{dims:?}"), errors(dev, dims, dt, scale));
        }
        record("[2, 3, 17]", errors(dev, [2, 3, 17], dt, scale));
        record("[2, 3, 4, 40]", errors(dev, [2, 3, 4, 40], dt, scale));
    }
    eprintln!(
        "swiglu {what} {dt:?}: worst relative [out, d_gate, d_up] vs exact {:?}, vs reference {:?}",
        &worst[..3],
        &worst[3..]
    );
}

#[test]
fn swiglu_flex_matches_exact_values_and_the_reference() {
    for dt in [DType::F32, DType::BF16] {
        check(&crate::common::flex(), "flex", dt);
    }
}

/// The model's composition, `silu(gate) · up` in Burn's ops, gives the same values and
/// gradients in f32.
#[test]
fn swiglu_flex_matches_burns_silu_times_up() {
    let dev = crate::common::flex();
    let dims = [3, 7, 45];
    let len = 3 * 7 * 45;
    let (gate, _) = tensor(&dev, values(len, 1, 4.0), dims, DType::F32);
    let (up, _) = tensor(&dev, values(len, 2, 4.0), dims, DType::F32);
    let (dy, _) = tensor(&dev, values(len, 3, 1.0), dims, DType::F32);
    let got = run(gate.clone(), up.clone(), dy.clone(), fused);
    let want = run(gate, up, dy, |g, u| silu(g) * u);
    for (what, (a, b)) in ["out", "d_gate", "d_up"].iter().zip(got.iter().zip(&want)) {
        let e = relative(a, b);
        assert!(e <= 1e-6, "{what}: relative error {e}");
    }
}

#[cfg(feature = "cube")]
#[test]
fn swiglu_kernels_match_exact_values_and_the_reference_on_cube() {
    let dev = crate::common::cube_device("swiglu");
    check(&dev, "cube", DType::F32);
    if dev.supports_dtype(DType::F16) {
        check(&dev, "cube", DType::F16);
    } else {
        eprintln!(
            "\n!!! the Cube device has no f16: f16 SwiGLU NOT tested on the Cube device !!!\n"
        );
    }
}

#[test]
fn swiglu_refuses_bad_inputs() {
    let dev = crate::common::flex();
    let gate = Tensor::<2>::zeros([4, 6], &dev);
    let r = swiglu(gate.clone(), Tensor::<2>::zeros([4, 5], &dev));
    assert!(matches!(r, Err(KernelError::Shape(_))));
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(DType::BF16);
    let r = swiglu(gate.clone(), Tensor::<2>::zeros([4, 6], options));
    assert!(matches!(r, Err(KernelError::Argument(_))));
    assert!(swiglu(gate.clone(), gate).is_ok());
}
