//! Weight-gradient accumulation `main_grad + xᵀ·dy` against exact f64 host values and the
//! reference composition, on Flex (reference path) and, with a Cube feature (`wgpu` or `cuda`), cubek's
//! f32-output matmul on the Cube device; plus why the f32 accumulation matters for low-precision inputs.

use crate::common;

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{
    KernelError, accumulate_weight_grad, reference_accumulate_weight_grad,
};
use common::{max_abs_diff, to_vec, values};

/// Token counts (none, one, odd sizes) and layer sizes (one, not multiples of the usual
/// 16/32/64-wide matmul tiles, more than one tile).
const TOKENS: [usize; 4] = [0, 1, 37, 257];
const SIDES: [usize; 4] = [1, 3, 33, 100];

fn tensor(v: Vec<f32>, shape: [usize; 2], dev: &Device, dt: DType) -> Tensor<2> {
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    Tensor::from_data(TensorData::new(v, shape), options)
}

/// (exact main_grad + xᵀ·dy, Σ_t |x·dy| + |main_grad|) per element, in f64 from the values
/// as stored.
fn exact(g: &[f32], x: &[f32], dy: &[f32], shape: [usize; 3]) -> (Vec<f64>, Vec<f64>) {
    let [tokens, fan_in, fan_out] = shape;
    let (mut out, mut size) = (vec![], vec![]);
    for i in 0..fan_in {
        for j in 0..fan_out {
            let (mut s, mut a) = (
                f64::from(g[i * fan_out + j]),
                f64::from(g[i * fan_out + j]).abs(),
            );
            for t in 0..tokens {
                let p = f64::from(x[t * fan_in + i]) * f64::from(dy[t * fan_out + j]);
                s += p;
                a += p.abs();
            }
            out.push(s);
            size.push(a);
        }
    }
    (out, size)
}

/// Worst |Δ| / (Σ|x·dy| + |main_grad|) of the fused op against exact values and against the
/// reference on the same device, over every shape; panics past `tol`.
fn check(dev: &Device, what: &str, dt: DType, tol: f64) -> (f64, f64) {
    let (mut worst_exact, mut worst_ref) = (0.0f64, 0.0f64);
    for tokens in TOKENS {
        for fan_in in SIDES {
            for fan_out in SIDES {
                let seed = (tokens * 10_000 + fan_in * 100 + fan_out) as u64;
                let g = tensor(
                    values(fan_in * fan_out, seed, 2.0),
                    [fan_in, fan_out],
                    dev,
                    DType::F32,
                );
                let x = tensor(
                    values(tokens * fan_in, seed + 1, 1.0),
                    [tokens, fan_in],
                    dev,
                    dt,
                );
                let dy = tensor(
                    values(tokens * fan_out, seed + 2, 1.0),
                    [tokens, fan_out],
                    dev,
                    dt,
                );
                let (gv, xv, dyv) = (to_vec(g.clone()), to_vec(x.clone()), to_vec(dy.clone()));
                let (ex, size) = exact(&gv, &xv, &dyv, [tokens, fan_in, fan_out]);
                // main_grad is consumed: on Cube the kernel may update its buffer in place.
                let fused = accumulate_weight_grad(g, x.clone(), dy.clone()).unwrap();
                assert_eq!(fused.dtype(), DType::F32);
                let fused = to_vec(fused);
                let rel = |v: &[f32]| {
                    v.iter()
                        .zip(&ex)
                        .zip(&size)
                        .map(|((&f, &e), &s)| (f64::from(f) - e).abs() / s.max(1e-30))
                        .fold(0.0, f64::max)
                };
                let e = rel(&fused);
                // Burn's own kernels panic on empty Cube tensors: no composition when empty.
                let (r, device) = if tokens == 0 {
                    (0.0, 0.0)
                } else {
                    let g = tensor(gv.clone(), [fan_in, fan_out], dev, DType::F32);
                    let reference = reference_accumulate_weight_grad::<Dispatch>(
                        g.into_dispatch(),
                        x.into_dispatch(),
                        dy.into_dispatch(),
                    );
                    let reference = to_vec(Tensor::<2>::from_dispatch(reference));
                    let r = f64::from(max_abs_diff(&fused, &reference))
                        / size.iter().copied().fold(1e-30, f64::max);
                    (r, rel(&reference))
                };
                // Against exact values, no worse than the device's own matmul: CUDA's f32
                // matmul (cubek on tensor cores) rounds its inputs below f32, ~1e-5 relative.
                // Against the reference, the two errors at most (on CUDA the fused op is
                // cuBLASLt's, IEEE f32, and the reference cubek's).
                let bound = tol.max(device);
                assert!(
                    e <= bound && r <= tol + device,
                    "{what} {dt:?} tokens {tokens} [{fan_in}, {fan_out}]: vs exact {e:e} \
                     (bound {bound:e}) vs reference {r:e}"
                );
                (worst_exact, worst_ref) = (worst_exact.max(e), worst_ref.max(r));
            }
        }
    }
    eprintln!(
        "{what} {dt:?}: worst relative |Δ| vs exact {worst_exact:e}, vs reference {worst_ref:e}"
    );
    (worst_exact, worst_ref)
}

// The inputs are exact in f32 whatever their dtype (the exact values use them as stored),
// so every dtype gets the f32 tolerance: ≤ 257 products summed in f32, 16 at a time into a
// register; error ≲ √257 · 2⁻²⁴ relative to Σ|x·dy| typically, 2e-6 leaves room for the
// reference's other summation order.
const TOL: f64 = 2e-6;

#[test]
fn reference_path_matches_exact_values_on_flex() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        check(&common::flex(), "flex", dt, TOL);
    }
}

/// On CUDA the products go through cuBLASLt with the main gradient as its `C` (β = 1): bf16
/// inputs into an f32 main gradient is Megatron's `--gradient-accumulation-fusion` case.
#[cfg(feature = "cube")]
#[test]
fn kernel_matches_exact_values_and_the_reference_on_cube() {
    let dev = common::cube_device("grad_accum");
    #[cfg(feature = "cuda")]
    let before = burn_megatron_kernels::cuda::gemm_stats();
    check(&dev, "cube", DType::F32, TOL);
    for dt in [DType::F16, DType::BF16] {
        if dev.supports_dtype(dt) {
            check(&dev, "cube", dt, TOL);
        } else {
            eprintln!(
                "\n!!! the Cube device has no {dt:?}: {dt:?} inputs NOT tested on the Cube device !!!\n"
            );
        }
    }
    #[cfg(feature = "cuda")]
    if common::on_cuda() {
        common::assert_cublaslt_ran(&before, "accumulating GEMMs");
        // `check` hands over a main_grad nothing else holds: cuBLASLt's D is its C.
        let after = burn_megatron_kernels::cuda::gemm_stats();
        assert!(
            after.accumulated_in_place > before.accumulated_in_place,
            "no main gradient was accumulated in place"
        );
    }
}

/// A `main_grad` that another tensor still holds is not overwritten (the kernel copies it;
/// on CUDA cuBLASLt writes a new output instead of accumulating in place).
#[cfg(feature = "cube")]
#[test]
fn shared_main_grad_is_left_untouched_on_cube() {
    let dev = common::cube_device("grad_accum aliasing");
    let g = tensor(values(33 * 3, 5, 1.0), [33, 3], &dev, DType::F32);
    let before = to_vec(g.clone());
    let x = tensor(values(37 * 33, 6, 1.0), [37, 33], &dev, DType::F32);
    let dy = tensor(values(37 * 3, 7, 1.0), [37, 3], &dev, DType::F32);
    let out = to_vec(accumulate_weight_grad(g.clone(), x, dy).unwrap());
    assert_eq!(to_vec(g), before, "the shared main_grad changed");
    assert!(max_abs_diff(&out, &before) > 0.1, "nothing was accumulated");
}

/// Micro-batches of small bf16 products: accumulated in f32 (the fused op) they stay within
/// ~1e-6 of the exact sum; as bf16 weight gradients summed in bf16 (the unfused path in the
/// input dtype) they lose ~3 significant digits.
#[test]
fn f32_accumulation_beats_accumulating_in_bf16_on_flex() {
    let dev = common::flex();
    let (micro, tokens, fan_in, fan_out) = (8, 512, 4, 4);
    let mut main_grad = Tensor::<2>::zeros([fan_in, fan_out], &dev);
    let mut in_bf16 = tensor(
        vec![0.0; fan_in * fan_out],
        [fan_in, fan_out],
        &dev,
        DType::BF16,
    );
    let mut exact_sum = vec![0.0f64; fan_in * fan_out];
    for m in 0..micro {
        let x = tensor(
            values(tokens * fan_in, 40 + m, 1e-2),
            [tokens, fan_in],
            &dev,
            DType::BF16,
        );
        let dy = tensor(
            values(tokens * fan_out, 80 + m, 1e-2),
            [tokens, fan_out],
            &dev,
            DType::BF16,
        );
        let zeros = vec![0.0; fan_in * fan_out];
        let (e, _) = exact(
            &zeros,
            &to_vec(x.clone()),
            &to_vec(dy.clone()),
            [tokens, fan_in, fan_out],
        );
        exact_sum.iter_mut().zip(e).for_each(|(s, e)| *s += e);
        main_grad = accumulate_weight_grad(main_grad, x.clone(), dy.clone()).unwrap();
        in_bf16 = in_bf16 + x.transpose().matmul(dy);
    }
    let err = |v: Vec<f32>| {
        v.iter()
            .zip(&exact_sum)
            .map(|(&a, &e)| (f64::from(a) - e).abs())
            .fold(0.0, f64::max)
    };
    let scale = exact_sum.iter().fold(0.0f64, |a, e| a.max(e.abs()));
    let (fused, naive) = (err(to_vec(main_grad)) / scale, err(to_vec(in_bf16)) / scale);
    eprintln!(
        "bf16 inputs, 8 × 512 tokens: relative error f32 accumulation {fused:e}, bf16 {naive:e}"
    );
    assert!(
        fused < 1e-5 && naive > 100.0 * fused,
        "f32 {fused:e} vs bf16 {naive:e}"
    );
}

#[test]
fn bad_inputs_are_refused_before_any_launch() {
    let dev = common::flex();
    let z = |shape: [usize; 2], dt| tensor(vec![0.0; shape[0] * shape[1]], shape, &dev, dt);
    let f32_ = DType::F32;
    let run = |g, x, dy| accumulate_weight_grad(g, x, dy);
    let shape = |r: Result<_, KernelError>| matches!(r, Err(KernelError::Shape(_)));
    let arg = |r: Result<_, KernelError>| matches!(r, Err(KernelError::Argument(_)));
    assert!(run(z([3, 4], f32_), z([5, 3], f32_), z([5, 4], f32_)).is_ok());
    assert!(shape(run(
        z([3, 4], f32_),
        z([5, 4], f32_),
        z([5, 4], f32_)
    )));
    assert!(shape(run(
        z([3, 4], f32_),
        z([5, 3], f32_),
        z([5, 3], f32_)
    )));
    assert!(shape(run(
        z([3, 4], f32_),
        z([5, 3], f32_),
        z([6, 4], f32_)
    )));
    assert!(arg(run(
        z([3, 4], DType::F16),
        z([5, 3], f32_),
        z([5, 4], f32_)
    )));
    assert!(arg(run(
        z([3, 4], f32_),
        z([5, 3], DType::F16),
        z([5, 4], f32_)
    )));
}
