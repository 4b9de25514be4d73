//! `ParallelMlp`: column-parallel layer(s), the activation, a row-parallel layer.

use super::TransformerLayerConfig;
use crate::activation::ActivationFunc;
use crate::comm::Comm;
use crate::recompute::{RecomputeModule, recompute_row_linear_input};
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpError, derive_seed,
};
use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

/// The MLP's own part of a [`TransformerLayerConfig`], which holds what the MLP shares with
/// the attention (hidden size, biases, sequence parallelism, initialisation, seed) and
/// builds the [`ParallelMlp`] (or, with `moe`, the experts from the same shape).
#[derive(Config, Debug)]
pub struct ParallelMlpConfig {
    /// The inner size (Megatron's `ffn_hidden_size`).
    pub ffn_hidden_size: usize,
    /// A gated MLP, `act(gate(x)) ⊙ up(x)` (Megatron's `gated_linear_unit`).
    #[config(default = false)]
    pub gated_linear_unit: bool,
    /// The activation (of the gate under a gated unit).
    #[config(default = "ActivationFunc::Gelu")]
    pub activation_func: ActivationFunc,
}

impl ParallelMlpConfig {
    /// This rank's part of `layer`'s dense MLP (this config is `layer.mlp`).
    pub(crate) fn init(
        &self,
        layer: &TransformerLayerConfig,
        tp: &Comm,
        device: &Device,
    ) -> Result<ParallelMlp, TpError> {
        let (h, ffn) = (layer.hidden_size, self.ffn_hidden_size);
        let column = |name: &str| {
            ColumnParallelLinearConfig::new(h, ffn)
                .with_bias(layer.add_bias_linear)
                .with_sequence_parallel(layer.sequence_parallel)
                .with_gradient_accumulation_fusion(layer.gradient_accumulation_fusion)
                .with_initializer(layer.initializer)
                .with_seed(derive_seed(layer.seed, name))
                .with_skip_bias_add(true)
                .init(tp, device)
        };
        let recompute = &layer.recompute;
        Ok(ParallelMlp {
            dense_h_to_4h: column("mlp.dense_h_to_4h")?,
            dense_h_to_4h_gate: (self.gated_linear_unit)
                .then(|| column("mlp.dense_h_to_4h_gate"))
                .transpose()?,
            dense_4h_to_h: RowParallelLinearConfig::new(ffn, h)
                .with_bias(layer.add_bias_linear)
                .with_sequence_parallel(layer.sequence_parallel)
                .with_gradient_accumulation_fusion(layer.gradient_accumulation_fusion)
                .with_initializer(layer.output_initializer.unwrap_or(layer.initializer))
                .with_seed(derive_seed(layer.seed, "mlp.dense_4h_to_h"))
                .with_skip_bias_add(true)
                .init(tp, device)?,
            activation: self.activation_func,
            recompute_act: recompute.selects(RecomputeModule::MlpAct)
                && !recompute.selects(RecomputeModule::Mlp),
        })
    }
}

/// Column → activation → Row; with a gated linear unit, `act(gate(x)) ⊙ up(x)` → Row.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    /// `h → ffn`, split by output features (the "up" projection under a gated unit).
    pub dense_h_to_4h: ColumnParallelLinear,
    /// The gate, `h → ffn`, split like `dense_h_to_4h` (Megatron's `gated_linear_unit`).
    /// Kept as its own layer rather than fused into `dense_h_to_4h`, so that each rank's
    /// shard is a contiguous slice of the global weight at every TP size.
    pub dense_h_to_4h_gate: Option<ColumnParallelLinear>,
    /// `ffn → h`, split by input features.
    pub dense_4h_to_h: RowParallelLinear,
    /// The activation (of the gate under a gated unit).
    #[module(skip)]
    pub activation: ActivationFunc,
    /// Selective `mlp_act` recomputation: the activation's output, the second layer's
    /// input, is not kept (see [`recompute_row_linear_input`]).
    #[module(skip)]
    pub recompute_act: bool,
}

impl ParallelMlp {
    /// `[s, b, h]` → `[s, b, h]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        match self.forward_with_bias(x) {
            (out, Some(bias)) => out + bias.unsqueeze(),
            (out, None) => out,
        }
    }

    /// Like [`forward`](Self::forward), but returns the second layer's bias instead of
    /// adding it when that layer was built with `skip_bias_add` (as
    /// [`TransformerLayerConfig::init`](super::TransformerLayerConfig::init) does), for the fused bias + dropout + residual add.
    pub fn forward_with_bias(&self, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        let gate = self
            .dense_h_to_4h_gate
            .as_ref()
            .map(|gate| gate.forward_with_bias(x.clone()));
        self.forward_from_projections(self.dense_h_to_4h.forward_with_bias(x), gate)
    }

    /// The first layers: the gate (when gated), then `dense_h_to_4h`.
    pub(crate) fn first_layers(&self) -> Vec<&ColumnParallelLinear> {
        self.dense_h_to_4h_gate
            .iter()
            .chain([&self.dense_h_to_4h])
            .collect()
    }

    /// [`forward_with_bias`](Self::forward_with_bias) from the first layers' outputs, each
    /// with its unadded bias (a caller that forms them itself: `layernorm` recomputation).
    pub(crate) fn forward_from_projections(
        &self,
        (h, bias): (Tensor<3>, Option<Tensor<1>>),
        gate: Option<(Tensor<3>, Option<Tensor<1>>)>,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        let add = |x: Tensor<3>, b: Option<Tensor<1>>| match b {
            Some(b) => x + b.unsqueeze(),
            None => x,
        };
        if self.recompute_act {
            // The biases are added before the region, which takes its input as one tensor;
            // over `[tokens, ffn]` rows, so that the bias gradient is summed in the order the
            // fused bias + GeLU sums it.
            let add_rows = |x: Tensor<3>, b: Option<Tensor<1>>| match b {
                Some(b) => {
                    let [s, n, f] = x.dims();
                    (x.reshape([s * n, f]) + b.unsqueeze()).reshape([s, n, f])
                }
                None => x,
            };
            let packed = match gate {
                None => add_rows(h, bias),
                Some((g, gate_bias)) => {
                    Tensor::cat(vec![add_rows(g, gate_bias), add_rows(h, bias)], 0)
                }
            };
            return self.forward_packed(packed);
        }
        // Built with `skip_bias_add`, the first layer hands its bias to the activation.
        let up = match gate {
            None => self.activation.apply(h, bias),
            Some((g, gate_bias)) => gated(self.activation, g, gate_bias, add(h, bias)),
        };
        self.dense_4h_to_h.forward_with_bias(up)
    }

    /// The second layer over the activation of `packed`: the first layers' outputs, biases
    /// added, stacked along dim 0 (the gate first), without keeping the activation's output
    /// (`mlp_act` recomputation).
    pub(crate) fn forward_packed(&self, packed: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        let activation = self.activation;
        let parts = if self.dense_h_to_4h_gate.is_some() {
            2
        } else {
            1
        };
        let none: Option<Param<Tensor<1>>> = None;
        let act = move |_: &Option<Param<Tensor<1>>>, mut p: Vec<Tensor<3>>| {
            let last = p.pop().expect("one part per first layer");
            match p.pop() {
                Some(g) => gated(activation, g, None, last),
                None => activation.apply(last, None),
            }
        };
        recompute_row_linear_input(&none, packed, parts, act, &self.dense_4h_to_h)
            .expect("one part per first layer, stacked by construction")
    }
}

/// A gated unit's activation, `act(gate + bias) ⊙ up`.
fn gated(
    activation: ActivationFunc,
    gate: Tensor<3>,
    bias: Option<Tensor<1>>,
    up: Tensor<3>,
) -> Tensor<3> {
    match (activation, bias) {
        // SwiGLU: one fused pass each way (Flex's native loops, a kernel on GPUs).
        (ActivationFunc::Silu, Some(b)) => activation.glu(gate + b.unsqueeze(), up),
        (act, Some(b)) => act.apply(gate, Some(b)) * up,
        (act, None) => act.glu(gate, up),
    }
}
