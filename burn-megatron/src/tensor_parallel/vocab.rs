//! Vocabulary padding and partitioning across tensor-parallel ranks.

use burn::tensor::{Bool, Tensor, TensorData};

/// Megatron's default for `make_vocab_size_divisible_by`.
pub const DEFAULT_VOCAB_DIVISIBLE_BY: usize = 128;

/// What a vocabulary padding entry's logit becomes: far enough below any real logit that
/// its probability is zero in f32 (and its softmax gradient with it), finite in bf16 and f16.
pub const PADDED_VOCAB_LOGIT: f32 = -1.0e4;

/// `logits` (`[..., V / tp]`, this rank's columns of a vocabulary padded beyond
/// `vocab_size`) with the padding columns this rank holds set to [`PADDED_VOCAB_LOGIT`], so
/// a softmax, a loss, an argmax or a sampler over them never picks padding, and no gradient
/// flows back into them (whatever a backend's `exp` makes of −10⁴: a polynomial one leaves
/// denormals that an optimiser would turn into steps). The logits of a rank that holds no
/// padding are returned as they are.
pub fn mask_vocab_padding<const D: usize>(
    logits: Tensor<D>,
    vocab_size: usize,
    tp_rank: usize,
) -> Tensor<D> {
    let part = logits.dims()[D - 1];
    let start = tp_rank * part;
    if start + part <= vocab_size {
        return logits;
    }
    let padding: Vec<bool> = (start..start + part).map(|v| v >= vocab_size).collect();
    let padding = Tensor::<1, Bool>::from_data(TensorData::new(padding, [part]), &logits.device())
        .unsqueeze::<D>()
        .expand(logits.shape());
    logits.mask_fill(padding, PADDED_VOCAB_LOGIT)
}

/// The vocabulary size padded up to a multiple of `divisible_by × tp` so that every
/// tensor-parallel rank holds an equal, aligned slice (Megatron's `_vocab_size_with_padding`).
///
/// ```
/// use burn_megatron::tensor_parallel::padded_vocab_size;
/// assert_eq!(padded_vocab_size(30522, 128, 1), 30592);
/// assert_eq!(padded_vocab_size(30522, 128, 4), 30720);
/// ```
pub fn padded_vocab_size(vocab_size: usize, divisible_by: usize, tp: usize) -> usize {
    let multiple = divisible_by.max(1) * tp.max(1);
    vocab_size.div_ceil(multiple) * multiple
}

/// The half-open range of vocabulary ids held by tensor-parallel rank `rank` of `tp`.
///
/// Fails when `vocab_size` does not split evenly over `tp` ranks (pad it first with
/// [`padded_vocab_size`]).
pub fn vocab_range(vocab_size: usize, rank: usize, tp: usize) -> Result<(usize, usize), String> {
    if tp == 0 || !vocab_size.is_multiple_of(tp) {
        return Err(format!(
            "vocabulary size {vocab_size} is not divisible by the tensor-parallel size {tp}; \
             pad it (padded_vocab_size) first"
        ));
    }
    let per = vocab_size / tp;
    Ok((rank * per, (rank + 1) * per))
}

#[cfg(test)]
mod tests;
