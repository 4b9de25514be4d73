//! The experts: one MLP per expert, run one after the other on its tokens (Megatron's
//! `SequentialMLP`). Each expert's weights are drawn from a seed of its *global* index, so
//! a layer split over any number of expert-parallel ranks starts from the same experts.

use crate::activation::ActivationFunc;
use crate::tensor_parallel::{LayoutOwner, MasterInit, ParallelAttrs, TpError, derive_seed};
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};

/// One expert: `linear_fc1` (`[hidden, ffn]`, or `[hidden, 2·ffn]` with the gate's
/// columns first for a gated linear unit) and `linear_fc2` (`[ffn, hidden]`), no biases.
#[derive(Module, Debug)]
pub struct ExpertMlp {
    /// Up projection (gate first, then up, when gated).
    pub linear_fc1: Param<Tensor<2>>,
    /// Down projection.
    pub linear_fc2: Param<Tensor<2>>,
    #[module(skip)]
    gated: bool,
    #[module(skip)]
    activation: ActivationFunc,
    #[module(skip)]
    layout: LayoutOwner,
}

/// What an expert is built from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertShape {
    pub hidden: usize,
    pub ffn: usize,
    pub gated: bool,
    pub activation: ActivationFunc,
    pub initializer: MasterInit,
    pub output_initializer: MasterInit,
    pub seed: u64,
}

impl ExpertShape {
    /// Expert `global` of the layer, on `device`.
    pub(crate) fn init(&self, global: usize, device: &Device) -> Result<ExpertMlp, TpError> {
        self.initializer.check()?;
        self.output_initializer.check()?;
        let width = if self.gated { 2 * self.ffn } else { self.ffn };
        let param = |init: MasterInit, rows: usize, cols: usize, name: &str| {
            let seed = derive_seed(self.seed, &format!("experts.{global}.{name}"));
            let values = init.values(rows * cols, rows, seed);
            Param::from_tensor(Tensor::<2>::from_data(
                TensorData::new(values, [rows, cols]),
                device,
            ))
        };
        let expert = ExpertMlp {
            linear_fc1: param(self.initializer, self.hidden, width, "linear_fc1"),
            linear_fc2: param(self.output_initializer, self.ffn, self.hidden, "linear_fc2"),
            gated: self.gated,
            activation: self.activation,
            layout: LayoutOwner::default(),
        };
        expert.state_attrs();
        Ok(expert)
    }
}

impl ExpertMlp {
    fn state_attrs(&self) {
        for id in [self.linear_fc1.id, self.linear_fc2.id] {
            self.layout.state(id, ParallelAttrs::expert());
        }
    }

    /// `fc2(act(fc1(x)) · weight)` on `x` (`[n, hidden]`), each row scaled by its routing
    /// weight (`[n, 1]`) before the down projection, as Megatron's experts apply it.
    pub fn forward(&self, x: Tensor<2>, weight: Tensor<2>) -> Tensor<2> {
        self.state_attrs();
        let h = x.matmul(self.linear_fc1.val());
        let act = if self.gated {
            let [gate, up] = h
                .chunk(2, 1)
                .try_into()
                .expect("two halves of an even width");
            self.activation.glu(gate, up)
        } else {
            self.activation.apply(h, None)
        };
        let dtype = act.dtype();
        (act * weight.cast(dtype)).matmul(self.linear_fc2.val())
    }

    /// Zero times every weight: added to a layer's output when this expert got no token, so
    /// that its gradient exists (zero) on every rank and the expert data-parallel reduction
    /// sees the same parameters everywhere.
    pub(crate) fn zero_touch(&self) -> Tensor<1> {
        (self.linear_fc1.val().sum() + self.linear_fc2.val().sum()) * 0.0
    }
}
