//! Vocabulary padding and partitioning across tensor-parallel ranks.

/// Megatron's default for `make_vocab_size_divisible_by`.
pub const DEFAULT_VOCAB_DIVISIBLE_BY: usize = 128;

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
