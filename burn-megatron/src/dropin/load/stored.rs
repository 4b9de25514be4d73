//! A record's tensor as a loader holds it: its dtype and shape, and where its bytes are (a
//! view of a mapped file, a PyTorch tensor not read yet, bytes made here, or a model-parallel
//! checkpoint's parts), and the rearrangements made to it whole.

use super::options;
use burn::tensor::{DType, TensorData};
use std::borrow::Cow;

/// Where a tensor's bytes are.
pub(super) enum Bytes<'a> {
    /// A window of the pack over the map.
    Pack(burn::tensor::Bytes),
    /// A window of the mapped file.
    Mapped(&'a [u8]),
    /// In a PyTorch checkpoint, read when asked for (whole).
    Read(pytorch_reader::Tensor),
    /// Made here (a transformed tensor).
    Owned(Vec<u8>),
    /// A model-parallel checkpoint's parts of one tensor, in rank order: joined (or the
    /// first taken) once the parameter that takes them gives the tensor's shape.
    Parts(Vec<Stored<'a>>),
}

/// What a shard is cut from: one stored tensor, or a model-parallel checkpoint's parts joined
/// along `along` into `dims`, of which only those the shard overlaps are read.
pub(super) enum Whole<'s, 'a> {
    One(&'s Stored<'a>),
    Parts {
        parts: &'s [Stored<'a>],
        along: usize,
        dims: Vec<usize>,
    },
}

impl Whole<'_, '_> {
    pub(super) fn dims(&self) -> &[usize] {
        match self {
            Self::One(stored) => &stored.dims,
            Self::Parts { dims, .. } => dims,
        }
    }

    pub(super) fn dtype(&self) -> DType {
        match self {
            Self::One(stored) => stored.dtype,
            Self::Parts { parts, .. } => parts[0].dtype,
        }
    }
}

pub(super) struct Stored<'a> {
    pub(super) dtype: DType,
    pub(super) dims: Vec<usize>,
    pub(super) bytes: Bytes<'a>,
}

impl Stored<'_> {
    /// The tensor's bytes: a view of the map, or read from the file now.
    pub(super) fn bytes(&self) -> Result<Cow<'_, [u8]>, String> {
        Ok(match &self.bytes {
            Bytes::Mapped(b) => Cow::Borrowed(b),
            Bytes::Pack(b) => Cow::Borrowed(b),
            Bytes::Read(t) => Cow::Owned(t.read().map_err(|e| e.to_string())?),
            Bytes::Owned(b) => Cow::Borrowed(b),
            Bytes::Parts(_) => return Err("model-parallel parts read before joining".into()),
        })
    }
}

/// `stored` whole in the parameter's layout (transposed back when stored `[out, in]`), through
/// `transform`, as a tensor of the same shape.
pub(super) fn transformed<'a>(
    stored: &Stored<'_>,
    transposed: bool,
    transform: &options::Transform,
) -> Result<Stored<'a>, String> {
    let (elem, mut dims) = (stored.dtype.size(), stored.dims.clone());
    let mut bytes = stored.bytes()?.into_owned();
    if transposed {
        if dims.len() != 2 {
            return Err(format!(
                "stored transposed but has {} dimensions, not 2",
                dims.len()
            ));
        }
        bytes = transpose(&bytes, dims[0], dims[1], elem);
        dims.reverse();
    }
    let data = (transform.0)(TensorData::from_bytes_vec(
        bytes,
        dims.clone(),
        stored.dtype,
    ))?;
    if data.shape().to_vec() != dims || data.dtype() != stored.dtype {
        return Err(format!(
            "the transform returned {:?} {:?} for {dims:?} {:?}",
            data.shape().to_vec(),
            data.dtype(),
            stored.dtype
        ));
    }
    Ok(Stored {
        dtype: stored.dtype,
        dims,
        bytes: Bytes::Owned(data.into_bytes().to_vec()),
    })
}

/// The bytes a stored tensor takes whole.
pub(super) fn stored_len(stored: &Stored<'_>) -> u64 {
    (stored.dims.iter().product::<usize>() * stored.dtype.size()) as u64
}

/// The `rows × cols` row-major matrix of `elem`-byte elements, transposed.
pub(in crate::dropin) fn transpose(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (s, t) = ((r * cols + c) * elem, (c * rows + r) * elem);
            out[t..t + elem].copy_from_slice(&bytes[s..s + elem]);
        }
    }
    out
}
