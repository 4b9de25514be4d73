//! Flat, typed host buffers: what a collective moves between ranks.

use half::{bf16, f16};
use std::fmt;

/// Element type of a [`Buffer`], named after NCCL's data types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommDType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
}

impl CommDType {
    /// Every element type, in a fixed order.
    pub const ALL: [CommDType; 5] = [
        CommDType::F32,
        CommDType::F16,
        CommDType::BF16,
        CommDType::I32,
        CommDType::I64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            CommDType::F16 | CommDType::BF16 => 2,
            CommDType::F32 | CommDType::I32 => 4,
            CommDType::I64 => 8,
        }
    }

    /// The Burn dtype of these elements.
    pub fn burn_dtype(self) -> burn::tensor::DType {
        use burn::tensor::DType;
        match self {
            CommDType::F32 => DType::F32,
            CommDType::F16 => DType::F16,
            CommDType::BF16 => DType::BF16,
            CommDType::I32 => DType::I32,
            CommDType::I64 => DType::I64,
        }
    }
}

impl fmt::Display for CommDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            CommDType::F32 => "f32",
            CommDType::F16 => "f16",
            CommDType::BF16 => "bf16",
            CommDType::I32 => "i32",
            CommDType::I64 => "i64",
        };
        f.write_str(name)
    }
}

/// A flat buffer of one element type, owned by the caller of a collective.
///
/// ```
/// use burn_megatron::comm::{Buffer, CommDType};
/// let b = Buffer::from(vec![1.0f32, 2.0]);
/// assert_eq!(b.dtype(), CommDType::F32);
/// assert_eq!(b.len(), 2);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i32 elements.
    I32(Vec<i32>),
    /// i64 elements.
    I64(Vec<i64>),
}

/// Runs `$body` with `$v` bound to the inner `Vec` of whichever variant `$buf` is.
macro_rules! with_vec {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            Buffer::F32($v) => $body,
            Buffer::F16($v) => $body,
            Buffer::BF16($v) => $body,
            Buffer::I32($v) => $body,
            Buffer::I64($v) => $body,
        }
    };
}
pub(crate) use with_vec;

/// Builds a buffer of the same variant as `$buf` from `$body`, with `$v` bound to the
/// inner `Vec`.
macro_rules! map_vec {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            Buffer::F32($v) => Buffer::F32($body),
            Buffer::F16($v) => Buffer::F16($body),
            Buffer::BF16($v) => Buffer::BF16($body),
            Buffer::I32($v) => Buffer::I32($body),
            Buffer::I64($v) => Buffer::I64($body),
        }
    };
}
pub(crate) use map_vec;

impl Buffer {
    /// The element type.
    pub fn dtype(&self) -> CommDType {
        match self {
            Buffer::F32(_) => CommDType::F32,
            Buffer::F16(_) => CommDType::F16,
            Buffer::BF16(_) => CommDType::BF16,
            Buffer::I32(_) => CommDType::I32,
            Buffer::I64(_) => CommDType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        with_vec!(self, v => v.len())
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A zero-filled buffer of `len` elements of `dtype` (a receive buffer).
    pub fn zeros(dtype: CommDType, len: usize) -> Self {
        match dtype {
            CommDType::F32 => Buffer::F32(vec![0.0; len]),
            CommDType::F16 => Buffer::F16(vec![f16::ZERO; len]),
            CommDType::BF16 => Buffer::BF16(vec![bf16::ZERO; len]),
            CommDType::I32 => Buffer::I32(vec![0; len]),
            CommDType::I64 => Buffer::I64(vec![0; len]),
        }
    }

    /// An empty buffer of `dtype` with room for `capacity` elements.
    pub(crate) fn with_capacity(dtype: CommDType, capacity: usize) -> Self {
        match dtype {
            CommDType::F32 => Buffer::F32(Vec::with_capacity(capacity)),
            CommDType::F16 => Buffer::F16(Vec::with_capacity(capacity)),
            CommDType::BF16 => Buffer::BF16(Vec::with_capacity(capacity)),
            CommDType::I32 => Buffer::I32(Vec::with_capacity(capacity)),
            CommDType::I64 => Buffer::I64(Vec::with_capacity(capacity)),
        }
    }

    /// Elements `range` of this buffer, as a new buffer.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Buffer {
        map_vec!(self, v => v[range].to_vec())
    }

    /// Appends `other` (same dtype) to this buffer.
    pub(crate) fn extend_from(&mut self, other: &Buffer) {
        match (self, other) {
            (Buffer::F32(a), Buffer::F32(b)) => a.extend_from_slice(b),
            (Buffer::F16(a), Buffer::F16(b)) => a.extend_from_slice(b),
            (Buffer::BF16(a), Buffer::BF16(b)) => a.extend_from_slice(b),
            (Buffer::I32(a), Buffer::I32(b)) => a.extend_from_slice(b),
            (Buffer::I64(a), Buffer::I64(b)) => a.extend_from_slice(b),
            (a, b) => unreachable!("dtype checked before: {} vs {}", a.dtype(), b.dtype()),
        }
    }

    /// The elements' bytes, in memory order (what a byte-moving engine sends).
    pub(crate) fn bytes(&self) -> &[u8] {
        with_vec!(self, v => bytemuck::cast_slice(v.as_slice()))
    }

    /// The elements' bytes, writable (what a byte-moving engine receives into).
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        with_vec!(self, v => bytemuck::cast_slice_mut(v.as_mut_slice()))
    }

    /// Makes this a buffer of `len` elements of `dtype` whose values are to be overwritten,
    /// keeping its allocation when it has the dtype (zeros where it grows).
    pub(crate) fn resize_for(&mut self, dtype: CommDType, len: usize) {
        if self.dtype() != dtype {
            *self = Buffer::zeros(dtype, len);
        }
        match self {
            Buffer::F32(v) => v.resize(len, 0.0),
            Buffer::F16(v) => v.resize(len, f16::ZERO),
            Buffer::BF16(v) => v.resize(len, bf16::ZERO),
            Buffer::I32(v) => v.resize(len, 0),
            Buffer::I64(v) => v.resize(len, 0),
        }
    }

    /// Concatenates same-typed buffers in order.
    pub(crate) fn concat<'a>(
        dtype: CommDType,
        parts: impl IntoIterator<Item = &'a Buffer>,
    ) -> Self {
        let parts: Vec<&Buffer> = parts.into_iter().collect();
        let total = parts.iter().map(|p| p.len()).sum();
        let mut out = Buffer::with_capacity(dtype, total);
        for p in parts {
            out.extend_from(p);
        }
        out
    }
}

/// Element types a [`Buffer`] can hold; lets typed `Vec`s go through the collectives.
pub trait CommElement: Copy + Send + Sync + 'static {
    /// The matching [`CommDType`].
    const DTYPE: CommDType;
    /// Wraps a vector into a buffer.
    fn into_buffer(v: Vec<Self>) -> Buffer;
    /// Unwraps a buffer of this type (`None` for another type).
    fn from_buffer(b: Buffer) -> Option<Vec<Self>>;
}

macro_rules! comm_element {
    ($t:ty, $variant:ident) => {
        impl CommElement for $t {
            const DTYPE: CommDType = CommDType::$variant;
            fn into_buffer(v: Vec<Self>) -> Buffer {
                Buffer::$variant(v)
            }
            fn from_buffer(b: Buffer) -> Option<Vec<Self>> {
                match b {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
        impl From<Vec<$t>> for Buffer {
            fn from(v: Vec<$t>) -> Self {
                Buffer::$variant(v)
            }
        }
    };
}
comm_element!(f32, F32);
comm_element!(f16, F16);
comm_element!(bf16, BF16);
comm_element!(i32, I32);
comm_element!(i64, I64);

/// The buffer dtype matching a Burn dtype, if collectives support it.
pub(crate) fn comm_dtype(dtype: burn::tensor::DType) -> Option<CommDType> {
    use burn::tensor::DType;
    Some(match dtype {
        DType::F32 => CommDType::F32,
        DType::F16 => CommDType::F16,
        DType::BF16 => CommDType::BF16,
        DType::I32 => CommDType::I32,
        DType::I64 => CommDType::I64,
        _ => return None,
    })
}
