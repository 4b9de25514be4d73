//! Burn's `SwiGlu`, made of [`Linear`]s a plan can split.

use super::{Linear, LinearConfig, LinearLayout};
use burn::config::Config;
use burn::module::Module;
use burn::nn::Initializer;
use burn::tensor::activation::silu;
use burn::tensor::{Device, Tensor};

/// Burn's `SwiGluConfig`.
#[derive(Config, Debug)]
pub struct SwiGluConfig {
    /// The size of the input features.
    pub d_input: usize,
    /// The size of the output features.
    pub d_output: usize,
    /// If a bias should be used.
    #[config(default = false)]
    pub bias: bool,
    /// The type of function used to initialize the linear layers' parameters (Burn's
    /// default).
    #[config(default = "burn::nn::SwiGluConfig::new(1, 1).initializer")]
    pub initializer: Initializer,
    /// How Burn stores the linear layers' weights (see [`LinearConfig::layout`]).
    #[config(default = "LinearLayout::Row")]
    pub layout: LinearLayout,
}

impl SwiGluConfig {
    /// The layer on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> SwiGlu {
        let linear = || {
            LinearConfig::new(self.d_input, self.d_output)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .with_layout(self.layout)
                .init(device)
        };
        SwiGlu {
            linear_inner: linear(),
            linear_outer: linear(),
        }
    }
}

/// Burn's `SwiGlu`: `silu(linear_inner(x)) · linear_outer(x)`; a column rule on it splits
/// both.
#[derive(Module, Debug)]
pub struct SwiGlu {
    /// The gate.
    pub linear_inner: Linear,
    /// The value.
    pub linear_outer: Linear,
}

impl SwiGlu {
    /// `[..., d_input]` → `[..., d_output]` (column-parallel: `[..., d_output / tp]`).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        silu(self.linear_inner.forward(input.clone())) * self.linear_outer.forward(input)
    }
}

impl From<burn::nn::SwiGlu> for SwiGlu {
    /// Burn's built layer, its parameters kept.
    fn from(swiglu: burn::nn::SwiGlu) -> Self {
        Self {
            linear_inner: swiglu.linear_inner.into(),
            linear_outer: swiglu.linear_outer.into(),
        }
    }
}
