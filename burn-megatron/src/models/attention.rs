//! `ParallelAttention`: self-attention with its heads split across tensor-parallel ranks.

use crate::comm::Comm;
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, MasterInit, RngRegion, RngTracker,
    RowParallelLinear, RowParallelLinearConfig, TpError, derive_seed,
};
use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Bool, Device, Tensor};
use burn_megatron_kernels::scaled_masked_softmax;

/// Configuration of a [`ParallelAttention`].
#[derive(Config, Debug)]
pub struct ParallelAttentionConfig {
    /// Hidden size `h`.
    pub hidden_size: usize,
    /// Attention heads, divisible by the tensor-parallel size.
    pub num_attention_heads: usize,
    /// Dropout on the attention probabilities (drawn per TP rank: each holds other heads).
    #[config(default = 0.1)]
    pub attention_dropout: f64,
    /// Activations are split along the sequence (dim 0) outside the layer.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Megatron's `gradient_accumulation_fusion` in every parallel linear layer: weight
    /// gradients summed and returned in f32 (see `ColumnParallelLinearConfig`).
    #[config(default = false)]
    pub gradient_accumulation_fusion: bool,
    /// Weight initialisation.
    #[config(default = "MasterInit::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: MasterInit,
    /// Seed of this layer's weights.
    #[config(default = 0)]
    pub seed: u64,
}

/// Self-attention with a fused QKV projection split by heads (`ColumnParallelLinear`) and an
/// output projection (`RowParallelLinear`). Activations are `[s, b, h]`.
///
/// The fused QKV output is laid out per head (`[head][q, k, v][head_dim]`), so a contiguous
/// column split gives each rank whole heads.
#[derive(Module, Debug)]
pub struct ParallelAttention {
    /// Fused query/key/value projection, `h → 3h` split by heads.
    pub query_key_value: ColumnParallelLinear,
    /// Output projection, `h → h` split by input rows.
    pub dense: RowParallelLinear,
    #[module(skip)]
    heads_per_rank: usize,
    #[module(skip)]
    head_dim: usize,
    #[module(skip)]
    attention_dropout: f64,
}

impl ParallelAttentionConfig {
    /// Initialises this rank's heads. Fails when the heads do not split over the group or
    /// the hidden size over the heads.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<ParallelAttention, TpError> {
        super::check_dropout(&[("attention_dropout", self.attention_dropout)])?;
        let size = tp.group().size();
        if self.hidden_size == 0 || self.num_attention_heads == 0 {
            return Err(TpError::Invalid(format!(
                "hidden size ({}) and attention heads ({}) must both be at least 1",
                self.hidden_size, self.num_attention_heads
            )));
        }
        if !self.num_attention_heads.is_multiple_of(size) {
            return Err(TpError::Indivisible(format!(
                "attention heads ({}) are not divisible by the tensor-parallel size ({size})",
                self.num_attention_heads
            )));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(TpError::Indivisible(format!(
                "hidden size ({}) is not divisible by the attention heads ({})",
                self.hidden_size, self.num_attention_heads
            )));
        }
        let h = self.hidden_size;
        let query_key_value = ColumnParallelLinearConfig::new(h, 3 * h)
            .with_sequence_parallel(self.sequence_parallel)
            .with_gradient_accumulation_fusion(self.gradient_accumulation_fusion)
            .with_initializer(self.initializer)
            .with_seed(derive_seed(self.seed, "query_key_value"))
            .init(tp, device)?;
        let dense = RowParallelLinearConfig::new(h, h)
            .with_sequence_parallel(self.sequence_parallel)
            .with_gradient_accumulation_fusion(self.gradient_accumulation_fusion)
            .with_initializer(self.initializer)
            .with_seed(derive_seed(self.seed, "dense"))
            .with_skip_bias_add(true)
            .init(tp, device)?;
        Ok(ParallelAttention {
            query_key_value,
            dense,
            heads_per_rank: self.num_attention_heads / size,
            head_dim: h / self.num_attention_heads,
            attention_dropout: self.attention_dropout,
        })
    }
}

impl ParallelAttention {
    /// Attention heads held by this rank.
    pub fn heads_per_rank(&self) -> usize {
        self.heads_per_rank
    }

    /// `[s, b, h]` → `[s, b, h]` (dim 0 split under sequence parallelism). `padding` is
    /// `[b, s]`, true at padded positions, which no query attends to.
    pub fn forward(
        &self,
        x: Tensor<3>,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        match self.forward_with_bias(x, padding, rng) {
            (out, Some(bias)) => out + bias.unsqueeze(),
            (out, None) => out,
        }
    }

    /// Like [`forward`](Self::forward), but returns the output projection's bias instead of
    /// adding it (when the projection was built with `skip_bias_add`, as
    /// [`ParallelAttentionConfig::init`] does), so the caller fuses it with dropout and the
    /// residual add.
    pub fn forward_with_bias(
        &self,
        x: Tensor<3>,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        let qkv = self.query_key_value.forward(x);
        let [s, b, _] = qkv.dims();
        let (np, hn) = (self.heads_per_rank, self.head_dim);
        // [s, b, np, 3, hn] → three [b, np, s, hn].
        let qkv = qkv.reshape([s, b, np, 3, hn]);
        let part = |i: usize| {
            qkv.clone()
                .narrow(3, i, 1)
                .reshape([s, b, np, hn])
                .permute([1, 2, 0, 3])
        };
        let (q, k, v) = (part(0), part(1), part(2));
        // Scaled, padded keys filled with Megatron's -10000 (fully padded rows stay finite),
        // softmax: one fused kernel on GPUs.
        let scale = 1.0 / (hn as f32).sqrt();
        let mut probs = scaled_masked_softmax(q.matmul(k.swap_dims(2, 3)), padding, scale, false)
            .expect("scores are [b, np, s, s] and the padding [b, s] by construction");
        if let Some(rng) = rng {
            // This rank's heads: a mask of its own (the model-parallel stream), drawn from a
            // seed as one kernel, no mask uploaded.
            probs = rng
                .dropout(
                    probs,
                    self.attention_dropout,
                    RngRegion::TensorModelParallel,
                )
                .expect("attention_dropout is checked to lie in [0, 1) at init");
        }
        let context = probs
            .matmul(v)
            .permute([2, 0, 1, 3])
            .reshape([s, b, np * hn]);
        self.dense.forward_with_bias(context)
    }
}
