//! The local parts of vocab-parallel cross-entropy over this rank's `[N, V]` slice of the
//! logits, to be called around the cross-entropy's all-reduces.
//!
//! The forward is one fused pass, [`cross_entropy_row_stats`]: per row the local max `m_l`,
//! `Σ_v exp(z − m_l)`, the raw target logit and the raw sum of logits. The caller
//! all-reduces (max) `m_l` into `M`, then all-reduces (sum) `Σ exp(z − m_l)·exp(m_l − M)` with
//! the raw sums in one packed buffer (the online-softmax identity: `Σ_v exp(z − M)` over every
//! rank, without a second walk over the logits).
//!
//! The backward, [`cross_entropy_backward`], recomputes the softmax from `logits`, `max` and
//! `sum_exp`, so the forward need not keep an `[N, V]` f32 softmax alive.
//!
//! All reductions accumulate in f32 whatever the logits' dtype.

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;
#[cfg(feature = "cube")]
mod kernels;
mod reference;

pub use reference::{reference_cross_entropy_backward, reference_cross_entropy_row_stats};

use crate::KernelError;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{Int, Tensor};

/// Label smoothing of the backward: `ε` and the size of the *global* vocabulary over which the
/// smoothing mass `ε / V_global` is spread (all ranks' slices together, or the real entries of
/// a vocabulary padded beyond them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LabelSmoothing {
    /// `ε` in `[0, 1)`; 0 is plain cross-entropy.
    pub epsilon: f32,
    /// The global vocabulary size `V_global` (`V · tp` under tensor parallelism, less any
    /// padding).
    pub global_vocab: usize,
}

/// The local cross-entropy passes as backend ops: CubeCL kernels (one cube per row) on Cube
/// backends, Burn's own ops elsewhere. Not differentiable themselves: the cross-entropy's
/// autodiff owns the backward and calls [`CrossEntropyOps::cross_entropy_backward`].
///
/// Shapes: `logits` `[N, V]` (any float dtype); `max`, `sum_exp`, `in_range`, `grad` `[N]`
/// f32;
/// `target` `[N]` Int, the local column of each row's target, which must lie in `[0, V)`
/// on every row (any valid column, e.g. 0, where `in_range` is 0). The methods do not
/// validate; the public functions on [`Tensor`] do.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait CrossEntropyOps: Backend {
    /// `[N, 4]` f32 rows `(m, Σ_v exp(logits[n, v] − m), logits[n, target]·in_range,
    /// Σ_v logits[n, v])` with `m = max_v logits[n, v]`: the whole local forward in one pass
    /// over the logits. A row of −∞ has `m = −∞` and a sum of exps of 0.
    fn cross_entropy_row_stats(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `(softmax − (1 − ε)·one_hot·in_range − ε / V_global) · grad`, `[N, V]` in the logits'
    /// dtype, with `softmax = exp(logits − max) / sum_exp`.
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum_exp: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        smoothing: LabelSmoothing,
    ) -> FloatTensor<Self>;
}

impl CrossEntropyOps for Flex {
    fn cross_entropy_row_stats(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        flex::row_stats(logits, target, in_range)
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum_exp: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        smoothing: LabelSmoothing,
    ) -> FloatTensor<Self> {
        flex::backward(logits, max, sum_exp, target, in_range, grad, smoothing)
    }
}

/// `[N, V]` logits with a non-empty vocabulary slice; returns `N`.
fn check_logits(logits: &Tensor<2>) -> Result<usize, KernelError> {
    let [n, v] = logits.dims();
    if v == 0 {
        return Err(KernelError::Shape(format!(
            "cross-entropy needs a non-empty vocabulary slice, logits are [{n}, 0]"
        )));
    }
    if !logits.dtype().is_float() {
        return Err(KernelError::Argument(format!(
            "logits must be a float tensor, got {:?}",
            logits.dtype()
        )));
    }
    Ok(n)
}

/// Every `[N]` per-row input has `n` entries.
fn check_rows(n: usize, named: &[(&str, [usize; 1])]) -> Result<(), KernelError> {
    match named.iter().find(|(_, [len])| *len != n) {
        Some((name, [len])) => Err(KernelError::Shape(format!(
            "{name} has {len} entries but the logits have {n} rows"
        ))),
        None => Ok(()),
    }
}

/// The local forward of vocab-parallel cross-entropy in one pass over `[N, V]` logits (any
/// float dtype): `[N, 4]` f32 rows `(m, Σ_v exp(logits[n, v] − m), logits[n, target[n]] ·
/// in_range[n], Σ_v logits[n, v])`, `m` the row's max (a row of −∞: `m = −∞`, sum 0).
/// `target` is the local column (in `[0, V)` on every row); `in_range` 1 where the target
/// lies in this slice, else 0. Accumulates in f32. Errors on an empty vocabulary slice or
/// mismatched row counts.
///
/// Across ranks: `M = max_r m_r`, `Σ_r exp(m_r − M)·sum_r` is the global `Σ exp(z − M)`,
/// and the raw target logit and sum of logits add up directly.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use burn_megatron_kernels::cross_entropy_row_stats;
/// let d = Device::flex();
/// let logits = Tensor::<2>::from_floats([[0.0, 0.0], [1.0, 3.0]], &d);
/// let target = Tensor::<1, Int>::from_ints([1, 0], &d);
/// let in_range = Tensor::<1>::from_floats([1.0, 0.0], &d);
/// let stats = cross_entropy_row_stats(logits, target, in_range).unwrap();
/// let s: Vec<f32> = stats.into_data().to_vec().unwrap();
/// let e = (-2.0f32).exp();
/// assert_eq!(&s[..4], [0.0, 2.0, 0.0, 0.0]);
/// assert!(s[4] == 3.0 && (s[5] - (1.0 + e)).abs() < 1e-6 && s[6] == 0.0 && s[7] == 4.0);
/// ```
pub fn cross_entropy_row_stats(
    logits: Tensor<2>,
    target: Tensor<1, Int>,
    in_range: Tensor<1>,
) -> Result<Tensor<2>, KernelError> {
    let n = check_logits(&logits)?;
    check_rows(
        n,
        &[("target", target.dims()), ("in_range", in_range.dims())],
    )?;
    Ok(Tensor::from_dispatch(Dispatch::cross_entropy_row_stats(
        logits.into_dispatch(),
        target.into_dispatch(),
        in_range.into_dispatch(),
    )))
}

/// The gradient of the smoothed cross-entropy with respect to this rank's logits:
/// `(softmax − (1 − ε)·one_hot·in_range − ε / V_global) · grad[n]`, `[N, V]` in the logits'
/// dtype, the softmax recomputed from `logits`, the all-reduced `max` and `sum_exp`.
/// `grad` is the `[N]` gradient of the per-token losses.
pub fn cross_entropy_backward(
    logits: Tensor<2>,
    max: Tensor<1>,
    sum_exp: Tensor<1>,
    target: Tensor<1, Int>,
    in_range: Tensor<1>,
    grad: Tensor<1>,
    smoothing: LabelSmoothing,
) -> Result<Tensor<2>, KernelError> {
    let n = check_logits(&logits)?;
    let rows = [
        ("max", max.dims()),
        ("sum_exp", sum_exp.dims()),
        ("target", target.dims()),
        ("in_range", in_range.dims()),
        ("grad", grad.dims()),
    ];
    check_rows(n, &rows)?;
    let LabelSmoothing {
        epsilon,
        global_vocab,
    } = smoothing;
    if !(0.0..1.0).contains(&epsilon) {
        return Err(KernelError::Argument(format!(
            "label smoothing must be in [0, 1), got {epsilon}"
        )));
    }
    let local = logits.dims()[1];
    if global_vocab < local {
        return Err(KernelError::Argument(format!(
            "global vocabulary {global_vocab} is smaller than the local slice {local}"
        )));
    }
    Ok(Tensor::from_dispatch(Dispatch::cross_entropy_backward(
        logits.into_dispatch(),
        max.into_dispatch(),
        sum_exp.into_dispatch(),
        target.into_dispatch(),
        in_range.into_dispatch(),
        grad.into_dispatch(),
        smoothing,
    )))
}
