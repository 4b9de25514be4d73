//! Weight-gradient accumulation into an fp32 buffer (Megatron's
//! `gradient_accumulation_fusion`): `main_grad += xᵀ·dy` with f32/f16/bf16 activations and
//! output gradients, the products summed in f32, so low-precision micro-batches never round
//! the accumulated weight gradient.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{DType, FloatDType, Tensor};

/// Weight-gradient accumulation as a backend op: on Cube backends cubek's matmul with an f32
/// output from half inputs, then an add into `main_grad` (in place when nothing else holds
/// it); Burn's own ops elsewhere. And the linear product whose backward uses it.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait GradAccumOps: Backend {
    /// `main_grad + xᵀ·dy`: `main_grad` f32 `[in, out]`, `x` `[tokens, in]`, `dy`
    /// `[tokens, out]` of one float dtype; f32 result. Shapes are not validated here (see
    /// [`accumulate_weight_grad`]).
    fn accumulate_weight_grad(
        main_grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `xᵀ·dy` as a new f32 `[in, out]` tensor (`x` `[tokens, in]`, `dy` `[tokens, out]` of
    /// one float dtype, summed in f32): [`Self::accumulate_weight_grad`] with nothing to add
    /// to, so no zeros are written and read.
    fn weight_grad_f32(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x·weight` (`x` `[tokens, in]`, `weight` `[in, out]`, one float dtype). Under
    /// autodiff its weight gradient is [`Self::weight_grad_f32`] (so an f32 gradient for a
    /// bf16/f16 weight) and its input gradient `dy·weightᵀ` as usual.
    fn linear_fp32_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The reference from Burn ops: cast `x` and `dy` to f32, then `main_grad + xᵀ·dy`.
pub fn reference_accumulate_weight_grad<B: Backend>(
    main_grad: FloatTensor<B>,
    x: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = B::float_cast(x, FloatDType::F32);
    let dy = B::float_cast(dy, FloatDType::F32);
    B::float_add(main_grad, B::float_matmul(B::float_transpose(x), dy))
}

/// The reference of [`GradAccumOps::weight_grad_f32`]: cast `x` and `dy` to f32, then `xᵀ·dy`.
pub(crate) fn reference_weight_grad_f32<B: Backend>(
    x: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = B::float_cast(x, FloatDType::F32);
    let dy = B::float_cast(dy, FloatDType::F32);
    B::float_matmul(B::float_transpose(x), dy)
}

impl GradAccumOps for Flex {
    fn accumulate_weight_grad(
        main_grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference_accumulate_weight_grad::<Self>(main_grad, x, dy)
    }

    fn weight_grad_f32(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        reference_weight_grad_f32::<Self>(x, dy)
    }

    fn linear_fp32_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(x, weight)
    }
}

/// `main_grad + xᵀ·dy`, the weight gradient of a `[in, out]` Linear layer (`y = x·W`) added
/// to its f32 accumulation buffer: `main_grad` f32 `[in, out]`, `x` `[tokens, in]` and `dy`
/// `[tokens, out]` both f32, f16 or bf16 (the same dtype); products summed in f32 (on Cube
/// backends without casting the inputs first). On Cube backends `main_grad`'s buffer is
/// updated in place when no other tensor shares it.
///
/// Errors on shapes that do not fit together, a `main_grad` that is not f32, or `x` and
/// `dy` of different or non-float dtypes.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::accumulate_weight_grad;
/// let device = Device::flex();
/// let main_grad = Tensor::<2>::from_floats([[1.0], [2.0]], &device); // [in 2, out 1]
/// let x = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device); // [tokens 2, in 2]
/// let dy = Tensor::<2>::from_floats([[10.0], [100.0]], &device); // [tokens 2, out 1]
/// let g = accumulate_weight_grad(main_grad, x, dy).unwrap();
/// let g: Vec<f32> = g.into_data().to_vec().unwrap();
/// assert_eq!(g, [1.0 + 10.0 + 300.0, 2.0 + 20.0 + 400.0]);
/// ```
pub fn accumulate_weight_grad(
    main_grad: Tensor<2>,
    x: Tensor<2>,
    dy: Tensor<2>,
) -> Result<Tensor<2>, KernelError> {
    let ([fan_in, fan_out], [tokens, x_in], [dy_tokens, dy_out]) =
        (main_grad.dims(), x.dims(), dy.dims());
    if x_in != fan_in || dy_out != fan_out || dy_tokens != tokens {
        return Err(KernelError::Shape(format!(
            "main_grad [{fan_in}, {fan_out}] += xᵀ·dy needs x [tokens, {fan_in}] and dy \
             [tokens, {fan_out}], got x [{tokens}, {x_in}] and dy [{dy_tokens}, {dy_out}]"
        )));
    }
    if main_grad.dtype() != DType::F32 {
        return Err(KernelError::Argument(format!(
            "main_grad must be f32, got {:?}",
            main_grad.dtype()
        )));
    }
    if x.dtype() != dy.dtype() || !x.dtype().is_float() {
        return Err(KernelError::Argument(format!(
            "x and dy must share one float dtype, got {:?} and {:?}",
            x.dtype(),
            dy.dtype()
        )));
    }
    Ok(Tensor::from_dispatch(Dispatch::accumulate_weight_grad(
        main_grad.into_dispatch(),
        x.into_dispatch(),
        dy.into_dispatch(),
    )))
}

/// `x·weight` for `x` `[..., in]` and `weight` `[in, out]` (Burn's layout, no bias), whose
/// backward forms the weight gradient with [`accumulate_weight_grad`] — `xᵀ·dy` summed in f32
/// — and returns it as an **f32** tensor whatever the weight's dtype: Megatron's
/// `gradient_accumulation_fusion`. A bf16 model's weight gradients then never round to bf16,
/// neither within the product nor when micro-batches or data-parallel ranks are summed (Burn's
/// `GradientsAccumulator` and the FP32 main-grad buckets add f32 to f32). The input gradient
/// is `dy·weightᵀ` in the model's dtype, as in a plain linear layer.
///
/// Errors when `x`'s last dim is not `weight`'s first or the dtypes differ.
///
/// ```
/// use burn::tensor::{DType, Device, Tensor};
/// use burn_megatron_kernels::linear_with_grad_accumulation;
/// let device = Device::flex().autodiff();
/// let x = Tensor::<3>::ones([2, 3, 4], &device).cast(DType::BF16);
/// let w = Tensor::<2>::ones([4, 5], &device).cast(DType::BF16).require_grad();
/// let y = linear_with_grad_accumulation(x, w.clone()).unwrap();
/// assert_eq!(y.dims(), [2, 3, 5]);
/// let grads = y.sum().backward();
/// let gw = w.grad(&grads).unwrap();
/// assert_eq!(gw.dtype(), DType::F32); // six tokens of ones: every entry 6
/// assert_eq!(gw.into_data().iter::<f32>().collect::<Vec<_>>(), vec![6.0; 20]);
/// ```
pub fn linear_with_grad_accumulation<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
) -> Result<Tensor<D>, KernelError> {
    crate::linear::fold_tokens(x, weight, Dispatch::linear_fp32_weight_grad)
}
