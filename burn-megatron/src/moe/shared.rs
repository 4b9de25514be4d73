//! The shared expert (Megatron's `SharedExpertMLP`, `--moe-shared-expert-intermediate-size`):
//! an MLP every token goes through beside its routed experts, split over tensor parallelism
//! as the dense MLP is, optionally scaled per token by `sigmoid(x · w)` (Qwen2-MoE's
//! `shared_expert_gate`).

use super::experts::ExpertShape;
use crate::comm::Comm;
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, LayoutOwner, ParallelAttrs,
    RowParallelLinear, RowParallelLinearConfig, TpError, derive_seed, host_param,
};
use burn::module::{Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::{Device, Tensor};

/// The shared expert: up (and gate) projections split by columns over TP, the down
/// projection by rows, named as the dense MLP's.
#[derive(Module, Debug)]
pub struct SharedExpert {
    /// Up projection.
    pub dense_h_to_4h: ColumnParallelLinear,
    /// Gate projection (gated linear unit).
    pub dense_h_to_4h_gate: Option<ColumnParallelLinear>,
    /// Down projection.
    pub dense_4h_to_h: RowParallelLinear,
    /// The per-token gate's weight, `[1, hidden]` (duplicated over TP).
    pub gate_weight: Option<Param<Tensor<2>>>,
    #[module(skip)]
    shape: ExpertShape,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    tp_size: usize,
    #[module(skip)]
    layout: LayoutOwner,
}

impl SharedExpert {
    /// A shared expert of inner size `shape.ffn`, gated when `gated_output`.
    pub(crate) fn init(
        shape: ExpertShape,
        gated_output: bool,
        sequence_parallel: bool,
        tp: &Comm,
        device: &Device,
    ) -> Result<Self, TpError> {
        let (h, f) = (shape.hidden, shape.ffn);
        let column = |name: &str| {
            ColumnParallelLinearConfig::new(h, f)
                .with_bias(false)
                .with_sequence_parallel(sequence_parallel)
                .with_initializer(shape.initializer)
                .with_seed(derive_seed(shape.seed, name))
                .init(tp, device)
        };
        let gate_weight = gated_output.then(|| {
            let values =
                shape
                    .initializer
                    .values(h, h, derive_seed(shape.seed, "shared_expert_gate"));
            host_param(values, [1, h], device)
        });
        let expert = Self {
            dense_h_to_4h: column("shared_expert.dense_h_to_4h")?,
            dense_h_to_4h_gate: shape
                .gated
                .then(|| column("shared_expert.dense_h_to_4h_gate"))
                .transpose()?,
            dense_4h_to_h: RowParallelLinearConfig::new(f, h)
                .with_bias(false)
                .with_sequence_parallel(sequence_parallel)
                .with_initializer(shape.output_initializer)
                .with_seed(derive_seed(shape.seed, "shared_expert.dense_4h_to_h"))
                .init(tp, device)?,
            gate_weight,
            shape,
            sequence_parallel,
            tp_size: tp.group().size(),
            layout: LayoutOwner::default(),
        };
        expert.state_attrs();
        Ok(expert)
    }

    fn state_attrs(&self) {
        if let Some(w) = &self.gate_weight {
            // Each TP rank gates its own tokens under sequence parallelism.
            let attrs = if self.sequence_parallel && self.tp_size > 1 {
                ParallelAttrs::sequence_parallel()
            } else {
                ParallelAttrs::default()
            };
            self.layout.state(w.id, attrs);
        }
    }

    /// `x` (`[s, b, hidden]`, this rank's tokens) through the shared expert.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.state_attrs();
        let up = self.dense_h_to_4h.forward(x.clone());
        let act = match &self.dense_h_to_4h_gate {
            Some(gate) => self.shape.activation.glu(gate.forward(x.clone()), up),
            None => self.shape.activation.apply(up, None),
        };
        let out = self.dense_4h_to_h.forward(act);
        match &self.gate_weight {
            Some(w) => {
                let [s, b, h] = x.dims();
                let logits = x.reshape([s * b, h]).matmul(w.val().transpose());
                out * sigmoid(logits).reshape([s, b, 1])
            }
            None => out,
        }
    }
}
