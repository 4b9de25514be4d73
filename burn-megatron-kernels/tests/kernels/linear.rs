//! `linear`: the same values as Burn's matmul and its autodiff (bit for bit on Flex, whose
//! gemm both use), for contiguous and transposed operands, products above and below the
//! size that runs on every thread, f32 (written once) and bf16 (Flex's matmul); and bad
//! input as errors.

use crate::common;

use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::{KernelError, linear};
use common::{to_vec, values};

fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D], dev: &Device, dt: DType) -> Tensor<D> {
    let options = TensorCreationOptions::new(dev.clone()).with_dtype(dt);
    Tensor::from_data(TensorData::new(v, shape), options)
}

/// `(y, dx, dw)` of `x·w` under the loss `Σ y·g`, through `product`; `x` is `[tokens, in]`,
/// or its transpose's view when `x_t`, and `w` `[in, out]`, or `[out, in]` transposed when
/// `w_t`.
#[allow(clippy::type_complexity)]
fn run(
    dev: &Device,
    dt: DType,
    [tokens, fan_in, fan_out]: [usize; 3],
    (x_t, w_t): (bool, bool),
    product: &dyn Fn(Tensor<2>, Tensor<2>) -> Tensor<2>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let seed = (tokens * 10_000 + fan_in * 100 + fan_out) as u64;
    let xv = values(tokens * fan_in, seed, 1.0);
    let wv = values(fan_in * fan_out, seed + 1, 0.5);
    let x = if x_t {
        tensor(xv, [fan_in, tokens], dev, dt).require_grad()
    } else {
        tensor(xv, [tokens, fan_in], dev, dt).require_grad()
    };
    let w = if w_t {
        tensor(wv, [fan_out, fan_in], dev, dt).require_grad()
    } else {
        tensor(wv, [fan_in, fan_out], dev, dt).require_grad()
    };
    let xs = if x_t {
        x.clone().transpose()
    } else {
        x.clone()
    };
    let ws = if w_t {
        w.clone().transpose()
    } else {
        w.clone()
    };
    let y = product(xs, ws);
    let g = tensor(
        values(tokens * fan_out, seed + 2, 1.0),
        [tokens, fan_out],
        dev,
        dt,
    );
    let grads = (y.clone() * g).sum().backward();
    let dx = x.grad(&grads).map(to_vec).unwrap_or_default();
    let dw = w.grad(&grads).map(to_vec).unwrap_or_default();
    (to_vec(y), dx, dw)
}

const SHAPES: [[usize; 3]; 6] = [
    [1, 1, 1],
    [37, 33, 70],
    [257, 3, 100],
    [5, 300, 2],
    // Above 192³ multiply-adds: the products run on every thread.
    [300, 200, 250],
    [1030, 64, 520],
];

#[test]
fn linear_on_flex_is_burns_matmul_bit_for_bit() {
    let dev = Device::flex().autodiff();
    for shape in SHAPES {
        for layout in [(false, false), (false, true), (true, false), (true, true)] {
            let ours = run(&dev, DType::F32, shape, layout, &|x, w| {
                linear(x, w).unwrap()
            });
            let burn = run(&dev, DType::F32, shape, layout, &|x, w| x.matmul(w));
            let at = format!("{shape:?}, transposed (x, w) {layout:?}");
            assert_eq!(ours.0, burn.0, "y at {at}");
            assert_eq!(ours.1, burn.1, "dx at {at}");
            assert_eq!(ours.2, burn.2, "dw at {at}");
            assert!(ours.0.iter().any(|&v| v != 0.0), "a zero product at {at}");
        }
    }
}

#[test]
fn linear_in_bf16_and_with_leading_dims_is_burns_matmul() {
    let dev = Device::flex().autodiff();
    let shape = [37, 33, 70];
    let ours = run(&dev, DType::BF16, shape, (false, true), &|x, w| {
        linear(x, w).unwrap()
    });
    let burn = run(&dev, DType::BF16, shape, (false, true), &|x, w| x.matmul(w));
    assert_eq!(ours, burn);
    // [b, s, in] as Burn's `linear` folds it.
    let x = tensor(values(3 * 5 * 4, 7, 1.0), [3, 5, 4], &dev, DType::F32);
    let w = tensor(values(4 * 6, 8, 1.0), [4, 6], &dev, DType::F32);
    let ours = linear(x.clone(), w.clone()).unwrap();
    assert_eq!(ours.dims(), [3, 5, 6]);
    assert_eq!(
        to_vec(ours),
        to_vec(burn::tensor::module::linear(x, w, None))
    );
}

/// The one op on a tensor that is not tracked, and an untracked weight: no gradient is
/// asked for what is not tracked, and the tracked side still gets Burn's.
#[test]
fn linear_with_one_side_untracked_gives_the_other_its_gradient() {
    let dev = Device::flex().autodiff();
    let x = tensor(values(40 * 8, 1, 1.0), [40, 8], &dev, DType::F32);
    let w = tensor(values(8 * 9, 2, 1.0), [8, 9], &dev, DType::F32).require_grad();
    let grads = linear(x.clone(), w.clone()).unwrap().sum().backward();
    let burn = x.matmul(w.clone()).sum().backward();
    assert_eq!(
        to_vec(w.grad(&grads).unwrap()),
        to_vec(w.grad(&burn).unwrap())
    );
    let x = tensor(values(40 * 8, 1, 1.0), [40, 8], &dev, DType::F32).require_grad();
    let w = tensor(values(8 * 9, 2, 1.0), [8, 9], &dev, DType::F32);
    let grads = linear(x.clone(), w.clone()).unwrap().sum().backward();
    let burn = x.clone().matmul(w).sum().backward();
    assert_eq!(
        to_vec(x.grad(&grads).unwrap()),
        to_vec(x.grad(&burn).unwrap())
    );
}

#[test]
fn linear_rejects_what_does_not_fit() {
    let dev = Device::flex();
    let x = Tensor::<2>::ones([4, 3], &dev);
    let err = linear(x.clone(), Tensor::<2>::ones([5, 2], &dev)).unwrap_err();
    assert!(
        matches!(err, KernelError::Shape(ref m) if m.contains("(5)")),
        "{err}"
    );
    let err = linear(x, Tensor::<2>::ones([3, 2], &dev).cast(DType::BF16)).unwrap_err();
    assert!(
        matches!(err, KernelError::Argument(ref m) if m.contains("BF16")),
        "{err}"
    );
}

#[cfg(feature = "cube")]
#[test]
fn linear_on_cube_is_burns_matmul() {
    let dev = common::cube_device("linear_on_cube_is_burns_matmul");
    for shape in [[37, 33, 70], [300, 200, 250]] {
        let ours = run(&dev, DType::F32, shape, (false, true), &|x, w| {
            linear(x, w).unwrap()
        });
        let burn = run(&dev, DType::F32, shape, (false, true), &|x, w| x.matmul(w));
        // On CUDA `linear` is cuBLASLt's and Burn's matmul cubek's (gemm.rs checks both
        // against exact products); elsewhere both are cubek's, bit for bit.
        let cuda = common::on_cuda();
        for (i, part) in ["y", "dx", "dw"].iter().enumerate() {
            let (a, b) = [(&ours.0, &burn.0), (&ours.1, &burn.1), (&ours.2, &burn.2)][i];
            common::assert_same_products(a, b, DType::F32, cuda, &format!("{part} at {shape:?}"));
        }
    }
}
