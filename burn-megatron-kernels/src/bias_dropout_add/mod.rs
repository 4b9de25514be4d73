//! Bias + dropout + residual add: `residual + dropout(x + bias)`, with a dropout mask that is a
//! pure function of (seed, flat index). The mask is never stored: the backward recomputes it
//! from the seed, so the only state kept for backward is two scalars.
//!
//! # The mask
//!
//! Element `i` (row-major flat index, `i < 2³²`) is kept iff
//! `dropout_hash(seed, i) >= dropout_threshold(prob)`, where `dropout_threshold(prob)` is
//! `round(prob · 2³²)` clamped to `[0, 2³² − 1]`, so the keep probability is
//! `1 − threshold / 2³²` (within 2⁻³² of `1 − prob`). The hash uses only u32 arithmetic (WGSL has
//! no u64): the seed is split into halves `lo`, `hi` and mixed with murmur3's `fmix32`:
//!
//! ```text
//! k1 = fmix32(lo ^ fmix32(hi ^ 0x9E3779B9))
//! k2 = fmix32(k1 + 0x7F4A7C15)
//! hash(i) = fmix32(fmix32(i ^ k1) + k2)          (+ wraps mod 2³²)
//! ```
//!
//! The host function [`dropout_hash`] and the kernel's copy are tested bit for bit.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;

/// The kernels' dropout hash, for other kernels that drop as [`dropout`] does.
#[cfg(feature = "cube")]
pub(crate) use cube::dropout_hash as kernel_dropout_hash;

use crate::KernelError;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::tensor::{Bool, Device, Tensor, TensorData};

/// murmur3's 32-bit finaliser: a bijection of u32 in which every input bit flips each output
/// bit with probability about ½.
pub(crate) const fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

/// The dropout hash of flat index `index` under `seed` (see the module docs for the formula).
pub fn dropout_hash(seed: u64, index: u32) -> u32 {
    hash_with_keys(dropout_keys(seed), index)
}

/// `(k1, k2)` of `seed`: the part of the hash that does not depend on the index.
pub(crate) fn dropout_keys(seed: u64) -> (u32, u32) {
    let (lo, hi) = (seed as u32, (seed >> 32) as u32);
    let k1 = fmix32(lo ^ fmix32(hi ^ 0x9E37_79B9));
    (k1, fmix32(k1.wrapping_add(0x7F4A_7C15)))
}

/// The hash of `index` under the keys of [`dropout_keys`].
#[inline(always)]
pub(crate) fn hash_with_keys((k1, k2): (u32, u32), index: u32) -> u32 {
    fmix32(fmix32(index ^ k1).wrapping_add(k2))
}

/// `round(prob · 2³²)` clamped to u32: hashes below it are dropped. `prob` in `[0, 1)`.
pub fn dropout_threshold(prob: f32) -> u32 {
    (f64::from(prob) * 4_294_967_296.0)
        .round()
        .clamp(0.0, f64::from(u32::MAX)) as u32
}

/// Whether dropout with probability `prob` keeps flat element `index` under `seed`.
pub fn dropout_keep(seed: u64, index: u32, prob: f32) -> bool {
    dropout_hash(seed, index) >= dropout_threshold(prob)
}

/// The keep mask (true = kept) of a tensor of `shape` under `seed`, built on the host and
/// uploaded to `device`: the mask every backend's [`bias_dropout_add`] applies.
pub fn dropout_mask<const D: usize>(
    seed: u64,
    shape: [usize; D],
    prob: f32,
    device: &Device,
) -> Tensor<D, Bool> {
    let n = shape.iter().product();
    Tensor::from_data(
        TensorData::new(keep_values(seed, n, prob, MaskWindow::WHOLE), shape),
        device,
    )
}

fn keep_values(seed: u64, n: usize, prob: f32, window: MaskWindow) -> Vec<bool> {
    (0..n)
        .map(|i| dropout_keep(seed, window.index(i as u64) as u32, prob))
        .collect()
}

/// Where a tensor's elements sit in a larger tensor whose dropout mask they take, so that a
/// computation split into blocks (the chunked attention's query chunks) drops exactly the
/// elements the whole computation would.
///
/// The tensor is read as `[outer, rows, cols]` (its trailing `rows · cols` elements per outer
/// index), the block at rows `row0..row0 + rows` and columns `0..cols` of a larger
/// `[outer, total_rows, total_cols]` tensor: element `(o, r, c)` takes the mask of the larger
/// tensor's flat index `(o · total_rows + row0 + r) · total_cols + c`. [`MaskWindow::WHOLE`]
/// maps every index to itself.
///
/// ```
/// use burn_megatron_kernels::MaskWindow;
/// // Rows 2..4, columns 0..3 of a [_, 8, 5] tensor.
/// let w = MaskWindow { rows: 2, cols: 3, total_rows: 8, total_cols: 5, row0: 2 };
/// assert_eq!(w.index(0), 10); // (0, 0, 0) → (0, 2, 0)
/// assert_eq!(w.index(4), 16); // (0, 1, 1) → (0, 3, 1)
/// assert_eq!(w.index(6), 50); // (1, 0, 0) → (1, 2, 0)
/// assert_eq!(MaskWindow::WHOLE.index(7), 7);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskWindow {
    /// Rows of the block.
    pub rows: usize,
    /// Columns of the block (its first `cols` columns of the larger tensor).
    pub cols: usize,
    /// Rows of the larger tensor per outer index.
    pub total_rows: usize,
    /// Columns of the larger tensor.
    pub total_cols: usize,
    /// The block's first row.
    pub row0: usize,
}

impl MaskWindow {
    /// The tensor is the whole of the masked tensor.
    pub const WHOLE: Self = Self {
        rows: 1,
        cols: 1,
        total_rows: 1,
        total_cols: 1,
        row0: 0,
    };

    /// Whether this is [`MaskWindow::WHOLE`] in effect (every index maps to itself).
    pub fn is_whole(&self) -> bool {
        self.row0 == 0 && self.cols == self.total_cols && self.rows == self.total_rows
    }

    /// The larger tensor's flat index of the block's flat element `t`.
    pub fn index(&self, t: u64) -> u64 {
        let (cols, rows) = (self.cols.max(1) as u64, self.rows.max(1) as u64);
        let (row, c) = (t / cols, t % cols);
        let (o, r) = (row / rows, row % rows);
        (o * self.total_rows as u64 + self.row0 as u64 + r) * self.total_cols as u64 + c
    }
}

/// Bias + dropout + residual add as backend ops: one kernel on Cube backends, Burn's own ops
/// elsewhere. Callers validate the arguments (see [`bias_dropout_add`]).
///
/// The bias is a tensor plus a flag rather than an `Option`: `#[backend_extension]` in Burn
/// 0.22.1 routes only plain tensor arguments (an `Option` reaches the backend still wrapped as
/// a dispatch tensor). Without a bias, pass any tensor of the device (e.g. `x`): it is not read.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait BiasDropoutAddOps: Backend {
    /// `residual + dropout(x + bias)`; `bias` (read only when `has_bias`) has the size of
    /// `x`'s last dimension, `prob` is in `[0, 1)`, the mask comes from `seed`.
    fn bias_dropout_add(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        has_bias: bool,
        residual: FloatTensor<Self>,
        prob: f32,
        seed: u64,
    ) -> FloatTensor<Self>;
    /// Plain dropout of `v` with `seed`'s mask, each element taking the mask of its index under
    /// `window` ([`MaskWindow::WHOLE`]: its own). Dropout is linear and self-adjoint, so this
    /// is also its own backward and the backward of [`Self::bias_dropout_add`] with respect to
    /// `x + bias`.
    fn dropout(v: FloatTensor<Self>, prob: f32, seed: u64, window: MaskWindow)
    -> FloatTensor<Self>;
}

/// `1 / (1 − prob)`, the scale of kept values, in f32 as every backend applies it.
pub(crate) fn keep_scale(prob: f32) -> f32 {
    1.0 / (1.0 - prob)
}

/// The reference dropout from Burn ops: the host mask (of `window`'s indices) uploaded as a
/// bool tensor, then `mask_fill(v · scale, dropped, 0)`. `prob == 0` returns `v` unchanged.
pub fn reference_dropout<B: Backend>(
    v: FloatTensor<B>,
    prob: f32,
    seed: u64,
    window: MaskWindow,
) -> FloatTensor<B> {
    if prob == 0.0 {
        return v;
    }
    let shape = v.shape();
    let dropped: Vec<bool> = keep_values(seed, shape.num_elements(), prob, window)
        .into_iter()
        .map(|keep| !keep)
        .collect();
    let mask = B::bool_from_data(TensorData::new(dropped, shape), &v.device());
    let scaled = B::float_mul_scalar(v, keep_scale(prob).into());
    B::float_mask_fill(scaled, mask, 0.0f32.into())
}

/// The reference forward from Burn ops: `residual + reference_dropout(x + bias)` (no bias
/// unless `has_bias`).
pub fn reference_bias_dropout_add<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    has_bias: bool,
    residual: FloatTensor<B>,
    prob: f32,
    seed: u64,
) -> FloatTensor<B> {
    let v = if has_bias {
        crate::ops::add_last_dim::<B>(x, bias)
    } else {
        x
    };
    B::float_add(
        residual,
        reference_dropout::<B>(v, prob, seed, MaskWindow::WHOLE),
    )
}

impl BiasDropoutAddOps for Flex {
    fn bias_dropout_add(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        has_bias: bool,
        residual: FloatTensor<Self>,
        prob: f32,
        seed: u64,
    ) -> FloatTensor<Self> {
        flex::bias_dropout_add(x, bias, has_bias, residual, prob, seed)
    }

    fn dropout(
        v: FloatTensor<Self>,
        prob: f32,
        seed: u64,
        window: MaskWindow,
    ) -> FloatTensor<Self> {
        flex::dropout(v, prob, seed, window)
    }
}

/// `residual + dropout(x + bias)`, fused into one kernel on Cube backends and differentiable
/// (the mask is recomputed from `seed` in the backward, never stored).
///
/// Dropout keeps each element with probability `1 − prob` and scales kept values by
/// `1 / (1 − prob)`; which elements are kept is a pure function of `seed` and the flat
/// row-major index (see [`dropout_keep`]), identical on every call and every backend.
/// `prob == 0` means no dropout. The bias, if any, is broadcast over the last dimension.
///
/// # Errors
///
/// [`KernelError::Argument`] unless `0 ≤ prob < 1`; [`KernelError::Shape`] when `residual`'s
/// shape differs from `x`'s or `bias` is not `[last dim of x]`; [`KernelError::Unsupported`]
/// for tensors of more than 2³² elements (the mask index is 32-bit).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::{bias_dropout_add, dropout_mask};
/// let device = Device::flex();
/// let x = Tensor::<2>::ones([2, 3], &device);
/// let b = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device);
/// let r = Tensor::<2>::zeros([2, 3], &device);
/// let y = bias_dropout_add(x.clone(), Some(b.clone()), r, 0.5, 7).unwrap();
/// let kept = dropout_mask(7, [2, 3], 0.5, &device);
/// let expected = (x + b.unsqueeze()).mul_scalar(2.0).mask_fill(kept.bool_not(), 0.0);
/// y.into_data().assert_eq(&expected.into_data(), true);
/// ```
pub fn bias_dropout_add<const D: usize>(
    x: Tensor<D>,
    bias: Option<Tensor<1>>,
    residual: Tensor<D>,
    prob: f32,
    seed: u64,
) -> Result<Tensor<D>, KernelError> {
    check(&x.dims(), prob)?;
    let dims = x.dims();
    if residual.dims() != dims {
        return Err(KernelError::Shape(format!(
            "residual {:?} must have the shape of x {dims:?}",
            residual.dims()
        )));
    }
    if let Some(bias) = &bias
        && (D == 0 || bias.dims() != [dims[D - 1]])
    {
        return Err(KernelError::Shape(format!(
            "bias {:?} must be [last dim of x {dims:?}]",
            bias.dims()
        )));
    }
    let has_bias = bias.is_some();
    // Without a bias, x stands in for it (not read, no copy).
    let bias = bias.map_or_else(|| x.clone().into_dispatch(), Tensor::into_dispatch);
    Ok(Tensor::from_dispatch(Dispatch::bias_dropout_add(
        x.into_dispatch(),
        bias,
        has_bias,
        residual.into_dispatch(),
        prob,
        seed,
    )))
}

/// The arguments every dropout op refuses: a probability outside `[0, 1)`, more elements than
/// the 32-bit mask index covers.
fn check(dims: &[usize], prob: f32) -> Result<(), KernelError> {
    if !(0.0..1.0).contains(&prob) {
        return Err(KernelError::Argument(format!(
            "dropout probability must be in [0, 1), got {prob}"
        )));
    }
    if dims.iter().product::<usize>() as u64 > 1 << 32 {
        return Err(KernelError::Unsupported(format!(
            "dropout over {dims:?}: more than 2^32 elements (the mask index is 32-bit)"
        )));
    }
    Ok(())
}

/// Dropout with the mask of [`dropout_keep`] (a pure function of `seed` and the flat index),
/// one element-wise kernel on Cube backends, differentiable (the backward regenerates the
/// mask from the seed; nothing is stored). Kept values are scaled by `1 / (1 − prob)`;
/// `prob == 0` returns `x` unchanged. For attention probabilities and other dropouts without
/// a bias or residual to fuse.
///
/// # Errors
///
/// As [`bias_dropout_add`]: [`KernelError::Argument`] unless `0 ≤ prob < 1`,
/// [`KernelError::Unsupported`] beyond 2³² elements.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::{dropout, dropout_mask};
/// let device = Device::flex();
/// let x = Tensor::<2>::ones([2, 3], &device);
/// let y = dropout(x.clone(), 0.5, 7).unwrap();
/// let expected = x.mul_scalar(2.0).mask_fill(dropout_mask(7, [2, 3], 0.5, &device).bool_not(), 0.0);
/// y.into_data().assert_eq(&expected.into_data(), true);
/// ```
pub fn dropout<const D: usize>(
    x: Tensor<D>,
    prob: f32,
    seed: u64,
) -> Result<Tensor<D>, KernelError> {
    check(&x.dims(), prob)?;
    Ok(Tensor::from_dispatch(Dispatch::dropout(
        x.into_dispatch(),
        prob,
        seed,
        MaskWindow::WHOLE,
    )))
}
