//! Flash attention: the whole attention of a block of query rows in one kernel, forward and
//! backward, keeping only each row's log-sum-exp (f32) between them.
//!
//! It computes what [`chunked_attention`](super::chunked_attention) computes with
//! `query_chunk` = [`FLASH_QUERY_BLOCK`]: grouped-query attention with the key/value heads
//! read in place, the bottom-right aligned causal mask (each block of rows multiplies the
//! keys up to its last row's position), a key-padding mask, masked scores at −10000, and
//! dropout on the probabilities replayed from the hash of each element's index in the whole
//! `[b, heads, sq, sk]` tensor (the mask [`dropout`](crate::dropout) draws). Unlike the
//! composition, scores, probabilities and their gradients never exist as tensors: the
//! softmax runs online over tiles of keys, in f32 whatever the inputs' dtype, and the
//! backward replays the probabilities from the saved log-sum-exp.
//!
//! On the Cube backends (CUDA, wgpu) these are CubeCL kernels: on tensor cores
//! (`tensor_core.rs`, CubeCL's `cmma`) for f16 and bf16 with head dimensions a multiple of 16
//! up to 128 where the device has 16 × 16 × 16 matrix instructions, else one unit per row with
//! the products on the FMA units (`cube.rs`); `launch.rs` picks and launches them.
//! [`FlashKernels`] (`BURN_MEGATRON_FLASH`) chooses, [`flash_launches`] counts which ran.
//! Elsewhere the same op runs the chunked schedule, which computes the same values.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
#[cfg(feature = "cube")]
mod launch;
#[cfg(feature = "cuda")]
mod sources;
#[cfg(feature = "cube")]
mod tensor_core;

#[cfg(feature = "cuda")]
pub use sources::{FlashSource, NvrtcReport, flash_cuda_sources, nvrtc_compile_sm90};

use super::{AttentionParams, ChunkedAttentionOps, check, chunked};
use crate::KernelError;
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Dispatch, Flex, backend_extension};
use burn::tensor::{Bool, DType, Tensor};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// Query rows per block of [`flash_attention`]: each kernel's cube serves this many rows (or
/// keys), and under a causal mask a block of rows multiplies the keys up to its last row.
pub const FLASH_QUERY_BLOCK: usize = 32;

/// The largest head dimension [`flash_attention`] takes: each unit holds up to four rows of
/// this many f32 values.
pub const FLASH_MAX_HEAD_DIM: usize = 256;

/// The environment variable that picks the flash kernels on the Cube backends: `auto`,
/// `scalar` or `emulated` (see [`FlashKernels`]); unset, `auto`.
pub const FLASH_VAR: &str = "BURN_MEGATRON_FLASH";

/// Which flash kernels run on the Cube backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernels {
    /// The tensor-core kernels where they serve (f16 or bf16, head dimension a multiple of
    /// 16 up to 128, a device with 16 × 16 × 16 matrix instructions and the shared memory),
    /// the scalar ones elsewhere.
    Auto,
    /// The scalar kernels (a unit per row, products on the FMA units) everywhere.
    Scalar,
    /// The tensor-core kernels' schedule with the matrix products done by the planes' units
    /// one element at a time, where the head dimension and shared memory allow (any dtype,
    /// no matrix instructions needed): how the schedule is checked on devices without them.
    Emulated,
}

/// 0: as [`FLASH_VAR`] says; else 1 + the [`FlashKernels`] index.
static CHOICE: AtomicU8 = AtomicU8::new(0);

thread_local! {
    /// This thread's override of [`CHOICE`] (0: none), see [`flash_kernels_on_this_thread`].
    static THREAD_CHOICE: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

fn code(choice: Option<FlashKernels>) -> u8 {
    match choice {
        None => 0,
        Some(FlashKernels::Auto) => 1,
        Some(FlashKernels::Scalar) => 2,
        Some(FlashKernels::Emulated) => 3,
    }
}

/// Overrides [`FLASH_VAR`] for the rest of the process (`None`: back to it), so that a
/// benchmark compares the kernels in one process (ranks as threads included).
pub fn set_flash_kernels(choice: Option<FlashKernels>) {
    CHOICE.store(code(choice), Ordering::Relaxed);
}

/// Overrides the kernels for the attention this thread runs, forward and backward, until the
/// guard drops; other threads keep theirs. A test checks one path this way without
/// changing what the tests beside it run.
///
/// ```
/// use burn_megatron_kernels::{FlashKernels, flash_kernels, flash_kernels_on_this_thread};
/// {
///     let _scalar = flash_kernels_on_this_thread(FlashKernels::Scalar);
///     assert_eq!(flash_kernels(), FlashKernels::Scalar);
/// }
/// ```
pub fn flash_kernels_on_this_thread(choice: FlashKernels) -> FlashKernelsGuard {
    let previous = THREAD_CHOICE.with(|c| c.replace(code(Some(choice))));
    FlashKernelsGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the thread's earlier choice when dropped (see [`flash_kernels_on_this_thread`]).
#[derive(Debug)]
#[must_use = "the override ends when the guard drops"]
pub struct FlashKernelsGuard {
    previous: u8,
    /// The override is the creating thread's: the guard must drop there.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for FlashKernelsGuard {
    fn drop(&mut self) {
        THREAD_CHOICE.with(|c| c.set(self.previous));
    }
}

/// The kernels in use: this thread's override ([`flash_kernels_on_this_thread`]), else
/// [`set_flash_kernels`]'s choice, else [`FLASH_VAR`]'s (read once; an unknown value is
/// `Auto`, said once on stderr).
pub fn flash_kernels() -> FlashKernels {
    static FROM_ENV: OnceLock<FlashKernels> = OnceLock::new();
    let choice = match THREAD_CHOICE.with(std::cell::Cell::get) {
        0 => CHOICE.load(Ordering::Relaxed),
        mine => mine,
    };
    match choice {
        1 => FlashKernels::Auto,
        2 => FlashKernels::Scalar,
        3 => FlashKernels::Emulated,
        _ => *FROM_ENV.get_or_init(|| match std::env::var(FLASH_VAR).as_deref() {
            Err(_) | Ok("") | Ok("auto") => FlashKernels::Auto,
            Ok("scalar") => FlashKernels::Scalar,
            Ok("emulated") => FlashKernels::Emulated,
            Ok(other) => {
                eprintln!("{FLASH_VAR}={other}: expected auto, scalar or emulated; using auto");
                FlashKernels::Auto
            }
        }),
    }
}

/// Which flash kernels ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
pub(crate) enum KernelPath {
    Scalar,
    TensorCores,
    Emulated,
    Composed,
}

static LAUNCHES: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Flash attention calls (forward or backward), by the code that served them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlashLaunches {
    /// The scalar kernels.
    pub scalar: u64,
    /// The tensor-core kernels.
    pub tensor_cores: u64,
    /// The tensor-core schedule, emulated ([`FlashKernels::Emulated`]).
    pub emulated: u64,
    /// The chunked schedule of backend ops (backends without the kernels: Flex).
    pub composed: u64,
}

thread_local! {
    static THREAD_LAUNCHES: std::cell::Cell<FlashLaunches> = const {
        std::cell::Cell::new(FlashLaunches { scalar: 0, tensor_cores: 0, emulated: 0, composed: 0 })
    };
}

pub(crate) fn count_launch(path: KernelPath) {
    LAUNCHES[path as usize].fetch_add(1, Ordering::Relaxed);
    THREAD_LAUNCHES.with(|c| {
        let mut n = c.get();
        match path {
            KernelPath::Scalar => n.scalar += 1,
            KernelPath::TensorCores => n.tensor_cores += 1,
            KernelPath::Emulated => n.emulated += 1,
            KernelPath::Composed => n.composed += 1,
        }
        c.set(n);
    });
}

/// The flash calls this process ran.
pub fn flash_launches() -> FlashLaunches {
    let n = |p: KernelPath| LAUNCHES[p as usize].load(Ordering::Relaxed);
    FlashLaunches {
        scalar: n(KernelPath::Scalar),
        tensor_cores: n(KernelPath::TensorCores),
        emulated: n(KernelPath::Emulated),
        composed: n(KernelPath::Composed),
    }
}

/// [`flash_launches`] of the calling thread (a rank, when ranks are threads; a test).
pub fn thread_flash_launches() -> FlashLaunches {
    THREAD_LAUNCHES.with(|c| c.get())
}

/// Flash attention as backend ops, for `q` `[b, heads, sq, d]`, `k` and `v` `[b, groups, sk,
/// d]` and `key_padding` `[b, sk]` (read only when `padded`). The methods do not validate;
/// [`flash_attention`] does. `params.query_chunk` is not read: the blocks are
/// [`FLASH_QUERY_BLOCK`] rows.
///
/// The default bodies run the chunked schedule (and its log-sum-exp from the same
/// products); the Cube backends override them with the kernels; autodiff keeps the inputs,
/// the output and the log-sum-exp for one backward node.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait FlashAttentionOps: ChunkedAttentionOps {
    /// `(output [b, heads, sq, d], log-sum-exp [b, heads, sq] in f32)`.
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        count_launch(KernelPath::Composed);
        let params = blocks(params);
        let lse =
            chunked::log_sum_exp::<Self>(q.clone(), k.clone(), key_padding.clone(), padded, params);
        let out = chunked::forward::<Self>(q, k, v, key_padding, padded, params);
        (out, lse)
    }

    /// `(dq, dk, dv)` for the output gradient `grad`, from the forward's output `out` and
    /// log-sum-exp `lse` (f32): `P = exp(S − lse)` and `D = rowsum(grad ∘ out)`. Given the
    /// statistics of a larger attention whose keys include these (ring attention's merged
    /// output and log-sum-exp), the results are that attention's gradients through these keys.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: BoolTensor<Self>,
        padded: bool,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        params: AttentionParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        count_launch(KernelPath::Composed);
        chunked::backward_from_stats::<Self>(
            q,
            k,
            v,
            key_padding,
            padded,
            out,
            lse,
            grad,
            blocks(params),
        )
    }
}

impl FlashAttentionOps for Flex {}

/// `params` with the flash kernels' blocks.
fn blocks(params: AttentionParams) -> AttentionParams {
    AttentionParams {
        query_chunk: FLASH_QUERY_BLOCK,
        ..params
    }
}

/// Flash attention of `q` (`[b, heads, sq, d]`) over `k` and `v` (`[b, groups, sk, d]`,
/// `groups` dividing `heads`), differentiable with respect to all three; see the module docs
/// for what it computes. `params.query_chunk` is not read.
///
/// # Errors
///
/// As [`chunked_attention`](super::chunked_attention), and [`KernelError::Unsupported`] for
/// a head dimension above [`FLASH_MAX_HEAD_DIM`].
///
/// ```
/// use burn::tensor::{Device, Tensor, TensorData};
/// use burn_megatron_kernels::{AttentionParams, chunked_attention, flash_attention};
/// let device = Device::flex();
/// let t = |h| Tensor::<4>::from_data(
///     TensorData::new((0..h * 6 * 4).map(|i| (i as f32 * 0.37).sin()).collect(), [1, h, 6, 4]),
///     &device,
/// );
/// let (q, k, v) = (t(2), t(1), t(1)); // two query heads sharing one key/value head
/// let params = AttentionParams { causal: true, ..AttentionParams::new(0.5) };
/// let flash = flash_attention(q.clone(), k.clone(), v.clone(), None, params).unwrap();
/// let chunked = chunked_attention(q, k, v, None, params).unwrap();
/// flash.into_data().assert_approx_eq::<f32>(&chunked.into_data(), Default::default());
/// ```
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_padding: Option<Tensor<2, Bool>>,
    params: AttentionParams,
) -> Result<Tensor<4>, KernelError> {
    flash_attention_with_lse(q, k, v, key_padding, params).map(|(out, _)| out)
}

/// [`flash_attention`] and each query row's log-sum-exp of its scaled, masked scores
/// (`[b, heads, sq]`, f32, not differentiable): what a caller merging attention over several
/// key blocks (ring attention) needs.
///
/// # Errors
///
/// As [`flash_attention`].
pub fn flash_attention_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_padding: Option<Tensor<2, Bool>>,
    params: AttentionParams,
) -> Result<(Tensor<4>, Tensor<3>), KernelError> {
    check(&q, &k, &v, key_padding.as_ref(), &params)?;
    let d = q.dims()[3];
    if d > FLASH_MAX_HEAD_DIM {
        return Err(KernelError::Unsupported(format!(
            "flash attention takes head dimensions up to {FLASH_MAX_HEAD_DIM}, got {d}"
        )));
    }
    let padded = key_padding.is_some();
    // The unread stand-in when there is no padding: one element, never a zero-size buffer.
    let key_padding = key_padding.unwrap_or_else(|| Tensor::<2, Bool>::empty([1, 1], &q.device()));
    let (out, lse) = Dispatch::flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        key_padding.into_dispatch(),
        padded,
        params,
    );
    Ok((Tensor::from_dispatch(out), Tensor::from_dispatch(lse)))
}

/// The gradients `(dq, dk, dv)` of attention over `k` and `v` for the output gradient `grad`,
/// from the statistics of a forward: its output `out` (`q`'s shape and dtype) and each row's
/// log-sum-exp `lse` (`[b, heads, sq]`, f32; f64 for f64 inputs), as
/// [`flash_attention_with_lse`] returns them. A caller that merged several calls over
/// blocks of keys (ring attention) passes the merged output and log-sum-exp, and gets each
/// block's share of the whole attention's gradients. `params` (masks, dropout seed) must be
/// those of the forward over these keys. Not differentiable.
///
/// # Errors
///
/// As [`flash_attention`], and [`KernelError::Shape`] when `out`, `lse` or `grad` do not fit
/// `q`.
///
/// ```
/// use burn::tensor::{Device, Tensor, TensorData};
/// use burn_megatron_kernels::{AttentionParams, flash_attention_backward, flash_attention_with_lse};
/// let device = Device::flex();
/// let t = |s: usize, k: f32| Tensor::<4>::from_data(
///     TensorData::new((0..s * 4).map(|i| (i as f32 * k).sin()).collect(), [1, 1, s, 4]),
///     &device,
/// );
/// let (q, k, v, grad) = (t(3, 0.3), t(5, 0.7), t(5, 1.1), t(3, 1.3));
/// let params = AttentionParams::new(0.5);
/// let (out, lse) = flash_attention_with_lse(q.clone(), k.clone(), v.clone(), None, params).unwrap();
/// let (dq, dk, dv) = flash_attention_backward(q, k, v, None, out, lse, grad, params).unwrap();
/// assert_eq!((dq.dims(), dk.dims(), dv.dims()), ([1, 1, 3, 4], [1, 1, 5, 4], [1, 1, 5, 4]));
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    key_padding: Option<Tensor<2, Bool>>,
    out: Tensor<4>,
    lse: Tensor<3>,
    grad: Tensor<4>,
    params: AttentionParams,
) -> Result<(Tensor<4>, Tensor<4>, Tensor<4>), KernelError> {
    check(&q, &k, &v, key_padding.as_ref(), &params)?;
    let [b, heads, sq, d] = q.dims();
    if d > FLASH_MAX_HEAD_DIM {
        return Err(KernelError::Unsupported(format!(
            "flash attention takes head dimensions up to {FLASH_MAX_HEAD_DIM}, got {d}"
        )));
    }
    let stats = match q.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let fits = out.dims() == q.dims()
        && grad.dims() == q.dims()
        && out.dtype() == q.dtype()
        && grad.dtype() == q.dtype()
        && lse.dims() == [b, heads, sq]
        && lse.dtype() == stats;
    if !fits {
        return Err(KernelError::Shape(format!(
            "the flash backward needs out and grad as q ({:?}, {:?}) and lse [b, heads, sq] in {stats:?}: out {:?} {:?}, grad {:?} {:?}, lse {:?} {:?}",
            q.dims(),
            q.dtype(),
            out.dims(),
            out.dtype(),
            grad.dims(),
            grad.dtype(),
            lse.dims(),
            lse.dtype()
        )));
    }
    let padded = key_padding.is_some();
    let key_padding = key_padding.unwrap_or_else(|| Tensor::<2, Bool>::empty([1, 1], &q.device()));
    let (dq, dk, dv) = Dispatch::flash_attention_backward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        key_padding.into_dispatch(),
        padded,
        out.into_dispatch(),
        lse.into_dispatch(),
        grad.into_dispatch(),
        params,
    );
    Ok((
        Tensor::from_dispatch(dq),
        Tensor::from_dispatch(dk),
        Tensor::from_dispatch(dv),
    ))
}
