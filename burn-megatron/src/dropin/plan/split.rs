//! How a layer is split, and the split a Burn-named transformer part takes.

/// How a layer is split over the tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Output features split (Megatron's `ColumnParallelLinear`, no gather): weight `[in,
    /// out / tp]`, bias `[out / tp]`.
    Column,
    /// Output features split, then gathered (`ColumnParallelLinear` with `gather_output`):
    /// every rank gets the whole output, for code that needs it whole (a loss or an argmax
    /// over the vocabulary), at the cost of an all-gather.
    GatheredColumn,
    /// Input features split (`RowParallelLinear`, input already split): weight `[in / tp,
    /// out]`, the bias whole, the outputs summed over the ranks.
    Row,
    /// Split over the vocabulary: an `Embedding`'s rows (`VocabParallelEmbedding`: table
    /// `[vocab / tp, d]`), or an output `Linear`'s columns (Megatron's `output_layer`: logits
    /// `[..., vocab / tp]` for the vocabulary-parallel loss, argmax and sampler). A vocabulary
    /// that does not split is padded with
    /// [`make_vocab_size_divisible_by`](super::TpPlan::make_vocab_size_divisible_by); the padding
    /// logits are masked to [`PADDED_VOCAB_LOGIT`](crate::tensor_parallel::PADDED_VOCAB_LOGIT).
    /// A label-smoothed loss over split logits takes the real vocabulary
    /// ([`Linear::d_output`](crate::dropin::nn::Linear::d_output)) with
    /// [`vocab_parallel_cross_entropy_padded`](crate::tensor_parallel::vocab_parallel_cross_entropy_padded).
    Vocab,
    /// An output `Linear` split over the vocabulary as [`Vocab`](Self::Vocab), its logits
    /// gathered and cut back to the real vocabulary: every rank gets `[..., vocab]`, for a
    /// loss written for whole logits (`burn::nn::loss::CrossEntropyLoss`).
    GatheredVocab,
    /// [`nn::transformer`](crate::dropin::nn::transformer)'s encoder or decoder (or one of their
    /// layers, or an [`nn::attention`](crate::dropin::nn::attention) `MultiHeadAttention` or
    /// `CrossAttention` on its own) split as
    /// Megatron splits a transformer layer: `query`, `key`, `value` and `linear_inner`
    /// column-parallel, `output` and `linear_outer` row-parallel, the norms whole, dropout
    /// from a tracker.
    Encoder,
}

/// How an encoder splits the linear layer named `name`.
pub(super) fn encoder_split(name: &str) -> Option<Split> {
    match name {
        "query" | "key" | "value" | "linear_inner" => Some(Split::Column),
        "output" | "linear_outer" => Some(Split::Row),
        _ => None,
    }
}
