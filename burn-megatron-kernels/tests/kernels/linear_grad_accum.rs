//! `linear_with_grad_accumulation`: the forward and the input gradient are a plain linear
//! layer's (bit for bit), the weight gradient is f32 and within f32 rounding of the exact
//! `xᵀ·dy` even for bf16/f16 activations, on Flex and on the Cube kernel.

use crate::common;

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{KernelError, linear_with_grad_accumulation};
use common::{to_vec, values};

fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D], dev: &Device, dt: DType) -> Tensor<D> {
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    Tensor::from_data(TensorData::new(v, shape), options)
}

/// Exact `xᵀ·dy` and `Σ|x·dy|` per weight entry, in f64 from the stored values.
fn exact(x: &[f32], dy: &[f32], [tokens, fan_in, fan_out]: [usize; 3]) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for i in 0..fan_in {
        for j in 0..fan_out {
            let products =
                (0..tokens).map(|t| f64::from(x[t * fan_in + i]) * f64::from(dy[t * fan_out + j]));
            out.push(products.fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs())));
        }
    }
    out
}

fn check(dev: &Device, what: &str, dtypes: &[DType]) {
    let (batch, seq, fan_in, fan_out) = (3, 37, 33, 70);
    let tokens = batch * seq;
    for &dt in dtypes {
        let at = format!("{what} {dt:?}");
        let x = tensor(
            values(tokens * fan_in, 1, 2.0),
            [batch, seq, fan_in],
            dev,
            dt,
        );
        let w = tensor(values(fan_in * fan_out, 2, 0.5), [fan_in, fan_out], dev, dt);
        let r = tensor(
            values(tokens * fan_out, 3, 1.0),
            [batch, seq, fan_out],
            dev,
            dt,
        );
        // The fused layer and Burn's own, on fresh leaves each.
        let run = |fused: bool| {
            let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
            let y = if fused {
                linear_with_grad_accumulation(x.clone(), w.clone()).unwrap()
            } else {
                burn::tensor::module::linear(x.clone(), w.clone(), None)
            };
            let grads = (y.clone() * r.clone()).sum().backward();
            (y, x.grad(&grads).unwrap(), w.grad(&grads).unwrap())
        };
        let ((y, dx, dw), (y_ref, dx_ref, dw_ref)) = (run(true), run(false));
        // On CUDA the fused layer's products are cuBLASLt's, Burn's cubek's.
        let cuda = cfg!(feature = "cube") && what == "cube" && common::on_cuda();
        let same = |a: Tensor<3>, b: Tensor<3>, of: &str| {
            common::assert_same_products(&to_vec(a), &to_vec(b), dt, cuda, &format!("{at}: {of}"))
        };
        same(y, y_ref, "forward");
        same(dx, dx_ref, "input gradient");
        assert_eq!(dw.dtype(), DType::F32, "{at}: the weight gradient is f32");
        assert_eq!(dw_ref.dtype(), dt);
        // dy of `sum(y · r)` is r; both against the exact product of the stored values.
        let truth = exact(
            &to_vec(x.clone()),
            &to_vec(r.clone()),
            [tokens, fan_in, fan_out],
        );
        let rel = |got: Vec<f32>| {
            got.iter()
                .zip(&truth)
                .map(|(&g, &(e, size))| (f64::from(g) - e).abs() / size.max(1e-30))
                .fold(0.0, f64::max)
        };
        let (fused_err, plain_err) = (rel(to_vec(dw)), rel(to_vec(dw_ref)));
        // f32 sums of `tokens` products: a few f32 ulps of Σ|x·dy|, or no worse than the
        // device's own f32 matmul where that rounds below f32 (CUDA's tensor cores).
        let bound = if dt == DType::F32 {
            1e-6f64.max(plain_err)
        } else {
            1e-6
        };
        assert!(
            fused_err <= bound,
            "{at}: weight gradient off by {fused_err:e} (bound {bound:e})"
        );
        if dt != DType::F32 {
            assert!(
                plain_err > 10.0 * fused_err,
                "{at}: the half gradient ({plain_err:e}) should be far worse than f32 ({fused_err:e})"
            );
        }
    }
}

#[test]
fn matches_a_plain_linear_with_an_f32_weight_gradient_on_flex() {
    check(
        &common::flex(),
        "flex",
        &[DType::F32, DType::BF16, DType::F16],
    );
}

#[cfg(feature = "cube")]
#[test]
fn matches_a_plain_linear_with_an_f32_weight_gradient_on_cube() {
    // lavapipe has no bf16.
    let dev = common::cube_device("linear_with_grad_accumulation");
    check(&dev, "cube", &[DType::F32, DType::F16]);
}

#[test]
fn mismatched_inputs_are_refused() {
    let dev = Device::flex();
    let w = Tensor::<2>::zeros([4, 2], &dev);
    let e = linear_with_grad_accumulation(Tensor::<2>::zeros([3, 5], &dev), w.clone());
    assert!(matches!(e, Err(KernelError::Shape(_))), "{e:?}");
    let half = Tensor::<2>::zeros([3, 4], &dev).cast(DType::BF16);
    let e = linear_with_grad_accumulation(half, w);
    assert!(matches!(e, Err(KernelError::Argument(_))), "{e:?}");
}
