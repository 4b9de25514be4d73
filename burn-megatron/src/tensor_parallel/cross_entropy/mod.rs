//! Cross-entropy over logits whose vocabulary is split across tensor-parallel ranks.
//!
//! Each rank holds `[N, V / tp]` logits. The forward walks them once (one fused op: the local
//! row max `m_l`, `Σ exp(z − m_l)`, the target logit and the sum of logits), then needs two
//! all-reduces of `[N]` vectors, never the full logits: the max `M` of the `m_l`, and one
//! packed sum of `Σ exp(z − m_l)·exp(m_l − M)` (the online-softmax identity) with the target
//! logit, the sum of logits and the in-range flags. The backward is handwritten:
//! `(softmax − (1 − ε)·one_hot − ε / V) · grad`, with no communication.
//!
//! Label smoothing is over the *global* vocabulary (its real entries, where it is padded),
//! so the loss equals single-device smoothed cross-entropy at every TP size. (Megatron-LM's
//! own averages the smoothing term over the local partition only, which changes the loss
//! with the TP size: its issue #737.)

mod ops;

#[cfg(test)]
mod tests;

pub use burn_megatron_kernels::LabelSmoothing;
pub use ops::VocabParallelCrossEntropyOps;

use super::{TpError, vocab_range};
use crate::comm::Comm;
use burn::backend::Dispatch;
use burn::tensor::{Int, Tensor};

/// Per-token cross-entropy of `logits` (`[N, V / tp]`, this rank's vocabulary slice) against
/// `target` (`[N]`, global vocabulary ids), with label smoothing `label_smoothing` over the
/// global vocabulary. Returns `[N]` f32 losses, the same on every rank.
///
/// Flatten `[s, b, V / tp]` logits to `[s·b, V / tp]` first. Errors when the vocabulary
/// slice is empty or the smoothing is outside `[0, 1)`. A vocabulary padded to split (see
/// [`mask_vocab_padding`](super::mask_vocab_padding)) and smoothed takes
/// [`vocab_parallel_cross_entropy_padded`], which keeps the smoothing off the padding.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::tensor_parallel::vocab_parallel_cross_entropy;
/// use std::sync::Arc;
///
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let device = Device::flex();
/// let logits = Tensor::<2>::from_floats([[0.0, 0.0], [0.0, 10.0]], &device);
/// let target = Tensor::<1, Int>::from_ints([0, 1], &device);
/// let loss = vocab_parallel_cross_entropy(logits, target, 0.0, &tp).unwrap();
/// let v: Vec<f32> = loss.into_data().try_to_vec().unwrap();
/// assert!((v[0] - std::f32::consts::LN_2).abs() < 1e-6 && v[1] < 1e-4);
/// ```
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<2>,
    target: Tensor<1, Int>,
    label_smoothing: f32,
    tp: &Comm,
) -> Result<Tensor<1>, TpError> {
    let vocab_size = logits.dims()[1] * tp.group().size();
    vocab_parallel_cross_entropy_padded(logits, target, label_smoothing, vocab_size, tp)
}

/// [`vocab_parallel_cross_entropy`] over a vocabulary padded beyond its `vocab_size` real
/// entries (the last `V − vocab_size` columns of the global `V`, as Megatron's
/// `--make-vocab-size-divisible-by` pads it): the smoothing spreads `ε / vocab_size` over the
/// real entries only, as single-device smoothed cross-entropy over the real vocabulary does.
/// Without smoothing it is [`vocab_parallel_cross_entropy`] (masked padding has probability
/// zero; padding left unmasked takes part in the softmax, as Megatron's does).
///
/// Errors as [`vocab_parallel_cross_entropy`] does, and when `vocab_size` is 0 or beyond the
/// global vocabulary.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::tensor_parallel::{mask_vocab_padding, vocab_parallel_cross_entropy_padded};
/// use std::sync::Arc;
///
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let device = Device::flex();
/// // Two real tokens, padded to four.
/// let logits = mask_vocab_padding(Tensor::<2>::zeros([1, 4], &device), 2, 0);
/// let target = Tensor::<1, Int>::from_ints([0], &device);
/// let loss = vocab_parallel_cross_entropy_padded(logits, target, 0.1, 2, &tp).unwrap();
/// let v: Vec<f32> = loss.into_data().try_to_vec().unwrap();
/// assert!((v[0] - std::f32::consts::LN_2).abs() < 1e-6);
/// ```
pub fn vocab_parallel_cross_entropy_padded(
    logits: Tensor<2>,
    target: Tensor<1, Int>,
    label_smoothing: f32,
    vocab_size: usize,
    tp: &Comm,
) -> Result<Tensor<1>, TpError> {
    let [_, local_vocab] = logits.dims();
    if !(0.0..1.0).contains(&label_smoothing) {
        return Err(TpError::Indivisible(format!(
            "label smoothing must be in [0, 1), got {label_smoothing}"
        )));
    }
    let (rank, size) = (tp.group().rank(), tp.group().size());
    let (start, end) = vocab_range(local_vocab * size, rank, size).map_err(TpError::Indivisible)?;
    if local_vocab == 0 {
        return Err(TpError::Indivisible("the vocabulary slice is empty".into()));
    }
    if vocab_size == 0 || vocab_size > local_vocab * size {
        return Err(TpError::Indivisible(format!(
            "the real vocabulary size {vocab_size} must be in 1..={} (the padded vocabulary: \
             {local_vocab} columns per rank at TP {size})",
            local_vocab * size
        )));
    }
    let in_range = target
        .clone()
        .greater_equal_elem(start as i64)
        .bool_and(target.clone().lower_elem(end as i64));
    let local = (target - start as i64).mask_fill(in_range.clone().bool_not(), 0);
    let in_range = in_range.float();
    let loss = Dispatch::vocab_parallel_cross_entropy_loss(
        logits.into_dispatch(),
        local.into_dispatch(),
        in_range.into_dispatch(),
        LabelSmoothing {
            epsilon: label_smoothing,
            global_vocab: vocab_size,
        },
        tp.clone(),
    );
    Ok(Tensor::from_dispatch(loss))
}
