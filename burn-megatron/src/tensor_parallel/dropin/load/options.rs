//! How record keys meet a model's module paths, and what a sharded load did.

use super::super::super::TpError;
use super::super::StageKeys;
use regex::Regex;

/// How record names meet module paths, and what a mismatch may be.
///
/// ```
/// use burn_megatron::tensor_parallel::dropin::LoadOptions;
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
    /// use burn_megatron::tensor_parallel::dropin::LoadOptions;
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

    /// Ignore record tensors no parameter takes (listed in the report) instead of failing.
    pub fn with_allow_unused(mut self, allow: bool) -> Self {
        self.allow_unused = allow;
        self
    }

    /// Load one pipeline stage's part of a whole model's record (what
    /// [`PpStage::load_options`](crate::pipeline::PpStage::load_options) asks for).
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
pub struct LoadReport {
    /// Parameters loaded, by module path.
    pub loaded: Vec<String>,
    /// Parameters the record does not hold (only with `with_allow_missing`).
    pub missing: Vec<String>,
    /// Record tensors no parameter took, by record key (only with `with_allow_unused`).
    pub unused: Vec<String>,
    /// Record tensors another pipeline stage holds, by record key (loading a stage's part).
    pub elsewhere: Vec<String>,
    /// Bytes of this rank's shards, as read from the file (a padded vocabulary's zeros
    /// included).
    pub shard_bytes: u64,
    /// The largest tensor read whole: to cut a column shard out of it, or any tensor of a
    /// PyTorch checkpoint (0 when every shard was a run of rows of a mapped file).
    pub largest_whole_tensor_bytes: u64,
}
