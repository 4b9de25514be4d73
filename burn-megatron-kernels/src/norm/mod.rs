//! Sums of squares of many tensors at once, one f32 sum per tensor, for the global gradient
//! norm (per tensor, so that the caller can leave out tensor-parallel duplicates first).
//!
//! A CubeCL launch takes a fixed list of tensor arguments, so the tensors are segments of one
//! flat buffer, described by their lengths. On Cube backends [`segment_sum_of_squares`] is two
//! launches whatever the number of segments: per-chunk partial sums (a chunk never straddles
//! two segments), then one unit per segment adding its chunks' partials, in a fixed order
//! (deterministic). [`multi_tensor_sum_of_squares`] first concatenates separate tensors with
//! Burn's `cat`, which is one copy per tensor on Cube backends: keep gradients in a flat
//! buffer (as the main-grad buffer does) to get the two launches.
//!
//! Squares are f32: a magnitude above ~1.8e19 squares to inf (as in Megatron's f32 norm),
//! and so does any inf or NaN, which makes a non-finite sum an overflow test too.

#[cfg(feature = "cube")]
mod cube;
mod flex;

use crate::KernelError;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Device, FloatDType, Shape, Slice, Tensor};

/// Sums of squares over the segments of a flat buffer, as a backend op.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait SumOfSquaresOps: Backend {
    /// `Σ x²` over each segment of `flat` (`[n]`, any float dtype, accumulated in f32);
    /// `lengths` sum to `n`. Returns f32 `[lengths.len()]`.
    fn segment_sum_of_squares(flat: FloatTensor<Self>, lengths: Vec<usize>) -> FloatTensor<Self>;
}

/// The reference from Burn ops: per segment a slice, a cast to f32, `powi(2)` and `sum`, the
/// sums concatenated (`2 + 3·segments` launches on a GPU backend).
pub fn reference_segment_sum_of_squares<B: Backend>(
    flat: FloatTensor<B>,
    lengths: &[usize],
) -> FloatTensor<B> {
    let device = flat.device();
    if lengths.is_empty() {
        return B::float_zeros(Shape::from([0]), &device, FloatDType::F32);
    }
    let mut start = 0;
    let sums = lengths
        .iter()
        .map(|&len| {
            let segment = B::float_slice(flat.clone(), &[Slice::from(start..start + len)]);
            start += len;
            let squares = B::float_powi_scalar(B::float_cast(segment, FloatDType::F32), 2.into());
            B::float_reshape(B::float_sum(squares), Shape::from([1]))
        })
        .collect();
    B::float_cat(sums, 0)
}

impl SumOfSquaresOps for Flex {
    fn segment_sum_of_squares(flat: FloatTensor<Self>, lengths: Vec<usize>) -> FloatTensor<Self> {
        flex::segment_sum_of_squares(flat, lengths)
    }
}

/// A norm of gradients is not differentiated: the inner backend's op, untracked.
impl<B: SumOfSquaresOps, C: CheckpointStrategy> SumOfSquaresOps for Autodiff<B, C> {
    fn segment_sum_of_squares(flat: FloatTensor<Self>, lengths: Vec<usize>) -> FloatTensor<Self> {
        Self::from_inner(B::segment_sum_of_squares(flat.into_parts().0, lengths))
    }
}

/// `Σ x²` of each segment of the flat buffer `flat`, the segments given by their `lengths`
/// in order: an f32 tensor `[lengths.len()]`. Two launches on Cube backends (see the module
/// docs); errors before any launch when the lengths do not sum to `flat`'s size or a
/// segment offset would not fit in 32 bits.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::segment_sum_of_squares;
/// let flat = Tensor::<1>::from_floats([1.0, 2.0, 3.0, 4.0], &Device::flex());
/// let sums = segment_sum_of_squares(flat, &[1, 0, 3]).unwrap();
/// assert_eq!(sums.to_data().to_vec::<f32>().unwrap(), vec![1.0, 0.0, 29.0]);
/// ```
pub fn segment_sum_of_squares(
    flat: Tensor<1>,
    lengths: &[usize],
) -> Result<Tensor<1>, KernelError> {
    let n = flat.dims()[0];
    let total: usize = lengths.iter().sum();
    if total != n {
        return Err(KernelError::Shape(format!(
            "segment lengths sum to {total}, the buffer has {n} elements"
        )));
    }
    if n > u32::MAX as usize {
        return Err(KernelError::Unsupported(format!(
            "{n} elements: segment offsets are 32-bit; split the buffer"
        )));
    }
    Ok(Tensor::from_dispatch(Dispatch::segment_sum_of_squares(
        flat.into_dispatch(),
        lengths.to_vec(),
    )))
}

/// `Σ x²` of each tensor (flattened; f32, f16 or bf16, accumulated in f32): an f32 tensor
/// `[tensors.len()]` on the tensors' device. On Cube backends concatenates them first (one
/// copy each; mixed dtypes are cast to f32), then [`segment_sum_of_squares`] (two launches);
/// on Flex sums each where it lies. Errors on an
/// empty list (no device to put the result on) or tensors on different devices.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::multi_tensor_sum_of_squares;
/// let device = Device::flex();
/// let a = Tensor::<1>::from_floats([3.0, 4.0], &device);
/// let b = Tensor::<2>::from_floats([[1.0], [-1.0]], &device).reshape([2]);
/// let sums = multi_tensor_sum_of_squares(&[a, b]).unwrap();
/// assert_eq!(sums.to_data().to_vec::<f32>().unwrap(), vec![25.0, 2.0]);
/// ```
pub fn multi_tensor_sum_of_squares(tensors: &[Tensor<1>]) -> Result<Tensor<1>, KernelError> {
    let first = tensors
        .first()
        .ok_or_else(|| KernelError::Argument("no tensors".into()))?;
    let device = first.device();
    if let Some((i, t)) = tensors
        .iter()
        .enumerate()
        .find(|(_, t)| t.device() != device)
    {
        return Err(KernelError::Argument(format!(
            "tensor {i} is on {:?}, tensor 0 on {device:?}",
            t.device()
        )));
    }
    let lengths: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
    // On the CPU a pass per tensor reads it where it lies: the concatenation would be one
    // more pass over every gradient, into fresh pages.
    if device == Device::flex() {
        let sums = tensors
            .iter()
            .zip(&lengths)
            .map(|(t, &len)| segment_sum_of_squares(t.clone(), &[len]))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Tensor::cat(sums, 0));
    }
    let same_dtype = tensors.iter().all(|t| t.dtype() == first.dtype());
    let parts: Vec<Tensor<1>> = tensors
        .iter()
        .filter(|t| t.dims()[0] > 0)
        .map(|t| {
            if same_dtype {
                t.clone()
            } else {
                t.clone().cast(DType::F32)
            }
        })
        .collect();
    let flat = match parts.len() {
        0 => Tensor::<1>::empty([0], &device),
        1 => parts.into_iter().next().expect("one part"),
        _ => Tensor::cat(parts, 0),
    };
    segment_sum_of_squares(flat, &lengths)
}
