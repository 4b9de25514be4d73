//! How record keys meet a model's module paths, and what a sharded load did.

use super::super::StageKeys;
use crate::tensor_parallel::TpError;
use burn::tensor::TensorData;
use regex::Regex;
use std::sync::Arc;

/// How record names meet module paths, and what a mismatch may be.
///
/// ```
/// use burn_megatron::dropin::LoadOptions;
/// // Hugging Face names onto a Burn model's paths, with PyTorch's `[out, in]` linears.
/// let options = LoadOptions::default()
///     .with_key_remap(r"^model\.layers\.(\d+)\.", "layers.$1.").unwrap()
///     .with_transposed(r"\.(q|k|v|o)_proj\.weight$").unwrap();
/// assert!(LoadOptions::default().with_key_remap("(", "x").is_err());
/// # drop(options);
/// ```
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub(super) remaps: Vec<(Regex, String)>,
    pub(super) transposed: Vec<Regex>,
    pub(super) pytorch_adapter: bool,
    pub(super) allow_missing: bool,
    pub(super) allow_unused: bool,
    pub(super) stage: Option<StageKeys>,
    pub(super) transforms: Vec<(Regex, Transform)>,
    pub(super) tied: Vec<(String, String)>,
    pub(super) skipped: Vec<Regex>,
}

/// A whole tensor rearranged before this rank's part is cut from it.
#[derive(Clone)]
pub(super) struct Transform(pub(super) Arc<TransformFn>);

type TransformFn = dyn Fn(TensorData) -> Result<TensorData, String> + Send + Sync;

impl std::fmt::Debug for Transform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Transform")
    }
}

impl LoadOptions {
    /// Rename record keys before they are matched with module paths: every key goes through
    /// each `(pattern, replacement)` in order (`regex` syntax, `$1` for groups), as
    /// burn-store's `KeyRemapper` does.
    pub fn with_key_remap(mut self, pattern: &str, replacement: &str) -> Result<Self, TpError> {
        self.remaps.push((regex(pattern)?, replacement.to_string()));
        Ok(self)
    }

    /// Module paths (after renaming) whose 2-D tensors are stored transposed, `[out, in]`
    /// as PyTorch's `nn.Linear` stores them, where Burn's `Linear` holds `[in, out]`.
    pub fn with_transposed(mut self, pattern: &str) -> Result<Self, TpError> {
        self.transposed.push(regex(pattern)?);
        Ok(self)
    }

    /// Read a PyTorch state dict as burn-store's `PyTorchToBurnAdapter` does, by the type of
    /// the layer that holds each parameter: every `Linear`'s 2-D weight is stored `[out, in]`
    /// (read transposed; a layer in Burn's column layout reads it as stored), and a norm's
    /// (`LayerNorm`, `RmsNorm`, `BatchNorm`, `GroupNorm`) `gamma` and `beta` are stored as
    /// `weight` and `bias` where the record has no `gamma` or `beta`. Key remaps still apply
    /// first, for the names around the layers. A PyTorch `BatchNorm`'s `num_batches_tracked`
    /// has no Burn counterpart: allow it with `with_allow_unused`.
    ///
    /// ```
    /// use burn_megatron::dropin::LoadOptions;
    /// // A PyTorch port of a Burn encoder: `encoder.layer.N.` for `layers.N.`, its linears
    /// // `[out, in]`, its norms' `weight` and `bias`.
    /// let options = LoadOptions::default()
    ///     .with_key_remap(r"^encoder\.layer\.", "layers.").unwrap()
    ///     .with_pytorch_adapter(true);
    /// # drop(options);
    /// ```
    pub fn with_pytorch_adapter(mut self, on: bool) -> Self {
        self.pytorch_adapter = on;
        self
    }

    /// Leave parameters the record does not hold as they are (listed in the report) instead
    /// of failing.
    pub fn with_allow_missing(mut self, allow: bool) -> Self {
        self.allow_missing = allow;
        self
    }

    /// Skip the record tensors whose names (after renaming) `pattern` matches: the parts of a
    /// checkpoint the model does not have (a pretraining head, a pooler, a buffer the model
    /// computes), listed in [`LoadReport::skipped`], while any other tensor no parameter takes
    /// is still an error.
    pub fn with_skipped(mut self, pattern: &str) -> Result<Self, TpError> {
        self.skipped.push(regex(pattern)?);
        Ok(self)
    }

    /// Ignore record tensors no parameter takes (listed in the report) instead of failing.
    pub fn with_allow_unused(mut self, allow: bool) -> Self {
        self.allow_unused = allow;
        self
    }

    /// Pass the tensors at module paths (after renaming) that `pattern` matches through
    /// `transform` before this rank's part is cut: each whole, as the parameter holds it
    /// (Burn's `[in, out]` for a linear weight, after `with_transposed` or the PyTorch
    /// adapter), and returned in the same shape. For a rearrangement a checkpoint's format
    /// needs, such as [`rotary_half_to_interleaved`] for a Hugging Face Llama's query and
    /// key projections under Burn's `RotaryEncoding`. Such a tensor is read whole (counted in
    /// [`LoadReport::largest_whole_tensor_bytes`]).
    pub fn with_transform(
        mut self,
        pattern: &str,
        transform: impl Fn(TensorData) -> Result<TensorData, String> + Send + Sync + 'static,
    ) -> Result<Self, TpError> {
        let transform = Transform(Arc::new(transform));
        self.transforms.push((regex(pattern)?, transform));
        Ok(self)
    }

    /// Read the parameter at module path `path`, where the record holds nothing under it,
    /// from the record's tensor named `source` (after renaming; the record's name, such as a
    /// PyTorch norm's `weight`, where it differs from the module's). Both are named as in the
    /// whole model, also when a pipeline stage loads its part, and the source may lie on
    /// another stage. The tensor is read as `path`'s parameter reads its own: its layout
    /// (`with_transposed`, the PyTorch adapter, Burn's column layout), its transform and its
    /// split are `path`'s, not `source`'s. For a checkpoint whose output layer shares its
    /// embedding's table (Hugging Face's `tie_word_embeddings`: no `lm_head.weight` saved) in
    /// a model with its own output layer: the output `Linear` reads the `[vocab, d]` table as
    /// PyTorch stores a linear, `[out, in]`, so give it the adapter (or `with_transposed`).
    /// The two parameters then train apart, and a record saved afterwards holds both.
    /// Listed in [`LoadReport::tied`].
    ///
    /// ```
    /// use burn_megatron::dropin::LoadOptions;
    /// let options = LoadOptions::default()
    ///     .with_key_remap(r"^model\.embed_tokens\.", "tok_embeddings.").unwrap()
    ///     .with_pytorch_adapter(true)
    ///     .with_tied("output.weight", "tok_embeddings.weight");
    /// # drop(options);
    /// ```
    pub fn with_tied(mut self, path: &str, source: &str) -> Self {
        self.tied.push((path.to_string(), source.to_string()));
        self
    }

    /// Load one pipeline stage's part of a whole model's record (what
    /// [`PpStage::load_options`](crate::dropin::PpStage::load_options) asks for).
    pub(crate) fn with_stage(mut self, stage: StageKeys) -> Self {
        self.stage = Some(stage);
        self
    }
}

fn regex(pattern: &str) -> Result<Regex, TpError> {
    Regex::new(pattern).map_err(|e| TpError::Invalid(format!("pattern `{pattern}`: {e}")))
}

/// What a sharded load did, and the memory it needed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadReport {
    /// Parameters loaded, by module path.
    pub loaded: Vec<String>,
    /// Parameters the record does not hold (only with `with_allow_missing`).
    pub missing: Vec<String>,
    /// Record tensors no parameter took, by record key (only with `with_allow_unused`).
    pub unused: Vec<String>,
    /// Record tensors another pipeline stage holds, by record key (loading a stage's part).
    pub elsewhere: Vec<String>,
    /// Parameters read from the tensor of another path ([`LoadOptions::with_tied`]), as
    /// `(path, source)`.
    pub tied: Vec<(String, String)>,
    /// Record tensors skipped by [`LoadOptions::with_skipped`], by record key.
    pub skipped: Vec<String>,
    /// Bytes of this rank's shards, as read from the file (a padded vocabulary's zeros
    /// included).
    pub shard_bytes: u64,
    /// The largest tensor read whole: to cut a column shard out of it, or any tensor of a
    /// PyTorch checkpoint (0 when every shard was a run of rows of a mapped file); of a
    /// [`RecordSource::ModelParallel`](super::RecordSource::ModelParallel) checkpoint, the
    /// parts of one tensor a shard overlaps, together.
    pub largest_whole_tensor_bytes: u64,
}

/// The transform ([`LoadOptions::with_transform`]) from a Hugging Face Llama's rotary layout to
/// Burn's: Hugging Face rotates the two halves of each head's features (`rotate_half`; its
/// conversion permuted Meta's weights so), Burn's `RotaryEncoding` rotates adjacent pairs.
/// Along the last dimension (a query or key projection's outputs, in `n_heads` heads of `d`
/// features), feature `2i` of a head takes Hugging Face's feature `i` and `2i + 1` its
/// `d/2 + i`. Per head, so it commutes with a split by heads. `n_heads` is the projection's
/// own: the query's heads, or under grouped-query attention the key's key/value heads (a
/// transform each; with the query's count a key's heads would be cut at the wrong width).
///
/// ```
/// use burn::tensor::TensorData;
/// use burn_megatron::dropin::rotary_half_to_interleaved;
/// // One input row, 2 heads of 4 features: [a0 a1 b0 b1 | c0 c1 d0 d1] (halves a, b).
/// let hf = TensorData::new(vec![0f32, 1., 10., 11., 20., 21., 30., 31.], [1, 8]);
/// let burn = rotary_half_to_interleaved(2)(hf).unwrap();
/// assert_eq!(burn.to_vec::<f32>().unwrap(), [0., 10., 1., 11., 20., 30., 21., 31.]);
/// assert!(rotary_half_to_interleaved(3)(TensorData::new(vec![0f32; 8], [1, 8])).is_err());
/// ```
pub fn rotary_half_to_interleaved(
    n_heads: usize,
) -> impl Fn(TensorData) -> Result<TensorData, String> + Send + Sync + Clone + 'static {
    move |data: TensorData| rotary_pairs(data, n_heads, true)
}

/// Each row's `n_heads` heads of `d` features rearranged: with `interleave`, feature `2i` of a
/// head takes feature `i` and `2i + 1` takes `d/2 + i`; without, the inverse.
pub(in crate::dropin) fn rotary_pairs(
    data: TensorData,
    n_heads: usize,
    interleave: bool,
) -> Result<TensorData, String> {
    let shape = data.shape().to_vec();
    let last = shape.last().copied().unwrap_or(0);
    let d = last.checked_div(n_heads).unwrap_or(0);
    if n_heads == 0 || d == 0 || last != n_heads * d || !d.is_multiple_of(2) {
        return Err(format!(
            "{last} features do not split into {n_heads} heads of an even size"
        ));
    }
    let (elem, dtype) = (data.dtype().size(), data.dtype());
    let bytes = data.into_bytes();
    let mut out = vec![0u8; bytes.len()];
    for (row_in, row_out) in bytes.chunks(last * elem).zip(out.chunks_mut(last * elem)) {
        for h in 0..n_heads {
            for i in 0..d {
                let (paired, halves) = (h * d + i, h * d + (i % 2) * (d / 2) + i / 2);
                let (from, to) = match interleave {
                    true => (halves, paired),
                    false => (paired, halves),
                };
                row_out[to * elem..(to + 1) * elem]
                    .copy_from_slice(&row_in[from * elem..(from + 1) * elem]);
            }
        }
    }
    Ok(TensorData::from_bytes_vec(out, shape, dtype))
}
