//! `ColumnParallelLinear` and `RowParallelLinear`: Megatron's split linear layers.
//!
//! Weights use Burn's layout, `[d_input, d_output]`. A column-parallel layer splits the
//! output features (weight dim 1, bias dim 0); a row-parallel layer splits the input
//! features (weight dim 0) and keeps a full, duplicated bias added once after the reduction.
//! Under sequence parallelism, activations outside these layers are split along dim 0 (the
//! sequence, Megatron's `[s, b, h]` layout).

mod forward;
mod row;

pub(crate) use forward::{
    LinearShard, ParallelLinear, Partition, check_input_width, gathered_product, matmul_bias,
    product,
};
pub use row::{RowParallelLinear, RowParallelLinearConfig};

use super::attrs::{LayoutOwner, ParallelAttrs, real_part};
use super::init::{MasterInit, slice_cols, slice_rows};
use super::{TpError, lazy_host_param, no_adapter};
use crate::comm::Comm;
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, s};

/// Configuration of a [`ColumnParallelLinear`].
#[derive(Config, Debug)]
pub struct ColumnParallelLinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features of the full layer (split over the tensor-parallel ranks).
    pub d_output: usize,
    /// Whether the layer has a bias.
    #[config(default = true)]
    pub bias: bool,
    /// All-gather the output so every rank gets all `d_output` features.
    #[config(default = false)]
    pub gather_output: bool,
    /// Do not add the bias; [`ColumnParallelLinear::forward_with_bias`] returns it so the
    /// caller can fuse it with what follows.
    #[config(default = false)]
    pub skip_bias_add: bool,
    /// The input is split along dim 0 (sequence parallel) and is all-gathered first; the
    /// layer keeps only this rank's part for backward, which gathers it again.
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
    /// The real output width when `d_output` pads a vocabulary (a GPT's own output layer;
    /// `None`: no padding). The columns from there on are padding: drawn as zeros and left
    /// out of checkpoints, so that layouts which pad the vocabulary differently load each
    /// other's
    /// (Megatron-Core's `allow_shape_mismatch` on the output layer).
    #[config(default = "None")]
    pub unpadded_size: Option<usize>,
}

/// A linear layer whose output features are split across tensor-parallel ranks.
///
/// `Y = X·W + b` with `W = [W_1, …, W_p]` split by columns: rank `i` computes `X·W_i + b_i`.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// This rank's weight slice, `[d_input, d_output / tp]`.
    pub weight: Param<Tensor<2>>,
    /// This rank's bias slice, `[d_output / tp]`.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    tp: Comm,
    #[module(skip)]
    layout: LayoutOwner,
    #[module(skip)]
    gather_output: bool,
    #[module(skip)]
    skip_bias_add: bool,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    gradient_accumulation_fusion: bool,
    #[module(skip)]
    unpadded_size: Option<usize>,
}

impl ColumnParallelLinearConfig {
    /// Initialises this rank's shard on `device`. Every rank draws the full master weight
    /// from `seed` and keeps its slice, so the result does not depend on the TP size.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<ColumnParallelLinear, TpError> {
        let (rank, size) = (tp.group().rank(), tp.group().size());
        let part = partition(self.d_output, size, "output features")?;
        let unpadded_size = unpadded(self.unpadded_size, self.d_output, "output features")?;
        self.initializer.check()?;
        self.bias_initializer.check()?;
        let (init, bias_init) = (self.initializer, self.bias_initializer);
        let (d_input, d_output, seed) = (self.d_input, self.d_output, self.seed);
        // A padded vocabulary's columns are zeros, as a checkpoint's load makes them.
        let real = real_part(unpadded_size, rank * part, part);
        let weight = lazy_host_param([d_input, part], device, move || {
            let full = init.values(d_input * d_output, d_input, seed);
            let mut w = slice_cols(&full, d_output, rank * part, part);
            if part > 0 {
                w.chunks_mut(part).for_each(|row| row[real..].fill(0.0));
            }
            w
        });
        let bias = self.bias.then(|| {
            lazy_host_param([part], device, move || {
                let full = bias_init.values(d_output, d_input, seed.wrapping_add(1));
                let mut b = full[rank * part..(rank + 1) * part].to_vec();
                b[real..].fill(0.0);
                b
            })
        });
        let layer = ColumnParallelLinear {
            weight,
            bias,
            tp: tp.clone(),
            layout: LayoutOwner::default(),
            gather_output: self.gather_output,
            skip_bias_add: self.skip_bias_add,
            sequence_parallel: self.sequence_parallel,
            gradient_accumulation_fusion: self.gradient_accumulation_fusion,
            unpadded_size,
        };
        layer.state_attrs();
        Ok(layer)
    }
}

impl ColumnParallelLinear {
    /// This rank's column shard of a plain Burn `Linear` (the same full layer on every rank),
    /// as `config` says to run it. Fails when the output features do not split over the
    /// group. (A model written with `burn::nn` is split whole by a
    /// [`TpPlan`](crate::dropin::TpPlan) instead.)
    ///
    /// ```
    /// use burn::nn::{Initializer, LinearConfig};
    /// use burn_megatron::launch::{self, LaunchOptions};
    /// use burn_megatron::tensor_parallel::{
    ///     ColumnParallelLinear, ColumnParallelLinearConfig, TpError,
    /// };
    /// use burn_megatron::topology::ParallelConfig;
    ///
    /// let dims = launch::threads(&ParallelConfig::new(2, 2, 1), LaunchOptions::default(), |ctx| {
    ///     // The same plain layer on every rank.
    ///     let plain = LinearConfig::new(4, 6)
    ///         .with_initializer(Initializer::Constant { value: 0.5 })
    ///         .init(&ctx.device);
    ///     let config = ColumnParallelLinearConfig::new(4, 6);
    ///     let layer = ColumnParallelLinear::from_linear(&plain, &config, &ctx.groups.tp)?;
    ///     Ok::<_, TpError>(layer.weight.dims())
    /// })
    /// .unwrap();
    /// assert_eq!(dims, vec![[4, 3], [4, 3]]);
    /// ```
    pub fn from_linear(
        linear: &Linear,
        config: &ColumnParallelLinearConfig,
        tp: &Comm,
    ) -> Result<Self, TpError> {
        no_adapter(&linear.weight, "ColumnParallelLinear::from_linear")?;
        let [_, d_output] = linear.weight.dims();
        let size = tp.group().size();
        let part = partition(d_output, size, "output features")?;
        let unpadded_size = unpadded(config.unpadded_size, d_output, "output features")?;
        let start = tp.group().rank() * part;
        let weight = linear.weight.val().narrow(1, start, part);
        let bias = linear.bias.as_ref().map(|b| b.val().narrow(0, start, part));
        // A padded vocabulary's columns are zeros, whatever the linear held there.
        let real = real_part(unpadded_size, start, part);
        let (weight, bias) = match real < part {
            true => (
                weight.slice_fill(s![.., real..], 0.0),
                bias.map(|b| b.slice_fill(s![real..], 0.0)),
            ),
            false => (weight, bias),
        };
        let weight = super::shard_param(weight);
        let bias = bias.map(super::shard_param);
        let layer = Self {
            weight,
            bias,
            tp: tp.clone(),
            layout: LayoutOwner::default(),
            gather_output: config.gather_output,
            skip_bias_add: config.skip_bias_add,
            sequence_parallel: config.sequence_parallel,
            gradient_accumulation_fusion: config.gradient_accumulation_fusion,
            unpadded_size,
        };
        layer.state_attrs();
        Ok(layer)
    }

    /// States the layout of the weight (split along dim 1) and the bias (dim 0): at init and
    /// at every forward, so it also holds for ids Burn's record loading restored.
    fn state_attrs(&self) {
        let split = |dim| ParallelAttrs::sharded(dim).padded_from(self.unpadded_size);
        self.layout.state(self.weight.id, split(1));
        if let Some(b) = &self.bias {
            self.layout.state(b.id, split(0));
        }
    }

    /// `[..., d_input]` → `[..., d_output]` if `gather_output`, else `[..., d_output / tp]`.
    /// With `skip_bias_add` the bias is not added (see [`forward_with_bias`](Self::forward_with_bias)).
    ///
    /// # Panics
    ///
    /// With `gradient_accumulation_fusion`, on an input whose dtype is not the weight's (the
    /// message names both): Burn's forward signature has no room for an error.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.forward_with_bias(input).0
    }

    /// Like [`forward`](Self::forward), and returns the bias when `skip_bias_add` is set
    /// (Megatron's `(output, output_bias)`).
    pub fn forward_with_bias<const D: usize>(
        &self,
        input: Tensor<D>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        self.parallel().forward(input)
    }

    /// Gathers the shards of every rank back into the full plain Burn `Linear` (a
    /// collective: every rank of the group must call it). The result is not tracked.
    pub fn to_linear(&self) -> Result<Linear, TpError> {
        no_adapter(&self.weight, "ColumnParallelLinear::to_linear")?;
        let w = crate::comm::tensor::all_gather(&*self.tp, self.weight.val().detach(), 1)?;
        let bias = match &self.bias {
            Some(b) => Some(Param::from_tensor(crate::comm::tensor::all_gather(
                &*self.tp,
                b.val().detach(),
                0,
            )?)),
            None => None,
        };
        Ok(Linear {
            weight: Param::from_tensor(w),
            bias,
        })
    }
}

impl LinearShard for ColumnParallelLinear {
    fn parallel(&self) -> ParallelLinear<'_> {
        self.state_attrs();
        ParallelLinear {
            name: "ColumnParallelLinear",
            weight: &self.weight,
            bias: self.bias.as_ref(),
            tp: &self.tp,
            partition: Partition::Column {
                gather_output: self.gather_output,
            },
            sequence_dim: self.sequence_parallel.then_some(0),
            skip_bias_add: self.skip_bias_add,
            fusion: self.gradient_accumulation_fusion,
            adapters: false,
        }
    }
}

/// A padded width's real extent, checked against the `full` width. A real extent equal to
/// the full one is still stated: a checkpoint then says its tensor is the real vocabulary,
/// not a padded one (see `checkpoint::tensors::same_tensor`).
pub(crate) fn unpadded(
    real: Option<usize>,
    full: usize,
    what: &str,
) -> Result<Option<usize>, TpError> {
    match real {
        Some(r) if r == 0 || r > full => Err(TpError::Invalid(format!(
            "the unpadded size ({r}) must be in [1, {full}], the padded {what}"
        ))),
        real => Ok(real),
    }
}

/// `total / tp`, or an error naming what does not divide.
pub(crate) fn partition(total: usize, tp: usize, what: &str) -> Result<usize, TpError> {
    if !total.is_multiple_of(tp) {
        return Err(TpError::Indivisible(format!(
            "{what} ({total}) are not divisible by the tensor-parallel size ({tp})"
        )));
    }
    Ok(total / tp)
}
