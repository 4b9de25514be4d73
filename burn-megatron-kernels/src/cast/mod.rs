//! FP32 master weights → bf16 / f16 model weights, rounded to nearest, ties to even, bit for
//! bit as `half::bf16::from_f32` / `half::f16::from_f32` (NaN kept quiet with its top payload
//! bits, overflow to ±inf, f16 subnormals rounded, not flushed).
//!
//! Two outputs: [`master_to_model`] writes the target dtype itself and needs a device that
//! holds it (WGSL has no bf16 and lavapipe may lack f16: a clear error there);
//! [`round_to`] writes f32 values that are exactly the target's values (widened), on every
//! device — what a run without native half types trains with. On Cube backends the rounding
//! is integer arithmetic on the f32 bits in the kernel, so it does not depend on how the
//! hardware converts; the native write then converts an exactly representable value.

#[cfg(feature = "cube")]
mod cube;

use crate::KernelError;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{DType, FloatDType, Slice, Tensor};

/// The master → model copy as a backend op.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait MasterCastOps: Backend {
    /// `master` (f32) rounded to `dtype` (BF16 or F16), ties to even; stored as `dtype`, or
    /// widened back to f32 when `widened`.
    fn master_cast(
        master: FloatTensor<Self>,
        dtype: FloatDType,
        widened: bool,
    ) -> FloatTensor<Self>;
}

/// The reference: Burn's `cast` (and a cast back to f32 when `widened`).
pub fn reference_master_cast<B: Backend>(
    master: FloatTensor<B>,
    dtype: FloatDType,
    widened: bool,
) -> FloatTensor<B> {
    let model = B::float_cast(master, dtype);
    if widened {
        B::float_cast(model, FloatDType::F32)
    } else {
        model
    }
}

impl MasterCastOps for Flex {
    fn master_cast(
        master: FloatTensor<Self>,
        dtype: FloatDType,
        widened: bool,
    ) -> FloatTensor<Self> {
        reference_master_cast::<Self>(master, dtype, widened)
    }
}

/// Master weights are not differentiated: the inner backend's op, untracked.
impl<B: MasterCastOps, C: CheckpointStrategy> MasterCastOps for Autodiff<B, C> {
    fn master_cast(
        master: FloatTensor<Self>,
        dtype: FloatDType,
        widened: bool,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::master_cast(master.into_parts().0, dtype, widened))
    }
}

fn check<const D: usize>(master: &Tensor<D>, dtype: FloatDType) -> Result<(), KernelError> {
    if master.dtype() != DType::F32 {
        return Err(KernelError::Argument(format!(
            "master weights are {:?}, expected f32",
            master.dtype()
        )));
    }
    if !matches!(dtype, FloatDType::BF16 | FloatDType::F16) {
        return Err(KernelError::Argument(format!(
            "target {dtype:?}: only BF16 and F16 are model dtypes"
        )));
    }
    Ok(())
}

/// The model weights for f32 `master`: `dtype` (BF16 or F16) rounded to nearest even,
/// bit-exact with `half`. Errors before any launch when `master` is not f32, `dtype` is not
/// a half type, or the device cannot hold `dtype` (`KernelError::Unsupported`; wgpu has no
/// bf16: use [`round_to`] there).
///
/// ```
/// use burn::tensor::{DType, Device, FloatDType, Tensor};
/// use burn_megatron_kernels::master_to_model;
/// let master = Tensor::<1>::from_floats([1.0, 1.00390625, f32::MAX], &Device::flex());
/// let model = master_to_model(master, FloatDType::BF16).unwrap();
/// assert_eq!(model.dtype(), DType::BF16);
/// let back: Vec<f32> = model.cast(DType::F32).to_data().to_vec().unwrap();
/// assert_eq!(back, vec![1.0, 1.0, f32::INFINITY]); // a tie to even; overflow
/// ```
pub fn master_to_model<const D: usize>(
    master: Tensor<D>,
    dtype: FloatDType,
) -> Result<Tensor<D>, KernelError> {
    check(&master, dtype)?;
    if !master.device().supports_dtype(dtype) {
        return Err(KernelError::Unsupported(format!(
            "{:?} cannot hold {dtype:?}; round_to gives the same values in f32",
            master.device()
        )));
    }
    Ok(Tensor::from_dispatch(Dispatch::master_cast(
        master.into_dispatch(),
        dtype,
        false,
    )))
}

/// f32 `master` rounded to the values of `dtype` (BF16 or F16), kept in f32: exactly
/// `master_to_model(master, dtype)` widened to f32, on every device. Errors when `master`
/// is not f32 or `dtype` not a half type.
///
/// ```
/// use burn::tensor::{Device, FloatDType, Tensor};
/// use burn_megatron_kernels::round_to;
/// let master = Tensor::<1>::from_floats([1.0 + 1.5 / 1024.0, 70000.0], &Device::flex());
/// let rounded: Vec<f32> = round_to(master, FloatDType::F16).unwrap().to_data().to_vec().unwrap();
/// assert_eq!(rounded, vec![1.0 + 2.0 / 1024.0, f32::INFINITY]);
/// ```
pub fn round_to<const D: usize>(
    master: Tensor<D>,
    dtype: FloatDType,
) -> Result<Tensor<D>, KernelError> {
    check(&master, dtype)?;
    Ok(Tensor::from_dispatch(Dispatch::master_cast(
        master.into_dispatch(),
        dtype,
        true,
    )))
}

/// [`master_to_model`] over a flat master buffer: one cast, then one `[len]` view per
/// parameter (`lengths` in order, summing to the buffer's size; reshape each to its
/// parameter's shape).
pub fn master_to_model_segments(
    master: Tensor<1>,
    lengths: &[usize],
    dtype: FloatDType,
) -> Result<Vec<Tensor<1>>, KernelError> {
    let (n, total) = (master.dims()[0], lengths.iter().sum::<usize>());
    if n != total {
        return Err(KernelError::Shape(format!(
            "segment lengths sum to {total}, the master buffer has {n} elements"
        )));
    }
    let model = master_to_model(master, dtype)?;
    let mut start = 0;
    Ok(lengths
        .iter()
        .map(|&len| {
            start += len;
            model.clone().slice([Slice::from(start - len..start)])
        })
        .collect())
}
