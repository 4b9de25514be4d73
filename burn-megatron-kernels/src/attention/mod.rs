//! Chunked attention: `softmax(mask(q·kᵀ · scale))·v` computed a block of query rows at a
//! time, with a handwritten backward that recomputes each block's probabilities, so that no
//! `[batch, heads, sq, sk]` tensor is kept between forward and backward, and none larger than
//! one block's `[batch, heads, chunk, sk]` is ever live.
//!
//! This is the memory schedule of flash attention at the level of whole operations: the
//! products stay the backend's batched matmul (strided-batched cuBLASLt on CUDA, tensor
//! cores at their full rate) and the softmax the fused masked-softmax kernel, instead of one
//! fused kernel per direction. What it costs against a fused kernel is each block's scores
//! written and read once more; what it saves over the unfused layer is the kept
//! probabilities (and their dropout), and under a causal mask the blocks of keys no query of
//! a chunk can see: they are never multiplied.
//!
//! # What it computes
//!
//! Exactly what the unfused composition computes (scores, [`scaled_masked_softmax`], dropout
//! with the mask of [`dropout`] over the whole `[b, heads, sq, sk]` probabilities, weighted
//! values), block by block:
//! - grouped-query attention: `q` has `heads` heads, `k` and `v` have `groups` (dividing
//!   `heads`); the heads of a group share its keys and values, which are never repeated in
//!   memory (each product runs per group over its heads' query rows);
//! - the causal mask is bottom-right aligned (`sq ≤ sk` queries are the last of the keys'
//!   positions); a chunk multiplies only the keys up to its last query's position;
//! - a key-padding mask `[b, sk]`;
//! - dropout on the probabilities, each element keeping or dropping as the whole tensor's
//!   element would ([`MaskWindow`]), so the result does not depend on the chunk size.
//!
//! With one chunk (`query_chunk ≥ sq`) the forward and the gradients are the unfused
//! composition's products, the same bits on Flex. With several, a row's probabilities are the
//! same, and the key and value gradients sum the chunks' contributions in f32.
//!
//! One difference: a query row whose every visible key is padded gets, in the unfused
//! composition, uniform weights over all `sk` keys (the masked score is a finite −10000);
//! here, under a causal mask, over the keys its chunk multiplies. Such rows are padding, which
//! a loss masks.
//!
//! [`scaled_masked_softmax`]: crate::scaled_masked_softmax
//! [`dropout`]: crate::dropout

mod autodiff;
mod chunked;
mod flash;

pub use flash::{
    FLASH_MAX_HEAD_DIM, FLASH_QUERY_BLOCK, FLASH_VAR, FlashAttentionOps, FlashKernels,
    FlashKernelsGuard, FlashLaunches, flash_attention, flash_attention_backward,
    flash_attention_with_lse, flash_kernels, flash_kernels_on_this_thread, flash_launches,
    set_flash_kernels, thread_flash_launches,
};
#[cfg(feature = "cuda")]
pub use flash::{FlashSource, NvrtcReport, flash_cuda_sources, nvrtc_compile_sm90};

use crate::{BiasDropoutAddOps, KernelError, LinearOps, MaskWindow, ScaledMaskedSoftmaxOps};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Dispatch, Flex, backend_extension};
use burn::tensor::{Bool, Tensor};

/// What [`chunked_attention`] computes besides its tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Multiplies the scores before the mask and softmax (`1/√head_dim` usually).
    pub scale: f32,
    /// Mask keys after each query's position (bottom-right aligned).
    pub causal: bool,
    /// Dropout probability on the attention probabilities, in `[0, 1)`; 0 for none.
    pub dropout: f32,
    /// The dropout mask's seed (see [`crate::dropout_keep`]).
    pub seed: u64,
    /// Query rows per block: the transient scores are `[b, heads, query_chunk, sk]`.
    pub query_chunk: usize,
}

impl AttentionParams {
    /// No mask, no dropout, the whole sequence as one block.
    pub fn new(scale: f32) -> Self {
        Self {
            scale,
            causal: false,
            dropout: 0.0,
            seed: 0,
            query_chunk: usize::MAX,
        }
    }
}

/// Chunked attention as backend ops, for `q` `[b, heads, sq, d]`, `k` and `v`
/// `[b, groups, sk, d]` and `key_padding` `[b, sk]` (read only when `padded`; otherwise any
/// bool tensor of the device). The methods do not validate; [`chunked_attention`] does.
///
/// Both are written once, as the default bodies, from the backend's batched matmul, masked
/// softmax and dropout ops (`chunked.rs`), so Flex and the Cube backends run the same
/// schedule; autodiff overrides them with one node for the whole attention.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait ChunkedAttentionOps: LinearOps + ScaledMaskedSoftmaxOps + BiasDropoutAddOps {
    /// The attention output, `[b, heads, sq, d]`.
    fn chunked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        params: AttentionParams,
    ) -> FloatTensor<Self> {
        chunked::forward::<Self>(q, k, v, key_padding, padded, params)
    }
    /// `(dq, dk, dv)` for the output gradient `grad`, each block's probabilities recomputed.
    fn chunked_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        grad: FloatTensor<Self>,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        chunked::backward::<Self>(q, k, v, key_padding, padded, grad, params)
    }
}

impl ChunkedAttentionOps for Flex {}

#[cfg(feature = "cube")]
impl ChunkedAttentionOps for burn_cubecl::CubeBackend {}

/// Attention of `q` (`[b, heads, sq, d]`) over `k` and `v` (`[b, groups, sk, d]`, `groups`
/// dividing `heads`) a block of `params.query_chunk` query rows at a time, differentiable with
/// respect to all three; see the module docs for what it computes and keeps.
///
/// # Errors
///
/// [`KernelError::Shape`] when the shapes or dtypes disagree (batch, head dim, groups not
/// dividing heads, `k` and `v` unequal, padding not `[b, sk]`, or a causal mask with more
/// queries than keys) or a dimension is empty; [`KernelError::Argument`] for a non-finite scale, a dropout outside
/// `[0, 1)` or a zero chunk; [`KernelError::Unsupported`] for dropout over more than 2³²
/// probabilities (the mask index is 32-bit).
///
/// ```
/// use burn::tensor::{Device, Tensor, TensorData};
/// use burn_megatron_kernels::{AttentionParams, chunked_attention};
/// let device = Device::flex();
/// let t = |h| Tensor::<4>::from_data(
///     TensorData::new((0..h * 6 * 4).map(|i| (i as f32 * 0.37).sin()).collect(), [1, h, 6, 4]),
///     &device,
/// );
/// let (q, k, v) = (t(2), t(1), t(1)); // two query heads sharing one key/value head
/// let one_block = AttentionParams { causal: true, ..AttentionParams::new(0.5) };
/// let whole = chunked_attention(q.clone(), k.clone(), v.clone(), None, one_block).unwrap();
/// let blocks = AttentionParams { query_chunk: 4, ..one_block };
/// let chunked = chunked_attention(q, k, v, None, blocks).unwrap();
/// whole.into_data().assert_approx_eq::<f32>(&chunked.into_data(), Default::default());
/// ```
pub fn chunked_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_padding: Option<Tensor<2, Bool>>,
    params: AttentionParams,
) -> Result<Tensor<4>, KernelError> {
    check(&q, &k, &v, key_padding.as_ref(), &params)?;
    let padded = key_padding.is_some();
    // The unread stand-in when there is no padding: one element, never a zero-size buffer.
    let key_padding = key_padding.unwrap_or_else(|| Tensor::<2, Bool>::empty([1, 1], &q.device()));
    Ok(Tensor::from_dispatch(Dispatch::chunked_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        key_padding.into_dispatch(),
        padded,
        params,
    )))
}

fn check(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    key_padding: Option<&Tensor<2, Bool>>,
    p: &AttentionParams,
) -> Result<(), KernelError> {
    let ([b, heads, sq, d], [kb, groups, sk, kd]) = (q.dims(), k.dims());
    let shapes = || format!("q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims());
    if v.dims() != k.dims() || kb != b || kd != d {
        return Err(KernelError::Shape(format!(
            "attention needs q [b, heads, sq, d] and k, v [b, groups, sk, d]: {}",
            shapes()
        )));
    }
    if [b, heads, sq, d, groups, sk].contains(&0) {
        return Err(KernelError::Shape(format!(
            "attention over an empty dimension: {}",
            shapes()
        )));
    }
    if !heads.is_multiple_of(groups) {
        return Err(KernelError::Shape(format!(
            "the key/value groups must divide the query heads: {}",
            shapes()
        )));
    }
    if q.dtype() != k.dtype() || k.dtype() != v.dtype() {
        return Err(KernelError::Shape(format!(
            "q, k and v must share a dtype: {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )));
    }
    if let Some(pad) = key_padding
        && pad.dims() != [b, sk]
    {
        return Err(KernelError::Shape(format!(
            "key padding {:?} must be [batch, sk] = {:?}",
            pad.dims(),
            [b, sk]
        )));
    }
    if p.causal && sq > sk {
        return Err(KernelError::Shape(format!(
            "a causal mask needs no more queries than keys: {}",
            shapes()
        )));
    }
    if !p.scale.is_finite() {
        return Err(KernelError::Argument(format!(
            "attention scale must be finite, got {}",
            p.scale
        )));
    }
    if !(0.0..1.0).contains(&p.dropout) {
        return Err(KernelError::Argument(format!(
            "attention dropout must be in [0, 1), got {}",
            p.dropout
        )));
    }
    if p.query_chunk == 0 {
        return Err(KernelError::Argument(
            "the query chunk must hold at least one row".into(),
        ));
    }
    if p.dropout > 0.0 && (b * heads * sq * sk) as u64 > 1 << 32 {
        return Err(KernelError::Unsupported(format!(
            "attention dropout over [{b}, {heads}, {sq}, {sk}] probabilities: more than 2^32 (the mask index is 32-bit)"
        )));
    }
    Ok(())
}

/// The dropout window of a chunk of `rows` query rows from `row0`, over its first `keys` keys,
/// in the whole `[b, heads, sq, sk]` probabilities.
fn window(row0: usize, rows: usize, keys: usize, sq: usize, sk: usize) -> MaskWindow {
    MaskWindow {
        rows,
        cols: keys,
        total_rows: sq,
        total_cols: sk,
        row0,
    }
}
