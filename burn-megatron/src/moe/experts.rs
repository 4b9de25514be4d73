//! The experts: one MLP per expert, run one after the other on its tokens (Megatron's
//! `SequentialMLP`). Each expert's weights are drawn from a seed of its *global* index, so
//! a layer split over any number of expert-parallel ranks starts from the same experts; with
//! expert tensor parallelism each rank keeps its slice of those weights, split as the dense
//! MLP's (the up and gate projections by output features, the down projection by input
//! features), and its outputs are partial sums the dispatcher reduces.

use crate::activation::ActivationFunc;
use crate::tensor_parallel::{
    LayoutOwner, MasterInit, ParallelAttrs, TpError, derive_seed, slice_cols, slice_rows,
};
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};

/// One expert (this rank's slice of it under expert tensor parallelism): `linear_fc1`
/// (`[hidden, ffn]`, the up projection of a gated unit), `linear_fc1_gate` (`[hidden, ffn]`,
/// the gate of a gated unit) and `linear_fc2` (`[ffn, hidden]`), no biases.
#[derive(Module, Debug)]
pub struct ExpertMlp {
    /// Up projection.
    pub linear_fc1: Param<Tensor<2>>,
    /// The gate of a gated linear unit (SwiGLU's), split like `linear_fc1`.
    pub linear_fc1_gate: Option<Param<Tensor<2>>>,
    /// Down projection.
    pub linear_fc2: Param<Tensor<2>>,
    #[module(skip)]
    activation: ActivationFunc,
    #[module(skip)]
    split: bool,
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
    /// This rank's slice of expert `global` of the layer, on `device`: slice `etp_rank` of
    /// `etp` along the FFN width.
    pub(crate) fn init(
        &self,
        global: usize,
        (etp_rank, etp): (usize, usize),
        device: &Device,
    ) -> Result<ExpertMlp, TpError> {
        self.initializer.check()?;
        self.output_initializer.check()?;
        let (h, f) = (self.hidden, self.ffn);
        if etp == 0 || !f.is_multiple_of(etp) {
            return Err(TpError::Invalid(format!(
                "the experts' FFN width {f} does not split over {etp} expert tensor-parallel \
                 ranks (--moe-ffn-hidden-size must be divisible by \
                 --expert-tensor-parallel-size)"
            )));
        }
        let part = f / etp;
        let first = etp_rank * part;
        let param = |values: Vec<f32>, dims: [usize; 2]| {
            Param::from_tensor(Tensor::<2>::from_data(
                TensorData::new(values, dims),
                device,
            ))
        };
        let draw = |init: MasterInit, rows: usize, cols: usize, name: &str| {
            let seed = derive_seed(self.seed, &format!("experts.{global}.{name}"));
            init.values(rows * cols, rows, seed)
        };
        // One draw of the whole fc1, the gate's columns first: the same experts at any split.
        let width = if self.gated { 2 * f } else { f };
        let fc1 = draw(self.initializer, h, width, "linear_fc1");
        let up = if self.gated { f } else { 0 };
        let fc2 = draw(self.output_initializer, f, h, "linear_fc2");
        let expert = ExpertMlp {
            linear_fc1: param(slice_cols(&fc1, width, up + first, part), [h, part]),
            linear_fc1_gate: (self.gated)
                .then(|| param(slice_cols(&fc1, width, first, part), [h, part])),
            linear_fc2: param(slice_rows(&fc2, h, first, part), [part, h]),
            activation: self.activation,
            split: etp > 1,
            layout: LayoutOwner::default(),
        };
        expert.state_attrs();
        Ok(expert)
    }
}

impl ExpertMlp {
    fn state_attrs(&self) {
        // Split over the expert tensor-parallel group, which is the tensor-parallel group
        // (see `ParallelConfig::validate`): shards sit where the dense layers' do.
        let attrs = |dim| ParallelAttrs::expert(self.split.then_some(dim));
        let fc1 = self.linear_fc1_gate.iter().chain([&self.linear_fc1]);
        for p in fc1 {
            self.layout.state(p.id, attrs(1));
        }
        self.layout.state(self.linear_fc2.id, attrs(0));
    }

    /// `fc2(act(fc1(x)) · weight)` on `x` (`[n, hidden]`), each row scaled by its routing
    /// weight (`[n, 1]`) before the down projection, as Megatron's experts apply it. Under
    /// expert tensor parallelism this is this rank's partial sum of the output.
    pub fn forward(&self, x: Tensor<2>, weight: Tensor<2>) -> Tensor<2> {
        self.state_attrs();
        let weights = [
            Some(&self.linear_fc1),
            self.linear_fc1_gate.as_ref(),
            Some(&self.linear_fc2),
        ];
        for w in weights.into_iter().flatten() {
            crate::tensor_parallel::refuse_adapter(w, "ExpertMlp");
        }
        let act = match &self.linear_fc1_gate {
            Some(gate) => {
                let g = x.clone().matmul(gate.val());
                self.activation.glu(g, x.matmul(self.linear_fc1.val()))
            }
            None => self.activation.apply(x.matmul(self.linear_fc1.val()), None),
        };
        let dtype = act.dtype();
        (act * weight.cast(dtype)).matmul(self.linear_fc2.val())
    }

    /// Zero times every weight: added to a layer's output when this expert got no token, so
    /// that its gradient exists (zero) on every rank and the expert data-parallel reduction
    /// sees the same parameters everywhere.
    pub(crate) fn zero_touch(&self) -> Tensor<1> {
        let mut sum = self.linear_fc1.val().sum() + self.linear_fc2.val().sum();
        if let Some(gate) = &self.linear_fc1_gate {
            sum = sum + gate.val().sum();
        }
        sum * 0.0
    }
}
