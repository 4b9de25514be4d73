//! `ParallelMlp`: column-parallel layer(s), the activation, a row-parallel layer.

use crate::activation::ActivationFunc;
use crate::recompute::recompute_row_linear_input;
use crate::tensor_parallel::{ColumnParallelLinear, RowParallelLinear};
use burn::module::{Module, Param};
use burn::tensor::Tensor;

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
