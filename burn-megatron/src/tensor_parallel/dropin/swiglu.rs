//! `ParallelSwiGlu`: Burn's `nn::SwiGlu` with both projections column-parallel.

use super::super::{ColumnParallelLinear, ColumnParallelLinearConfig, TpError, derive_seed};
use super::heads::split_features;
use super::init::master_init;
use crate::comm::Comm;
use burn::module::Module;
use burn::nn::{LinearLayout, SwiGlu, SwiGluConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Tensor};

/// `silu(linear_inner(x)) ⊙ linear_outer(x)` with both projections split by output
/// features: each rank computes its `d_output / tp` of the gated product, which the next
/// layer, a [`RowParallelLinear`](super::super::RowParallelLinear), reduces (Llama's
/// `w2(swiglu(x))`). Field names and record paths are `nn::SwiGlu`'s.
///
/// ```
/// use burn::nn::SwiGluConfig;
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::tensor_parallel::dropin::ParallelSwiGlu;
/// use std::sync::Arc;
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let device = Device::flex();
/// let plain = SwiGluConfig::new(8, 16).init(&device);
/// let swiglu = ParallelSwiGlu::from_swiglu(&plain, &tp).unwrap();
/// let y = swiglu.forward(Tensor::<3>::ones([2, 3, 8], &device));
/// assert_eq!(y.dims(), [2, 3, 16]); // 16 / tp output features
/// ```
#[derive(Module, Debug)]
pub struct ParallelSwiGlu {
    /// The gate's projection, `d_input → d_output / tp`.
    pub linear_inner: ColumnParallelLinear,
    /// The gated value's projection, `d_input → d_output / tp`.
    pub linear_outer: ColumnParallelLinear,
}

impl ParallelSwiGlu {
    /// This rank's part of a SwiGLU `config` describes, drawn from `seed` as every TP size
    /// draws it (see [`master_init`] for the initialisers that can be).
    pub fn new(
        config: &SwiGluConfig,
        tp: &Comm,
        seed: u64,
        device: &Device,
    ) -> Result<Self, TpError> {
        check_layout(config.layout)?;
        split_features(
            "SwiGlu",
            "output features",
            config.d_output,
            tp.group().size(),
        )?;
        let init = master_init(&config.initializer)?;
        let column = |name: &str| {
            ColumnParallelLinearConfig::new(config.d_input, config.d_output)
                .with_bias(config.bias)
                .with_initializer(init)
                .with_bias_initializer(init)
                .with_seed(derive_seed(seed, name))
                .init(tp, device)
        };
        Ok(Self {
            linear_inner: column("linear_inner")?,
            linear_outer: column("linear_outer")?,
        })
    }

    /// This rank's shard of `swiglu`: its `d_output / tp` output features of both projections.
    pub fn from_swiglu(swiglu: &SwiGlu, tp: &Comm) -> Result<Self, TpError> {
        let [_, d_output] = swiglu.linear_inner.weight.dims();
        split_features("SwiGlu", "output features", d_output, tp.group().size())?;
        Ok(Self {
            linear_inner: ColumnParallelLinear::split(&swiglu.linear_inner, tp)?,
            linear_outer: ColumnParallelLinear::split(&swiglu.linear_outer, tp)?,
        })
    }

    /// The whole `nn::SwiGlu`, gathered from the tensor-parallel ranks (collective: every
    /// rank calls it), untracked.
    pub fn to_swiglu(&self) -> Result<SwiGlu, TpError> {
        Ok(SwiGlu {
            linear_inner: self.linear_inner.to_linear()?,
            linear_outer: self.linear_outer.to_linear()?,
        })
    }

    /// `[…, d_input]` → `[…, d_output / tp]`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let gate = silu(self.linear_inner.forward(input.clone()));
        gate.mul(self.linear_outer.forward(input))
    }
}

/// Refuses Burn's column layout, whose saved weight is transposed: the parallel layers keep
/// the row layout's `[d_input, d_output]`.
pub(super) fn check_layout(layout: LinearLayout) -> Result<(), TpError> {
    match layout {
        LinearLayout::Row => Ok(()),
        LinearLayout::Col => Err(TpError::Invalid(
            "LinearLayout::Col: the parallel layers keep Burn's row layout ([d_input, d_output])"
                .into(),
        )),
    }
}
