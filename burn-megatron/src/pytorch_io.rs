//! PyTorch checkpoints (`torch.save` of a state dict), read by Burn's `pytorch-reader` a
//! tensor at a time.

use burn::tensor::DType;

/// Burn's dtype for a PyTorch storage's.
pub(crate) fn burn_dtype(d: pytorch_reader::DType) -> DType {
    use pytorch_reader::DType as T;
    match d {
        T::F64 => DType::F64,
        T::F32 => DType::F32,
        T::F16 => DType::F16,
        T::BF16 => DType::BF16,
        T::I64 => DType::I64,
        T::I32 => DType::I32,
        T::I16 => DType::I16,
        T::I8 => DType::I8,
        T::U64 => DType::U64,
        T::U32 => DType::U32,
        T::U16 => DType::U16,
        T::U8 => DType::U8,
        T::Bool => DType::Bool(burn::tensor::BoolStore::Native),
    }
}
