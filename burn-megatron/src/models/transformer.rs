//! `ParallelMlp` and `TransformerLayer` (post- or pre-LayerNorm).

use super::attention::{ParallelAttention, ParallelAttentionConfig};
use crate::comm::Comm;
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, MasterInit, ParallelAttrs, RngRegion,
    RngTracker, RowParallelLinear, RowParallelLinearConfig, TpError, derive_seed,
    set_parallel_attrs,
};
use burn::config::Config;
use burn::module::Module;
use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig, RmsNorm, RmsNormConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Bool, Device, Tensor};

/// Column → GeLU → Row.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    /// `h → ffn`, split by output features.
    pub dense_h_to_4h: ColumnParallelLinear,
    /// `ffn → h`, split by input features.
    pub dense_4h_to_h: RowParallelLinear,
}

impl ParallelMlp {
    /// `[s, b, h]` → `[s, b, h]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.dense_4h_to_h
            .forward(gelu(self.dense_h_to_4h.forward(x)))
    }
}

/// Where the LayerNorms sit.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum LayerNormPosition {
    /// After each residual add: original BERT and Hugging Face.
    Post,
    /// Before each sub-layer: Megatron's GPT/BERT default.
    Pre,
}

/// Which normalisation a layer uses.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// LayerNorm (BERT, GPT).
    LayerNorm,
    /// RMSNorm (no mean subtraction, no bias).
    RmsNorm,
}

/// A LayerNorm or an RMSNorm.
#[derive(Module, Debug)]
pub enum Norm {
    /// LayerNorm.
    LayerNorm(LayerNorm),
    /// RMSNorm.
    RmsNorm(RmsNorm),
}

impl Norm {
    fn new(
        kind: NormKind,
        size: usize,
        epsilon: f64,
        sequence_parallel: bool,
        device: &Device,
    ) -> Self {
        let norm = match kind {
            NormKind::LayerNorm => Norm::LayerNorm(
                LayerNormConfig::new(size)
                    .with_epsilon(epsilon)
                    .init(device),
            ),
            NormKind::RmsNorm => {
                Norm::RmsNorm(RmsNormConfig::new(size).with_epsilon(epsilon).init(device))
            }
        };
        if sequence_parallel {
            // Each rank normalises only its part of the sequence: partial gradients.
            set_parallel_attrs(norm.gamma().id, ParallelAttrs::sequence_parallel());
            if let Norm::LayerNorm(ln) = &norm
                && let Some(beta) = &ln.beta
            {
                set_parallel_attrs(beta.id, ParallelAttrs::sequence_parallel());
            }
        }
        norm
    }

    /// Normalises the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Norm::LayerNorm(n) => n.forward(x),
            Norm::RmsNorm(n) => n.forward(x),
        }
    }

    /// The scale parameter.
    pub fn gamma(&self) -> &Param<Tensor<1>> {
        match self {
            Norm::LayerNorm(n) => &n.gamma,
            Norm::RmsNorm(n) => &n.gamma,
        }
    }
}

/// Configuration of a [`TransformerLayer`].
#[derive(Config, Debug)]
pub struct TransformerLayerConfig {
    /// Hidden size.
    pub hidden_size: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// MLP inner size.
    pub ffn_hidden_size: usize,
    /// Post-LayerNorm (BERT) or pre-LayerNorm.
    #[config(default = "LayerNormPosition::Post")]
    pub layernorm_position: LayerNormPosition,
    /// LayerNorm or RMSNorm.
    #[config(default = "NormKind::LayerNorm")]
    pub normalization: NormKind,
    /// Normalisation epsilon.
    #[config(default = 1e-12)]
    pub layernorm_epsilon: f64,
    /// Dropout after attention and MLP, before the residual add.
    #[config(default = 0.1)]
    pub hidden_dropout: f64,
    /// Dropout on attention probabilities.
    #[config(default = 0.1)]
    pub attention_dropout: f64,
    /// Sequence parallelism (activations split along dim 0 between sub-layers).
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Weight initialisation.
    #[config(default = "MasterInit::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: MasterInit,
    /// Seed of this layer's weights.
    #[config(default = 0)]
    pub seed: u64,
}

/// One transformer layer: attention and MLP, each with a residual connection and LayerNorm.
#[derive(Module, Debug)]
pub struct TransformerLayer {
    /// Self-attention.
    pub attention: ParallelAttention,
    /// Feed-forward block.
    pub mlp: ParallelMlp,
    /// Norm of the attention block (after it when post-LN, before it when pre-LN).
    pub input_layernorm: Norm,
    /// Norm of the MLP block.
    pub post_attention_layernorm: Norm,
    #[module(skip)]
    position: LayerNormPosition,
    #[module(skip)]
    hidden_dropout: f64,
    #[module(skip)]
    sequence_parallel: bool,
}

impl TransformerLayerConfig {
    /// Initialises this rank's part of the layer.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<TransformerLayer, TpError> {
        let h = self.hidden_size;
        let attention = ParallelAttentionConfig::new(h, self.num_attention_heads)
            .with_attention_dropout(self.attention_dropout)
            .with_sequence_parallel(self.sequence_parallel)
            .with_initializer(self.initializer)
            .with_seed(derive_seed(self.seed, "attention"))
            .init(tp, device)?;
        let mlp = ParallelMlp {
            dense_h_to_4h: ColumnParallelLinearConfig::new(h, self.ffn_hidden_size)
                .with_sequence_parallel(self.sequence_parallel)
                .with_initializer(self.initializer)
                .with_seed(derive_seed(self.seed, "mlp.dense_h_to_4h"))
                .init(tp, device)?,
            dense_4h_to_h: RowParallelLinearConfig::new(self.ffn_hidden_size, h)
                .with_sequence_parallel(self.sequence_parallel)
                .with_initializer(self.initializer)
                .with_seed(derive_seed(self.seed, "mlp.dense_4h_to_h"))
                .init(tp, device)?,
        };
        let norm = || {
            Norm::new(
                self.normalization,
                h,
                self.layernorm_epsilon,
                self.sequence_parallel,
                device,
            )
        };
        Ok(TransformerLayer {
            attention,
            mlp,
            input_layernorm: norm(),
            post_attention_layernorm: norm(),
            position: self.layernorm_position,
            hidden_dropout: self.hidden_dropout,
            sequence_parallel: self.sequence_parallel,
        })
    }
}

impl TransformerLayer {
    /// Where this layer's norms sit.
    pub fn layernorm_position(&self) -> LayerNormPosition {
        self.position
    }

    fn dropout(&self, x: Tensor<3>, rng: Option<&RngTracker>) -> Tensor<3> {
        // Split activations (sequence parallel) differ per rank; duplicated ones must not.
        let region = if self.sequence_parallel {
            RngRegion::TensorModelParallel
        } else {
            RngRegion::Default
        };
        match rng {
            Some(rng) => rng.dropout(x, self.hidden_dropout, region),
            None => x,
        }
    }

    /// `[s, b, h]` → `[s, b, h]` (dim 0 split under sequence parallelism). `padding` is
    /// `[b, s]`, true at padded positions. Dropout applies when `rng` is given.
    pub fn forward(
        &self,
        x: Tensor<3>,
        padding: Option<Tensor<2, Bool>>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        match self.position {
            LayerNormPosition::Post => {
                let a = self.dropout(self.attention.forward(x.clone(), padding, rng), rng);
                let x = self.input_layernorm.forward(x + a);
                let m = self.dropout(self.mlp.forward(x.clone()), rng);
                self.post_attention_layernorm.forward(x + m)
            }
            LayerNormPosition::Pre => {
                let a =
                    self.attention
                        .forward(self.input_layernorm.forward(x.clone()), padding, rng);
                let x = x + self.dropout(a, rng);
                let m = self
                    .mlp
                    .forward(self.post_attention_layernorm.forward(x.clone()));
                x + self.dropout(m, rng)
            }
        }
    }
}
