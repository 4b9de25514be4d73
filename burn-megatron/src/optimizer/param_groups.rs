//! Megatron's parameter groups: no weight decay on biases and 1-D parameters (norms), with
//! name-pattern overrides, and per-group learning-rate multipliers — built on Burn's own
//! `ParamGroup` / `ModuleOptimizer::with_group` / `ModuleLrScheduler`.

use crate::param_grads::float_params;
use burn::module::{Module, ParamGroup, ParamId};
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::{DynOptimizer, LearningRate, ModuleOptimizer, Optimizer};

/// Ids of the parameters Megatron exempts from weight decay by default: every 1-D
/// parameter (biases, LayerNorm / RMSNorm weights).
pub fn one_dimensional_params<M: Module>(model: &M) -> Vec<ParamId> {
    float_params(model)
        .into_iter()
        .filter(|&(_, dims)| dims == 1)
        .map(|(id, _)| id)
        .collect()
}

/// An optimizer whose parameters get `with_decay`, except the no-weight-decay group, which
/// gets `without_decay` (the same optimizer configured with weight decay 0): the 1-D
/// parameters, plus `extra_no_decay` (e.g. `ParamGroup::from_regex(".*embedding.*")`).
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn::optim::AdamWConfig;
/// use burn::tensor::Device;
/// use burn_megatron::optimizer::megatron_param_groups;
/// let model = LinearConfig::new(4, 4).init(&Device::flex().autodiff());
/// let adamw = AdamWConfig::new().with_weight_decay(0.1);
/// let optim = megatron_param_groups(&model, adamw.build(), adamw.with_weight_decay(0.0).build(), None);
/// ```
pub fn megatron_param_groups<M: Module>(
    model: &M,
    with_decay: impl Optimizer,
    without_decay: impl DynOptimizer + 'static,
    extra_no_decay: Option<ParamGroup>,
) -> ModuleOptimizer {
    let mut no_decay = ParamGroup::from_ids(one_dimensional_params(model));
    if let Some(extra) = extra_no_decay {
        no_decay = no_decay.fuse(&extra);
    }
    ModuleOptimizer::from(with_decay).with_group(no_decay, without_decay, None)
}

/// A scheduler whose learning rate is another's times a constant (a parameter group's
/// `lr_mult`); plug it into `burn::optim::lr_scheduler::ModuleLrScheduler::with_group`.
#[derive(Debug, Clone)]
pub struct LrMultScheduler<S> {
    inner: S,
    mult: f64,
}

impl<S> LrMultScheduler<S> {
    /// `inner`'s learning rate times `mult`.
    pub fn new(inner: S, mult: f64) -> Self {
        Self { inner, mult }
    }
}

impl<S: LrScheduler + Clone + 'static> LrScheduler for LrMultScheduler<S> {
    fn step(&mut self) -> LearningRate {
        self.inner.step() * self.mult
    }

    fn to_record(&self) -> LrSchedulerRecord {
        self.inner.to_record()
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        self.inner.load_record(record);
    }
}

#[cfg(test)]
mod tests;
