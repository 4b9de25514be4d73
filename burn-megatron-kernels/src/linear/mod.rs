//! The linear product `x·W` whose forward and backward products write their outputs once.
//!
//! Flex's matmul allocates each output through `FlexTensor::empty`: a zeroed `Vec<u8>`,
//! which Burn's `Bytes` then copies into a 16-byte-aligned buffer, so every product's output
//! is written twice before the gemm fills it (for a `[1024, 32000]` logits tensor, a 131 MB
//! memset and a 131 MB copy on one thread, about as long as half the gemm). Here the
//! same `gemm` kernels fill an uninitialised f32 buffer that becomes the tensor as it is.
//! On CUDA the products are cuBLASLt's (see [`crate::cuda::gemm_engine`]); other dtypes and
//! backends run Burn's own matmul.

mod autodiff;
mod flex;

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// The linear product as a backend op, and the 2-d product its backward is made of.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait LinearOps: Backend {
    /// `a·b` for 2-d `a` `[m, k]` and `b` `[k, n]` of one float dtype; either may be a
    /// strided view (a transpose). Shapes are not validated here (see [`linear`]).
    fn matmul_2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x·weight` (`x` `[tokens, in]`, `weight` `[in, out]`). Under autodiff its backward
    /// is `dx = dy·weightᵀ` and `dweight = xᵀ·dy`, both through [`Self::matmul_2d`].
    fn linear_2d(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `a·b` over equal leading (batch) dims: `a` `[..., m, k]`, `b` `[..., k, n]`, one float
    /// dtype, either a strided view. Under autodiff its backward is `da = dc·bᵀ` and
    /// `db = aᵀ·dc`, both through this op. Shapes are not validated here (see
    /// [`batched_matmul`]).
    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl LinearOps for Flex {
    fn matmul_2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        flex::matmul_f32(&a, &b).unwrap_or_else(|| {
            <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
        })
    }

    fn linear_2d(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::matmul_2d(x, weight)
    }

    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
    }
}

// On CUDA, cuBLASLt where it loads (see `cuda::gemm_engine`); cubek's matmul elsewhere.
#[cfg(feature = "cube")]
impl LinearOps for burn_cubecl::CubeBackend {
    fn matmul_2d(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = crate::cuda::blas::try_matmul(&a, &b, None) {
            return out;
        }
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
    }

    fn linear_2d(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::matmul_2d(x, weight)
    }

    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        #[cfg(feature = "cuda")]
        if let Some(out) = crate::cuda::blas::try_matmul(&a, &b, None) {
            return out;
        }
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(a, b)
    }
}

/// `a·b` for `a` `[..., m, k]` and `b` `[..., k, n]` as Burn's `Tensor::matmul` computes it
/// (the same bits on Flex, forward and backward), through [`LinearOps::batched_matmul`]: on
/// CUDA one strided-batched cuBLASLt GEMM per product, forward and both gradients. Inputs it
/// does not take (2-d, broadcast batch dims, mixed dtypes) go to `Tensor::matmul`.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::batched_matmul;
/// let device = Device::flex();
/// let a = Tensor::<3>::ones([2, 3, 4], &device);
/// let b = Tensor::<3>::ones([2, 4, 5], &device);
/// assert_eq!(batched_matmul(a, b).dims(), [2, 3, 5]);
/// ```
pub fn batched_matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    let (da, db) = (a.dims(), b.dims());
    let fits = D >= 3
        && da[..D - 2] == db[..D - 2]
        && da[D - 1] == db[D - 2]
        && a.dtype() == b.dtype()
        && a.dtype().is_float();
    if !fits {
        return a.matmul(b);
    }
    Tensor::from_dispatch(Dispatch::batched_matmul(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `x·weight` for `x` `[..., in]` and `weight` `[in, out]` (Burn's layout, no bias), as
/// `burn::tensor::module::linear` computes it, with the forward and both backward products
/// written once on Flex (see the module docs); elsewhere Burn's matmul.
///
/// Errors when `x`'s last dim is not `weight`'s first or the dtypes differ.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::linear;
/// let device = Device::flex().autodiff();
/// let x = Tensor::<3>::ones([2, 3, 4], &device);
/// let w = Tensor::<2>::ones([4, 5], &device).require_grad();
/// let y = linear(x, w.clone()).unwrap();
/// assert_eq!(y.dims(), [2, 3, 5]);
/// let gw = w.grad(&y.sum().backward()).unwrap(); // six tokens of ones
/// assert_eq!(gw.into_data().iter::<f32>().collect::<Vec<_>>(), vec![6.0; 20]);
/// ```
pub fn linear<const D: usize>(x: Tensor<D>, weight: Tensor<2>) -> Result<Tensor<D>, KernelError> {
    fold_tokens(x, weight, Dispatch::linear_2d)
}

/// `product(x, weight)` for `x` `[..., in]` and `weight` `[in, out]`, the leading dims of
/// `x` folded into one for a 2-d `product` and restored after it; an error unless `x` ends
/// in `weight`'s input features and shares its float dtype.
pub(crate) fn fold_tokens<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    product: fn(FloatTensor<Dispatch>, FloatTensor<Dispatch>) -> FloatTensor<Dispatch>,
) -> Result<Tensor<D>, KernelError> {
    let (dims, [fan_in, fan_out]) = (x.dims(), weight.dims());
    if D == 0 || dims[D - 1] != fan_in {
        return Err(KernelError::Shape(format!(
            "x {dims:?} must end in the weight's input features ({fan_in}); weight [{fan_in}, {fan_out}]"
        )));
    }
    if x.dtype() != weight.dtype() || !x.dtype().is_float() {
        return Err(KernelError::Argument(format!(
            "x and weight must share one float dtype, got {:?} and {:?}",
            x.dtype(),
            weight.dtype()
        )));
    }
    let product = |x: Tensor<2>| {
        Tensor::<2>::from_dispatch(product(x.into_dispatch(), weight.into_dispatch()))
    };
    // A 2-d `x` goes in as it is: a reshape would copy a strided view (a transpose) into a
    // contiguous tensor, and the gemm's sums then follow another order than Burn's matmul.
    if D == 2 {
        let x = Tensor::<2>::from_dispatch(x.into_dispatch());
        return Ok(Tensor::from_dispatch(product(x).into_dispatch()));
    }
    let tokens = dims[..D - 1].iter().product::<usize>();
    let y = product(x.reshape([tokens, fan_in]));
    let mut out = dims;
    out[D - 1] = fan_out;
    Ok(y.reshape(out))
}
