//! The flat state in module form: the model's weights from the master buffers, and the
//! per-parameter tensors checkpoints hold.

use super::flat::{Buffer, FlatAdam};
use super::mappers::{Replace, Vacate, walk};
use crate::optimizer::error::OptimizerError;
use burn::module::{Module, ParamId};
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::FlatAdamState;
use std::collections::HashMap;

impl FlatAdam {
    /// `model` without its views of the (unsharded) master buffers, before a step; the
    /// weights come back with [`Self::model_from`].
    pub(crate) fn vacate<M: Module>(&self, model: M) -> M {
        if self.sharding.is_some() {
            return model;
        }
        let ids = self
            .groups
            .iter()
            .flat_map(|g| g.slots.iter().map(|s| s.id));
        model.map(&mut Vacate(ids.collect()))
    }

    /// `model` with its trainable parameters set from the master weights, in their dtypes.
    /// Collective over the data-parallel group for a distributed optimizer.
    pub(crate) fn model_from<M: Module>(&self, model: M) -> Result<M, OptimizerError> {
        if let Some(sharding) = &self.sharding {
            return self.gather_model(sharding, model);
        }
        let mut values = HashMap::new();
        for g in &self.groups {
            values.extend(g.slots.iter().map(|s| s.id).zip(g.model_segments()?));
        }
        Ok(model.map(&mut Replace(values)))
    }

    /// `model` with its trainable parameters replaced by their f32 values of `buffer`
    /// (plain tensors, no autodiff): the state in module form, for checkpoints. Whole
    /// parameters whether or not the optimizer is distributed; collective over the
    /// data-parallel group when it is.
    pub(crate) fn state_module<M: Module>(
        &self,
        buffer: Buffer,
        model: &M,
    ) -> Result<M, OptimizerError> {
        if let Some(sharding) = &self.sharding {
            return self.gather_state(sharding, buffer, model);
        }
        let values = self
            .groups
            .iter()
            .flat_map(|g| g.slots.iter().map(|s| s.id).zip(g.segments(buffer)))
            .collect();
        Ok(model.clone().map(&mut Replace(values)))
    }

    /// A module shaped as [`Self::state_module`]'s, for reading one back.
    pub(crate) fn state_template<M: Module>(&self, model: &M) -> M {
        crate::optimizer::cast::cast_params(model.clone(), DType::F32)
    }

    /// Takes the state from modules written by [`Self::state_module`] (in [`Buffer::ALL`]
    /// order) and the step count.
    pub(crate) fn load(&mut self, modules: [&impl Module; 3], step: u32) -> Result<(), String> {
        let [mut master, mut exp_avg, mut exp_avg_sq] = modules.map(|module| {
            let mut by_id = HashMap::new();
            walk(module, |_, id, _, flat, _| {
                by_id.insert(id, flat);
            });
            by_id
        });
        let mut next = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            // The group's slots, in order, from one module's tensors.
            let gather = |by_id: &mut HashMap<ParamId, Tensor<1>>| {
                let mut parts = Vec::with_capacity(g.slots.len());
                for s in &g.slots {
                    match by_id.remove(&s.id) {
                        Some(t) if t.dims()[0] == s.numel => parts.push(s.of(t.cast(DType::F32))),
                        Some(t) => {
                            let n = t.dims()[0];
                            return Err(format!("{:?}: {n} elements, not {}", s.id, s.numel));
                        }
                        None => return Err(format!("no optimizer state for parameter {:?}", s.id)),
                    }
                }
                Ok(Tensor::cat(parts, 0))
            };
            next.push(FlatAdamState {
                param: gather(&mut master)?,
                exp_avg: gather(&mut exp_avg)?,
                exp_avg_sq: gather(&mut exp_avg_sq)?,
            });
        }
        for (g, state) in self.groups.iter_mut().zip(next) {
            g.state = state;
        }
        self.step = step;
        Ok(())
    }
}
