//! `TransformerLayer` (post- or pre-LayerNorm, a dense [`ParallelMlp`] or experts): the one
//! transformer core that BERT and the GPT family share, told apart by config switches as
//! Megatron-Core's `TransformerConfig` does.

use super::attention::{AttentionInputs, LayerKvCache, ParallelAttention, ParallelAttentionConfig};
use super::mlp::{ParallelMlp, ParallelMlpConfig};
use super::norm::{Norm, NormKind};
pub use crate::activation::ActivationFunc;
use crate::comm::Comm;
use crate::moe::{ExpertGroups, MoeConfig, MoeLayer, MoeLayerShape};
use crate::recompute::{
    RecomputeConfig, RecomputeModule, linear_products, recompute, recompute_linear_input,
};
use crate::tensor_parallel::{
    LayoutOwner, MasterInit, RngRegion, RngTracker, TpError, derive_seed,
};
use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_megatron_kernels::bias_dropout_add;

/// Where the LayerNorms sit.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum LayerNormPosition {
    /// After each residual add: original BERT and Hugging Face.
    Post,
    /// Before each sub-layer: Megatron's GPT/BERT default.
    Pre,
}

impl LayerNormPosition {
    /// Refuses the recomputation a layer with its norms here cannot do: `layernorm` needs
    /// pre-norm layers, since a post-norm layer's norm output is the residual stream, which
    /// the next layer keeps anyway. Layer init and the pretraining examples' flag validation
    /// both call it, so `plan` and the run refuse with one message.
    pub fn check_recompute(self, recompute: &RecomputeConfig) -> Result<(), TpError> {
        if recompute.selects(RecomputeModule::Layernorm) && self == LayerNormPosition::Post {
            return Err(TpError::Invalid(
                "--recompute-modules layernorm needs pre-norm layers: a post-norm layer's \
                 (BERT's) norm output is the residual stream, which the next layer keeps anyway"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Configuration of a [`TransformerLayer`], Megatron-Core's `TransformerConfig`: the one
/// place a layer's shape and switches are set. It holds the attention's own settings
/// ([`ParallelAttentionConfig`]) and the MLP's ([`ParallelMlpConfig`]) beside what they
/// share; [`GptConfig`](super::GptConfig) and [`BertConfig`](super::BertConfig) hold one for
/// all their layers.
///
/// ```
/// use burn_megatron::models::{
///     ActivationFunc, NormKind, ParallelAttentionConfig, ParallelMlpConfig,
///     TransformerLayerConfig,
/// };
/// // A Llama-style layer: 8 heads sharing 2 key/value groups, a SwiGLU MLP, no biases.
/// let layer = TransformerLayerConfig::new(
///     512,
///     ParallelAttentionConfig::new(8).with_num_query_groups(Some(2)),
///     ParallelMlpConfig::new(1408)
///         .with_gated_linear_unit(true)
///         .with_activation_func(ActivationFunc::Silu),
/// )
/// .with_normalization(NormKind::RmsNorm)
/// .with_add_bias_linear(false);
/// assert_eq!(layer.attention.head_dim(layer.hidden_size), 64);
/// ```
#[derive(Config, Debug)]
pub struct TransformerLayerConfig {
    /// Hidden size.
    pub hidden_size: usize,
    /// The attention's heads, query groups, mask and dropout.
    pub attention: ParallelAttentionConfig,
    /// The MLP's inner size, gating and activation.
    pub mlp: ParallelMlpConfig,
    /// Biases in every linear layer (Megatron's `add_bias_linear`; `--disable-bias-linear`
    /// turns it off).
    #[config(default = true)]
    pub add_bias_linear: bool,
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
    /// Sequence parallelism (activations split along dim 0 between sub-layers).
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Megatron's `gradient_accumulation_fusion` in every parallel linear layer: weight
    /// gradients summed and returned in f32 (see `ColumnParallelLinearConfig`).
    #[config(default = false)]
    pub gradient_accumulation_fusion: bool,
    /// Weight initialisation (Megatron's `init_method`).
    #[config(default = "MasterInit::Normal { mean: 0.0, std: 0.02 }")]
    pub initializer: MasterInit,
    /// Initialisation of the two output projections (attention's `dense`, the MLP's
    /// `dense_4h_to_h`); `None`: `initializer`. Megatron scales GPT's by `1/√(2·layers)`.
    #[config(default = "None")]
    pub output_initializer: Option<MasterInit>,
    /// Seed of this layer's weights (a model's config: of the model's).
    #[config(default = 0)]
    pub seed: u64,
    /// A mixture of experts in place of the dense MLP, of the MLP's shape.
    #[config(default = "None")]
    pub moe: Option<MoeConfig>,
    /// Activation recomputation; the layer applies the `selective` modules (the block of
    /// layers applies `full`, see [`forward_layers`]).
    #[config(default = "RecomputeConfig::new()")]
    pub recompute: RecomputeConfig,
}

/// One transformer layer: attention and MLP, each with a residual connection and LayerNorm.
#[derive(Module, Debug)]
pub struct TransformerLayer {
    /// Self-attention.
    pub attention: ParallelAttention,
    /// Feed-forward block.
    /// The dense MLP; `None` in a mixture-of-experts layer.
    pub mlp: Option<ParallelMlp>,
    /// The mixture-of-experts MLP of an MoE layer (`moe` in the config).
    pub moe: Option<MoeLayer>,
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
    /// Selective recomputation of the MLP.
    #[module(skip)]
    recompute_mlp: bool,
    /// Selective recomputation of the norms (pre-norm layers).
    #[module(skip)]
    recompute_layernorm: bool,
    /// Holds the norms' attributes.
    #[module(skip)]
    layout: LayoutOwner,
}

impl TransformerLayerConfig {
    /// Checks the heads and query groups against the width and `tp` ranks (see
    /// [`ParallelAttentionConfig::check`]).
    pub fn check(&self, tp: usize) -> Result<(), TpError> {
        self.attention.check(self.hidden_size, tp)
    }

    /// Initialises this rank's part of the layer.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<TransformerLayer, TpError> {
        self.init_with_experts(tp, None, device)
    }

    /// [`init`](Self::init) with the groups an MoE layer splits its experts over (`None`:
    /// all of them, whole, on this rank).
    pub fn init_with_experts(
        &self,
        tp: &Comm,
        experts: Option<&ExpertGroups>,
        device: &Device,
    ) -> Result<TransformerLayer, TpError> {
        super::check_dropout(&[("hidden_dropout", self.hidden_dropout)])?;
        self.layernorm_position.check_recompute(&self.recompute)?;
        super::check_epsilon(self.layernorm_epsilon)?;
        let h = self.hidden_size;
        let attention = self.attention.init(self, tp, device)?;
        let (mlp, moe) = match &self.moe {
            None => (Some(self.mlp.init(self, tp, device)?), None),
            Some(moe) => {
                let solo;
                let experts = match experts {
                    Some(experts) => experts,
                    None => {
                        solo = ExpertGroups::solo();
                        &solo
                    }
                };
                if self.add_bias_linear {
                    return Err(TpError::Invalid(
                        "mixture-of-experts layers have no biases: set add_bias_linear to false \
                         (--disable-bias-linear)"
                            .into(),
                    ));
                }
                let shape = MoeLayerShape {
                    hidden_size: h,
                    ffn_hidden_size: self.mlp.ffn_hidden_size,
                    gated_linear_unit: self.mlp.gated_linear_unit,
                    activation: self.mlp.activation_func,
                    initializer: self.initializer,
                    output_initializer: self.output_initializer.unwrap_or(self.initializer),
                    sequence_parallel: self.sequence_parallel,
                    seed: derive_seed(self.seed, "mlp"),
                };
                (None, Some(moe.init(shape, tp, experts, device)?))
            }
        };
        let norm = || Norm::new(self.normalization, h, self.layernorm_epsilon, device);
        let layer = TransformerLayer {
            attention,
            mlp,
            moe,
            input_layernorm: norm(),
            post_attention_layernorm: norm(),
            position: self.layernorm_position,
            hidden_dropout: self.hidden_dropout,
            sequence_parallel: self.sequence_parallel,
            recompute_mlp: self.recompute.selects(RecomputeModule::Mlp),
            recompute_layernorm: self.recompute.selects(RecomputeModule::Layernorm),
            layout: LayoutOwner::default(),
        };
        layer.state_attrs();
        Ok(layer)
    }
}

impl TransformerLayer {
    /// The norms' attributes (the linear layers state their own), at init and every forward.
    fn state_attrs(&self) {
        let (owner, sp) = (&self.layout, self.sequence_parallel);
        self.input_layernorm.state_attrs(owner, sp);
        self.post_attention_layernorm.state_attrs(owner, sp);
    }

    /// Where this layer's norms sit.
    pub fn layernorm_position(&self) -> LayerNormPosition {
        self.position
    }

    /// `residual + dropout(x + bias)`, one fused kernel on GPUs (Megatron's
    /// `bias_dropout_add`). Dropout applies when `rng` is given and `x` is tracked (training).
    fn bias_dropout_add(
        &self,
        (x, bias): (Tensor<3>, Option<Tensor<1>>),
        residual: Tensor<3>,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        // Split activations (sequence parallel) differ per rank; duplicated ones must not.
        let region = if self.sequence_parallel {
            RngRegion::TensorModelParallel
        } else {
            RngRegion::Default
        };
        let (prob, seed) = match rng {
            Some(rng) if self.hidden_dropout > 0.0 && x.is_autodiff() => {
                (self.hidden_dropout as f32, rng.next_seed(region))
            }
            _ => (0.0, 0),
        };
        bias_dropout_add(x, bias, residual, prob, seed)
            .expect("shapes match by construction and the probability is checked at init")
    }

    /// The MLP's output and its unadded bias; recomputed (bias added inside, as the fused
    /// add would add it) under selective `mlp` recomputation.
    fn mlp_forward(&self, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        match (&self.mlp, &self.moe) {
            (Some(mlp), _) if self.recompute_mlp => {
                (recompute(mlp, x, None, |mlp, x, _| mlp.forward(x)), None)
            }
            (Some(mlp), _) => mlp.forward_with_bias(x),
            // Inside the graph there is no error channel: a failed exchange panics with its
            // error, as the tensor-parallel mappings do.
            (None, Some(moe)) => (
                moe.forward(x)
                    .unwrap_or_else(|e| panic!("mixture-of-experts layer: {e}")),
                None,
            ),
            (None, None) => unreachable!("a layer has a dense or an expert MLP by construction"),
        }
    }

    /// `[s, b, h]` → `[s, b, h]` (dim 0 split under sequence parallelism), with the padding
    /// mask and rotary tables of `inputs`. Dropout applies when `rng` is given.
    pub fn forward(
        &self,
        x: Tensor<3>,
        inputs: &AttentionInputs,
        rng: Option<&RngTracker>,
    ) -> Tensor<3> {
        self.forward_with_cache(x, inputs, rng, None)
    }

    /// [`forward`](Self::forward) whose attention appends its keys and values to `cache`
    /// and attends to every cached token (decoding).
    pub fn forward_with_cache(
        &self,
        x: Tensor<3>,
        inputs: &AttentionInputs,
        rng: Option<&RngTracker>,
        cache: Option<&mut LayerKvCache>,
    ) -> Tensor<3> {
        self.state_attrs();
        match self.position {
            // Spans name the sub-layers (with their norm and residual add) for profiles.
            LayerNormPosition::Post => {
                let span = tracing::debug_span!("layer.attention").entered();
                let a = self
                    .attention
                    .forward_with_bias(x.clone(), inputs, rng, cache);
                let x = self
                    .input_layernorm
                    .forward(self.bias_dropout_add(a, x, rng));
                drop(span);
                let _span = tracing::debug_span!("layer.mlp").entered();
                let m = self.mlp_forward(x.clone());
                self.post_attention_layernorm
                    .forward(self.bias_dropout_add(m, x, rng))
            }
            LayerNormPosition::Pre => {
                let span = tracing::debug_span!("layer.attention").entered();
                let a = if self.recompute_layernorm && cache.is_none() {
                    let qkv = &self.attention.query_key_value;
                    let (qkv, _) = recompute_linear_input(
                        &self.input_layernorm,
                        x.clone(),
                        |norm, x| norm.forward(x),
                        &[qkv],
                    )
                    .remove(0);
                    self.attention
                        .forward_with_bias_from_qkv(qkv, inputs, rng, cache)
                } else {
                    let normed = self.input_layernorm.forward(x.clone());
                    self.attention.forward_with_bias(normed, inputs, rng, cache)
                };
                let x = self.bias_dropout_add(a, x, rng);
                drop(span);
                let _span = tracing::debug_span!("layer.mlp").entered();
                let m = match &self.mlp {
                    Some(mlp) if self.recompute_layernorm && !self.recompute_mlp => {
                        let first = mlp.first_layers();
                        let products = linear_products(
                            &self.post_attention_layernorm,
                            x.clone(),
                            1,
                            |norm, mut x| norm.forward(x.remove(0)),
                            &first,
                        );
                        // With `mlp_act`, the region's output is already the activation
                        // region's input.
                        let stacked = if mlp.recompute_act {
                            products.stacked(&first)
                        } else {
                            Err(products)
                        };
                        match stacked {
                            Ok(gate_up) => mlp.forward_packed(gate_up),
                            Err(products) => {
                                let mut outs = products.finish(&first, &x);
                                let up = outs.pop().expect("one output per first layer");
                                mlp.forward_from_projections(up, outs.pop())
                            }
                        }
                    }
                    _ => self.mlp_forward(self.post_attention_layernorm.forward(x.clone())),
                };
                self.bias_dropout_add(m, x, rng)
            }
        }
    }
}

/// Runs a pipeline chunk's `layers` in order, recomputing them as `recompute` asks for
/// `full` granularity (Megatron's `TransformerBlock._checkpointed_forward`): a region keeps
/// only its input, and replays its layers' dropout in backward.
pub fn forward_layers(
    layers: &[TransformerLayer],
    mut x: Tensor<3>,
    inputs: &AttentionInputs,
    rng: Option<&RngTracker>,
    recompute_config: &RecomputeConfig,
) -> Tensor<3> {
    for (range, recomputed) in recompute_config.layer_regions(layers.len()) {
        if recomputed {
            let inputs = inputs.clone();
            x = recompute(&layers[range].to_vec(), x, rng, move |layers, x, rng| {
                layers.iter().fold(x, |x, l| l.forward(x, &inputs, rng))
            });
        } else {
            x = layers[range]
                .iter()
                .fold(x, |x, l| l.forward(x, inputs, rng));
        }
    }
    x
}
