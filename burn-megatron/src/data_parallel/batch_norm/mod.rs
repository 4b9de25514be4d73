//! Batch normalisation whose statistics are those of the whole data-parallel batch
//! (PyTorch's `SyncBatchNorm`). Under data parallelism each rank's `BatchNorm` normalises over
//! its own micro-batch; with small per-rank batches (detection, segmentation, large images)
//! those statistics are noisy, and the model trains differently from one rank fed the whole
//! batch. A synchronised layer sums its per-channel statistics over the group, so DP `n`
//! trains as one rank over the `n` batches together: the same outputs, gradients and running
//! statistics.
//!
//! It is Burn's `BatchNorm` (the same config, record and forward; Burn's fields and a `sync`
//! slot without parameters) with a group that [`sync_batch_norm`] sets; until then it
//! computes exactly what Burn's does.

use crate::comm::{Comm, CommError};
use crate::tensor_parallel::mappings::{Mapping, apply};
use burn::config::Config;
use burn::module::{
    Content, Devices, DisplaySettings, Flag, Module, ModuleDisplay, ModuleDisplayDefault,
    ModuleMapper, ModuleVisitor, Param, RunningState,
};
use burn::tensor::{DType, Device, Tensor};
use std::cell::RefCell;

/// Burn's `BatchNormConfig`.
#[derive(Config, Debug)]
pub struct BatchNormConfig {
    /// The number of features. Must be greater than zero.
    pub num_features: usize,
    /// A finite, positive value required for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// A finite momentum in `[0, 1]` used to update the running statistics.
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl BatchNormConfig {
    /// The layer, as Burn's config builds it (and with Burn's checks of the numbers), not
    /// yet synchronised.
    pub fn init(&self, device: &Device) -> BatchNorm {
        burn::nn::BatchNormConfig::new(self.num_features)
            .with_epsilon(self.epsilon)
            .with_momentum(self.momentum)
            .init(device)
            .into()
    }
}

/// Burn's `BatchNorm` over `[batch, channels, ...]`, whose training statistics are the whole
/// data-parallel batch's once [`sync_batch_norm`] gave it a group. Its record is Burn's
/// layer's.
///
/// The running variance is the biased one, as Burn keeps it (PyTorch keeps the unbiased).
#[derive(Module, Debug)]
#[module(custom_display)]
pub struct BatchNorm {
    /// The learnable weight gamma.
    pub gamma: Param<Tensor<1>>,
    /// The learnable weight beta.
    pub beta: Param<Tensor<1>>,
    /// Whether training behaviour is enabled for this layer.
    pub training: Param<Flag>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running variance.
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum used to update the running statistics.
    pub momentum: f64,
    /// A value required for numerical stability.
    pub epsilon: f64,
    /// The group whose batches the statistics span (none: this rank's alone).
    pub sync: SyncGroup,
}

impl From<burn::nn::BatchNorm> for BatchNorm {
    fn from(layer: burn::nn::BatchNorm) -> Self {
        let burn::nn::BatchNorm {
            gamma,
            beta,
            training,
            running_mean,
            running_var,
            momentum,
            epsilon,
        } = layer;
        Self {
            gamma,
            beta,
            training,
            running_mean,
            running_var,
            momentum,
            epsilon,
            sync: SyncGroup::default(),
        }
    }
}

impl BatchNorm {
    /// Burn's forward: the batch's statistics when training (on an autodiff device, the
    /// layer not frozen), the running ones otherwise. Synchronised, a training forward is a
    /// collective over the group: every member runs it, on inputs of the same channels
    /// (their batch sizes may differ).
    ///
    /// # Panics
    ///
    /// As Burn's: if the input has rank < 2 or its second axis is not `num_features`; and if
    /// a collective fails (see [`mappings`](crate::tensor_parallel::mappings)).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [channels] = self.gamma.shape().dims();
        burn::tensor::assert_shape!(input, [_, channels, ..]);
        let device = input.device();
        if !(device.is_autodiff() && self.training.is_enabled()) {
            return burn::tensor::module::batch_norm(
                input,
                self.gamma.val(),
                self.beta.val(),
                self.running_mean.value().to_device(&device),
                self.running_var.value().to_device(&device),
                self.epsilon,
            );
        }
        let (output, mean, variance) = match self.sync.group() {
            Some(group) => self.synced(input, group),
            None => {
                let gamma = self.gamma.val();
                let r = burn::tensor::module::batch_norm_train(
                    input,
                    gamma,
                    self.beta.val(),
                    self.epsilon,
                );
                (r.output, r.mean, r.variance)
            }
        };
        let running = |state: &RunningState<Tensor<1>>, batch: Tensor<1>| {
            let old = state.value_sync().to_device(&device);
            let batch = batch.detach().cast(old.dtype());
            let new = old.mul_scalar(1.0 - self.momentum) + batch * self.momentum;
            state.update(new.detach());
        };
        running(&self.running_mean, mean);
        running(&self.running_var, variance);
        output
    }

    /// The normalised output and the group's mean and biased variance. Two passes (the sum,
    /// then the sum of squared deviations from the group's mean), each one all-reduce of
    /// `[channels]` (the first carries the count), so the variance is as exact as Burn's.
    /// Every rank's loss depends on the sums, so backward all-reduces their gradients too.
    /// The statistics are summed in f32 whatever the input's dtype (a bf16 sum over the
    /// group's batch would lose most of its digits); the output is in the input's.
    fn synced<const D: usize>(
        &self,
        input: Tensor<D>,
        group: &Comm,
    ) -> (Tensor<D>, Tensor<1>, Tensor<1>) {
        let dims = input.dims();
        let channels = dims[1];
        let per_channel = |x: Tensor<D>| -> Tensor<1> {
            x.swap_dims(0, 1)
                .reshape([channels as i64, -1])
                .sum_dim(1)
                .reshape([channels])
        };
        // Megatron's conjugate pair over the data-parallel group: all-reduce forward (the
        // first), all-reduce backward (the second).
        let all_reduce = |x: Tensor<1>| {
            let summed = apply(x, Mapping::ReduceFrom, group);
            apply(summed, Mapping::CopyTo, group)
        };
        let mut shape = [1; D];
        shape[1] = channels;
        let (device, dtype) = (input.device(), input.dtype());
        let input = input.cast(DType::F32);
        let count = Tensor::<1>::full(
            [1],
            (input.shape().num_elements() / channels) as f64,
            &device,
        )
        .cast(DType::F32);
        let sums = all_reduce(Tensor::cat(vec![per_channel(input.clone()), count], 0));
        let count = sums.clone().slice(channels..channels + 1);
        let mean = sums.slice(0..channels) / count.clone();
        let centered = input - mean.clone().reshape(shape);
        let squares = all_reduce(per_channel(centered.clone().powi_scalar(2)));
        let variance = squares / count;
        let inv_std = (variance.clone() + self.epsilon).sqrt().recip();
        let affine = |p: &Param<Tensor<1>>| p.val().cast(DType::F32).reshape(shape);
        let output = centered * inv_std.reshape(shape) * affine(&self.gamma) + affine(&self.beta);
        (output.cast(dtype), mean, variance)
    }
}

impl ModuleDisplay for BatchNorm {
    fn custom_settings(&self) -> Option<DisplaySettings> {
        DisplaySettings::new()
            .with_new_line_after_attribute(false)
            .optional()
    }

    fn custom_content(&self, content: Content) -> Option<Content> {
        let [num_features] = self.beta.shape().dims();
        let group = self.sync.group().map(|g| g.group().size()).unwrap_or(1);
        content
            .add("num_features", &num_features)
            .add("momentum", &self.momentum)
            .add("epsilon", &self.epsilon)
            .add("sync_ranks", &group)
            .optional()
    }
}

thread_local! {
    /// The group [`sync_batch_norm`] hands each layer it maps.
    static OFFER: RefCell<Option<Comm>> = const { RefCell::new(None) };
}

/// The group a [`BatchNorm`]'s statistics span: a module with no parameters, so that records
/// and module paths stay those of Burn's layer.
#[derive(Debug, Clone, Default)]
pub struct SyncGroup(Option<Comm>);

impl SyncGroup {
    /// The group, if the layer is synchronised over more than one rank.
    pub fn group(&self) -> Option<&Comm> {
        self.0.as_ref().filter(|g| g.group().size() > 1)
    }
}

impl Module for SyncGroup {
    fn collect_devices(&self, devices: Devices) -> Devices {
        devices
    }
    fn fork(self, _: &Device) -> Self {
        self
    }
    fn to_device(self, _: &Device) -> Self {
        self
    }
    fn train(self) -> Self {
        self
    }
    fn valid(&self) -> Self {
        self.clone()
    }
    fn materialize(self) -> Self {
        self
    }
    fn visit<V: ModuleVisitor>(&self, _: &mut V) {}
    fn map<M: ModuleMapper>(self, _: &mut M) -> Self {
        match OFFER.with(|o| o.borrow().clone()) {
            Some(group) => Self(Some(group)),
            None => self,
        }
    }
}

impl ModuleDisplayDefault for SyncGroup {
    fn content(&self, content: Content) -> Option<Content> {
        let size = self.0.as_ref().map(|g| g.group().size()).unwrap_or(1);
        content.add_formatted(&format!("{size} ranks")).optional()
    }
}

impl ModuleDisplay for SyncGroup {}

/// `model` with every [`BatchNorm`] computing its training statistics over `group`'s
/// batches together (PyTorch's `SyncBatchNorm.convert_sync_batchnorm`). The group is the
/// data-parallel one (with context parallelism, the data- and context-parallel one: every
/// rank that holds other samples or positions of them);
/// [`ParallelTraining::sync_batch_norm`](crate::training::ParallelTraining::sync_batch_norm)
/// passes it. Sets no value and moves no data, so it may come before or after the replicas
/// are broadcast, but every member must synchronise the same layers: each one's training
/// forward is then a collective.
///
/// A model may hold no `BatchNorm` (a pipeline stage without one). It is refused, naming the
/// layer, if it holds Burn's own `burn::nn::BatchNorm`, which this cannot change: import
/// `BatchNorm` from `dropin::nn` (the same record), or convert Burn's layer with `From`.
pub fn sync_batch_norm<M: Module>(model: M, group: &Comm) -> Result<M, CommError> {
    /// The paths of the `BatchNorm`s (Burn's derive names a field's parent type when it
    /// enters the field), and of those among them that are this module's.
    #[derive(Default)]
    struct Finder {
        path: Vec<String>,
        layers: Vec<String>,
        ours: Vec<String>,
    }
    impl ModuleVisitor for Finder {
        fn enter_module(&mut self, name: &str, container: &str) {
            // A struct of that name with running statistics is a batch norm; with a `sync`
            // slot, this module's.
            if container == "Struct:BatchNorm" {
                let layer = self.path.join(".");
                match name {
                    "sync" => self.ours.push(layer),
                    "running_mean" => self.layers.push(layer),
                    _ => {}
                }
            }
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
    }
    let mut finder = Finder::default();
    model.visit(&mut finder);
    let burns: Vec<_> = finder
        .layers
        .iter()
        .filter(|l| !finder.ours.contains(l))
        .collect();
    if let Some(first) = burns.first() {
        let first = match first.is_empty() {
            true => "the model",
            false => first.as_str(),
        };
        return Err(CommError::InvalidArgument {
            group: group.group().name().to_string(),
            op: "sync_batch_norm",
            reason: format!(
                "`{first}` is Burn's own BatchNorm, which normalises over this rank's batch \
                 alone ({} such layers): import BatchNorm from burn_megatron::dropin::nn \
                 (the same config and record), or convert Burn's layer with `From`",
                burns.len()
            ),
        });
    }
    struct Untouched;
    impl ModuleMapper for Untouched {}
    /// Withdraws the offer however the walk ends (a panic in a module's `map` included), so
    /// that no later walk on this thread hands a `BatchNorm` the group.
    struct Offered;
    impl Drop for Offered {
        fn drop(&mut self) {
            OFFER.with(|o| o.borrow_mut().take());
        }
    }
    OFFER.with(|o| *o.borrow_mut() = Some(group.clone()));
    let _offered = Offered;
    Ok(model.map(&mut Untouched))
}

#[cfg(test)]
mod tests;
