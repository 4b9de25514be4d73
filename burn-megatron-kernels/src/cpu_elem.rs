//! Flex's float storage (f32, f16, bf16) as seen by the native loops that compute in f32
//! whatever the dtype: [`Elem`] reads a tensor's values in its own type and converts each
//! value to and from f32 (for f32 the conversions are the identity and compile away).

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData, bf16, f16};
use std::borrow::Cow;

/// A float element of Flex's storage that the native loops widen to f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// The value widened to f32 (exact).
    fn to_f32(self) -> f32;
    /// `v` rounded to the nearest value of this type.
    fn from_f32(v: f32) -> Self;
    /// `t`'s values when it holds this type, made contiguous if it is not.
    fn values(t: &FlexTensor) -> Option<Cow<'_, [Self]>>;
    /// A tensor of `shape` holding `values`.
    fn tensor(values: Vec<Self>, shape: &[usize]) -> FlexTensor;

    /// `v` rounded to this type, as f32: what a Flex op in this dtype keeps of a result.
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
}

/// `t`'s values when its dtype is `dtype` (as `E`), made contiguous if they are not.
fn typed<E: Clone>(
    t: &FlexTensor,
    dtype: DType,
    slice: impl for<'a> Fn(&'a FlexTensor) -> Option<&'a [E]>,
) -> Option<Cow<'_, [E]>> {
    if t.dtype() != dtype {
        return None;
    }
    Some(match slice(t) {
        Some(s) => s.into(),
        None => slice(&t.to_contiguous())?.to_vec().into(),
    })
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    fn values(t: &FlexTensor) -> Option<Cow<'_, [Self]>> {
        typed(t, DType::F32, |t| t.as_slice::<f32>())
    }
    fn tensor(values: Vec<Self>, shape: &[usize]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn values(t: &FlexTensor) -> Option<Cow<'_, [Self]>> {
        typed(t, DType::BF16, |t| t.as_slice::<bf16>())
    }
    fn tensor(values: Vec<Self>, shape: &[usize]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn values(t: &FlexTensor) -> Option<Cow<'_, [Self]>> {
        typed(t, DType::F16, |t| t.as_slice::<f16>())
    }
    fn tensor(values: Vec<Self>, shape: &[usize]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
    }
}
