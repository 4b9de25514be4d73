//! Burn's `nn::norm`, its [`BatchNorm`] the one that can synchronise and its
//! `Normalization` wrapper holding it: Burn's own wrapper holds Burn's layer, which
//! [`sync_batch_norm`](crate::data_parallel::advanced::sync_batch_norm) must refuse, so a
//! model that picks its norm by config would not swap whole without this one.

pub use crate::data_parallel::batch_norm::{BatchNorm, BatchNormConfig};
use burn::config::Config;
use burn::module::Module;
use burn::nn::Identity;
/// The rest of Burn's `nn::norm` (`GroupNorm`, `InstanceNorm`, `LayerNorm`, `RmsNorm`,
/// `LocalResponseNorm`), so that an import of it swaps whole.
pub use burn::nn::norm::*;
use burn::tensor::{Device, Tensor};

/// Burn's `NormalizationConfig`: which norm a layer takes, chosen by config.
#[derive(Config, Debug)]
#[non_exhaustive]
pub enum NormalizationConfig {
    /// No normalisation.
    Identity,
    /// [`BatchNorm`] (able to span the data-parallel batch).
    Batch(BatchNormConfig),
    /// Burn's `GroupNorm`.
    Group(GroupNormConfig),
    /// Burn's `InstanceNorm`.
    Instance(InstanceNormConfig),
    /// Burn's `LayerNorm`.
    Layer(LayerNormConfig),
    /// Burn's `RmsNorm`.
    Rms(RmsNormConfig),
}

/// Burn's `Normalization`: one of the norms, as [`NormalizationConfig`] chose. Its record
/// and module paths are Burn's wrapper's.
#[derive(Module, Debug)]
#[non_exhaustive]
pub enum Normalization {
    /// No normalisation.
    Identity(Identity),
    /// [`BatchNorm`] (able to span the data-parallel batch).
    Batch(BatchNorm),
    /// Burn's `GroupNorm`.
    Group(GroupNorm),
    /// Burn's `InstanceNorm`.
    Instance(InstanceNorm),
    /// Burn's `LayerNorm`.
    Layer(LayerNorm),
    /// Burn's `RmsNorm`.
    Rms(RmsNorm),
}

/// `From` each norm's config and layer into the wrapper, as Burn has them.
macro_rules! wrap {
    ($($variant:ident: $config:ty, $layer:ty;)*) => {$(
        impl From<$config> for NormalizationConfig {
            fn from(config: $config) -> Self {
                Self::$variant(config)
            }
        }
        impl From<$layer> for Normalization {
            fn from(layer: $layer) -> Self {
                Self::$variant(layer)
            }
        }
    )*};
}

wrap! {
    Batch: BatchNormConfig, BatchNorm;
    Group: GroupNormConfig, GroupNorm;
    Instance: InstanceNormConfig, InstanceNorm;
    Layer: LayerNormConfig, LayerNorm;
    Rms: RmsNormConfig, RmsNorm;
}

impl From<Identity> for Normalization {
    fn from(layer: Identity) -> Self {
        Self::Identity(layer)
    }
}

/// Burn's own `BatchNorm`, converted (a layer Burn built, wrapped).
impl From<burn::nn::BatchNorm> for Normalization {
    fn from(layer: burn::nn::BatchNorm) -> Self {
        Self::Batch(layer.into())
    }
}

impl NormalizationConfig {
    /// The norm on `device`, as Burn's config builds it.
    pub fn init(&self, device: &Device) -> Normalization {
        match self {
            Self::Identity => Identity::new().into(),
            Self::Batch(config) => config.init(device).into(),
            Self::Group(config) => config.init(device).into(),
            Self::Instance(config) => config.init(device).into(),
            Self::Layer(config) => config.init(device).into(),
            Self::Rms(config) => config.init(device).into(),
        }
    }

    /// The same norm over `num_features` features (channels, or the model width).
    pub fn with_num_features(self, num_features: usize) -> Self {
        match self {
            Self::Identity => self,
            Self::Batch(config) => BatchNormConfig {
                num_features,
                ..config
            }
            .into(),
            Self::Group(config) => GroupNormConfig {
                num_channels: num_features,
                ..config
            }
            .into(),
            Self::Instance(config) => InstanceNormConfig {
                num_channels: num_features,
                ..config
            }
            .into(),
            Self::Layer(config) => LayerNormConfig {
                d_model: num_features,
                ..config
            }
            .into(),
            Self::Rms(config) => RmsNormConfig {
                d_model: num_features,
                ..config
            }
            .into(),
        }
    }

    /// The features the norm takes (0 for `Identity`).
    pub fn num_features(&self) -> usize {
        match self {
            Self::Identity => 0,
            Self::Batch(config) => config.num_features,
            Self::Group(config) => config.num_channels,
            Self::Instance(config) => config.num_channels,
            Self::Layer(config) => config.d_model,
            Self::Rms(config) => config.d_model,
        }
    }
}

impl Normalization {
    /// The chosen norm's forward.
    ///
    /// # Panics
    ///
    /// As that norm's.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Identity(norm) => norm.forward(input),
            Self::Batch(norm) => norm.forward(input),
            Self::Group(norm) => norm.forward(input),
            Self::Instance(norm) => norm.forward(input),
            Self::Layer(norm) => norm.forward(input),
            Self::Rms(norm) => norm.forward(input),
        }
    }

    /// The features the norm takes (0 for `Identity`).
    pub fn num_features(&self) -> usize {
        match self {
            Self::Identity(_) => 0,
            Self::Batch(norm) => norm.gamma.shape()[0],
            Self::Group(norm) => norm.num_channels,
            Self::Instance(norm) => norm.num_channels,
            Self::Layer(norm) => norm.gamma.shape()[0],
            Self::Rms(norm) => norm.gamma.shape()[0],
        }
    }
}
