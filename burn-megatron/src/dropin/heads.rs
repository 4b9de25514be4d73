//! How a layer's heads and width split over the tensor-parallel ranks.

use crate::tensor_parallel::TpError;

/// One rank's share of an attention layer: its heads and the width they span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSplit {
    /// Attention heads on this rank.
    pub heads: usize,
    /// Key/value heads on this rank (as many as `heads` without grouped-query attention).
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// `heads · head_dim`: the width of this rank's query (and attention output).
    pub width: usize,
}

/// The per-rank heads and widths of an attention layer of width `d_model` with `n_heads`
/// query heads and `n_kv_heads` key/value heads over `tp` ranks, or an error naming `layer`
/// and the numbers that do not divide. A model written for one device sizes its reshapes and
/// caches from these instead of the config's totals.
///
/// ```
/// use burn_megatron::dropin::attention_split;
/// let split = attention_split("layers.0.attention", 512, 8, 2, 2).unwrap();
/// assert_eq!((split.heads, split.kv_heads, split.head_dim, split.width), (4, 1, 64, 256));
/// let e = attention_split("layers.0.attention", 512, 8, 2, 4).unwrap_err().to_string();
/// assert!(e.contains("layers.0.attention") && e.contains("key/value heads (2)"));
/// ```
pub fn attention_split(
    layer: &str,
    d_model: usize,
    n_heads: usize,
    n_kv_heads: usize,
    tp: usize,
) -> Result<AttentionSplit, TpError> {
    let invalid = |m: String| Err(TpError::Invalid(format!("{layer}: {m}")));
    let indivisible = |m: String| Err(TpError::Indivisible(format!("{layer}: {m}")));
    if d_model == 0 || n_heads == 0 || n_kv_heads == 0 || tp == 0 {
        return invalid(format!(
            "width ({d_model}), heads ({n_heads}), key/value heads ({n_kv_heads}) and the \
             tensor-parallel size ({tp}) must all be at least 1"
        ));
    }
    if !d_model.is_multiple_of(n_heads) {
        return indivisible(format!(
            "the width ({d_model}) is not divisible by the heads ({n_heads})"
        ));
    }
    if !n_heads.is_multiple_of(n_kv_heads) {
        return indivisible(format!(
            "the heads ({n_heads}) are not divisible by the key/value heads ({n_kv_heads})"
        ));
    }
    if !n_heads.is_multiple_of(tp) || !n_kv_heads.is_multiple_of(tp) {
        return indivisible(format!(
            "the heads ({n_heads}) and key/value heads ({n_kv_heads}) must be divisible by the \
             tensor-parallel size ({tp}): each rank keeps whole heads"
        ));
    }
    let head_dim = d_model / n_heads;
    Ok(AttentionSplit {
        heads: n_heads / tp,
        kv_heads: n_kv_heads / tp,
        head_dim,
        width: n_heads / tp * head_dim,
    })
}
