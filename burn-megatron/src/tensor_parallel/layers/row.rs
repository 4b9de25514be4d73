//! `RowParallelLinear`: the input features split, the outputs summed over the ranks.

use super::*;

/// Configuration of a [`RowParallelLinear`].
#[derive(Config, Debug)]
pub struct RowParallelLinearConfig {
    /// Input features of the full layer (split over the tensor-parallel ranks).
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Whether the layer has a bias (full and duplicated, added after the reduction).
    #[config(default = true)]
    pub bias: bool,
    /// The input is already split along its last dim (the output of a column-parallel
    /// layer); otherwise it is split here.
    #[config(default = true)]
    pub input_is_parallel: bool,
    /// Do not add the bias; [`RowParallelLinear::forward_with_bias`] returns it.
    #[config(default = false)]
    pub skip_bias_add: bool,
    /// Reduce-scatter the output along dim 0 (sequence parallel) instead of all-reducing.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Megatron's `gradient_accumulation_fusion`: the weight gradient is `xᵀ·dy` summed in
    /// f32 by a fused kernel and handed back as an f32 tensor, also for bf16/f16 weights
    /// (see `burn_megatron_kernels::linear_with_grad_accumulation`).
    #[config(default = false)]
    pub gradient_accumulation_fusion: bool,
    /// Weight initialisation of the full master weight.
    #[config(default = "MasterInit::KaimingUniform")]
    pub initializer: MasterInit,
    /// Bias initialisation.
    #[config(default = "MasterInit::ZEROS")]
    pub bias_initializer: MasterInit,
    /// Seed of the master weight (and, plus one, of the bias).
    #[config(default = 0)]
    pub seed: u64,
}

/// A linear layer whose input features are split across tensor-parallel ranks.
///
/// `Y = X·W + b` with `W` split by rows and `X` by columns: rank `i` computes `X_i·W_i`,
/// the partial products are summed over the group, then `b` is added once.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// This rank's weight slice, `[d_input / tp, d_output]`.
    pub weight: Param<Tensor<2>>,
    /// The full bias, `[d_output]`, the same on every rank.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    tp: Comm,
    #[module(skip)]
    layout: LayoutOwner,
    #[module(skip)]
    input_is_parallel: bool,
    #[module(skip)]
    skip_bias_add: bool,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    gradient_accumulation_fusion: bool,
}

impl RowParallelLinearConfig {
    /// Initialises this rank's shard on `device` (independent of the TP size).
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<RowParallelLinear, TpError> {
        let (rank, size) = (tp.group().rank(), tp.group().size());
        let part = partition(self.d_input, size, "input features")?;
        self.initializer.check()?;
        self.bias_initializer.check()?;
        let (init, bias_init) = (self.initializer, self.bias_initializer);
        let (d_input, d_output, seed) = (self.d_input, self.d_output, self.seed);
        let weight = lazy_host_param([part, d_output], device, move || {
            let full = init.values(d_input * d_output, d_input, seed);
            slice_rows(&full, d_output, rank * part, part)
        });
        let bias = self.bias.then(|| {
            lazy_host_param([d_output], device, move || {
                bias_init.values(d_output, d_input, seed.wrapping_add(1))
            })
        });
        let layer = RowParallelLinear {
            weight,
            bias,
            tp: tp.clone(),
            layout: LayoutOwner::default(),
            input_is_parallel: self.input_is_parallel,
            skip_bias_add: self.skip_bias_add,
            sequence_parallel: self.sequence_parallel,
            gradient_accumulation_fusion: self.gradient_accumulation_fusion,
        };
        layer.state_attrs();
        Ok(layer)
    }
}

impl RowParallelLinear {
    /// This rank's row shard of a plain Burn `Linear` (the same full layer on every rank), as
    /// `config` says to run it (by default, on an input already split along its last dim:
    /// a column-parallel layer's output). Fails when the input features do not split over
    /// the group.
    ///
    /// ```
    /// use burn::nn::{Initializer, LinearConfig};
    /// use burn_megatron::launch::{self, LaunchOptions};
    /// use burn_megatron::tensor_parallel::{RowParallelLinear, RowParallelLinearConfig, TpError};
    /// use burn_megatron::topology::ParallelConfig;
    ///
    /// let dims = launch::threads(&ParallelConfig::new(2, 2, 1), LaunchOptions::default(), |ctx| {
    ///     let plain = LinearConfig::new(6, 4)
    ///         .with_initializer(Initializer::Constant { value: 0.5 })
    ///         .init(&ctx.device);
    ///     let config = RowParallelLinearConfig::new(6, 4);
    ///     let layer = RowParallelLinear::from_linear(&plain, &config, &ctx.groups.tp)?;
    ///     Ok::<_, TpError>(layer.weight.dims())
    /// })
    /// .unwrap();
    /// assert_eq!(dims, vec![[3, 4], [3, 4]]);
    /// ```
    pub fn from_linear(
        linear: &Linear,
        config: &RowParallelLinearConfig,
        tp: &Comm,
    ) -> Result<Self, TpError> {
        no_adapter(&linear.weight, "RowParallelLinear::from_linear")?;
        let [d_input, _] = linear.weight.dims();
        let part = partition(d_input, tp.group().size(), "input features")?;
        let weight = linear
            .weight
            .val()
            .narrow(0, tp.group().rank() * part, part);
        let weight = super::super::shard_param(weight);
        let bias = linear
            .bias
            .as_ref()
            .map(|b| super::super::shard_param(b.val()));
        let layer = Self {
            weight,
            bias,
            tp: tp.clone(),
            layout: LayoutOwner::default(),
            input_is_parallel: config.input_is_parallel,
            skip_bias_add: config.skip_bias_add,
            sequence_parallel: config.sequence_parallel,
            gradient_accumulation_fusion: config.gradient_accumulation_fusion,
        };
        layer.state_attrs();
        Ok(layer)
    }

    /// States the layout of the weight (split along dim 0) and of the full bias (partial
    /// gradients under sequence parallelism), at init and at every forward.
    fn state_attrs(&self) {
        self.layout.state(self.weight.id, ParallelAttrs::sharded(0));
        if let Some(b) = &self.bias {
            let attrs = if self.sequence_parallel {
                ParallelAttrs::sequence_parallel()
            } else {
                ParallelAttrs::default()
            };
            self.layout.state(b.id, attrs);
        }
    }

    /// `[..., d_input / tp]` (or `[..., d_input]` when the input is not parallel) →
    /// `[..., d_output]`; under sequence parallelism dim 0 of the output is split.
    ///
    /// # Panics
    ///
    /// As [`ColumnParallelLinear::forward`], on an input of another dtype than the weight
    /// with `gradient_accumulation_fusion`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_with_bias(input).0
    }

    /// Like [`forward`](Self::forward), and returns the bias when `skip_bias_add` is set.
    pub fn forward_with_bias<const D: usize>(
        &self,
        input: Tensor<D>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        self.parallel().forward(input)
    }

    /// Gathers the shards of every rank back into the full plain Burn `Linear` (a
    /// collective: every rank of the group must call it). The result is not tracked.
    pub fn to_linear(&self) -> Result<Linear, TpError> {
        no_adapter(&self.weight, "RowParallelLinear::to_linear")?;
        let w = crate::comm::tensor::all_gather(&*self.tp, self.weight.val().detach(), 0)?;
        let bias = self
            .bias
            .as_ref()
            .map(|b| Param::from_tensor(b.val().detach()));
        Ok(Linear {
            weight: Param::from_tensor(w),
            bias,
        })
    }
}

impl LinearShard for RowParallelLinear {
    fn parallel(&self) -> ParallelLinear<'_> {
        self.state_attrs();
        ParallelLinear {
            name: "RowParallelLinear",
            weight: &self.weight,
            bias: self.bias.as_ref(),
            tp: &self.tp,
            partition: Partition::Row {
                input_is_parallel: self.input_is_parallel,
                sum_bias_grad_in_graph: false,
            },
            sequence_dim: self.sequence_parallel.then_some(0),
            skip_bias_add: self.skip_bias_add,
            fusion: self.gradient_accumulation_fusion,
            adapters: false,
        }
    }
}
