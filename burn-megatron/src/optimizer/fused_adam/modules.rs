//! The flat state in module form: the model's weights from the master buffers, and the
//! per-parameter tensors checkpoints hold.

use super::flat::{Buffer, FlatAdam};
use crate::module_path::{PathVisitor, visit_paths};
use crate::optimizer::megatron::OptimizerError;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{DType, Tensor, TensorCreationOptions};
use burn_megatron_kernels::FlatAdamState;
use std::collections::{HashMap, HashSet};

/// Calls `f(path, id, rank, flat value without autodiff, trainable)` for each float parameter.
pub(super) fn walk<M: Module>(module: &M, f: impl FnMut(&str, ParamId, usize, Tensor<1>, bool)) {
    struct Walk<F>(F);
    impl<F: FnMut(&str, ParamId, usize, Tensor<1>, bool)> PathVisitor for Walk<F> {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            let value = p.val();
            let trainable = value.is_require_grad();
            let flat = value.inner().reshape([-1]);
            (self.0)(path, p.id, D, flat, trainable);
        }
    }
    visit_paths(module, &mut Walk(f));
}

/// Replaces the parameters found in `values` (flat, reshaped back), keeping how each took
/// part in autodiff.
pub(crate) struct Replace(pub(crate) HashMap<ParamId, Tensor<1>>);

impl ModuleMapper for Replace {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, old, mapper) = p.consume();
        let Some(flat) = self.0.remove(&id) else {
            return Param::from_mapped_value(id, old, mapper);
        };
        let new = flat.reshape(old.dims());
        Param::from_mapped_value(id, standing_of(&old, new), mapper)
    }
}

/// `new` (no autodiff) taking part in autodiff as `old` did: an autodiff parameter stays
/// one, under its own checkpointing strategy, trainable if it was.
fn standing_of<const D: usize>(old: &Tensor<D>, new: Tensor<D>) -> Tensor<D> {
    let new = match old.gradient_checkpointing_strategy() {
        Some(strategy) => Tensor::from_inner(new).with_gradient_checkpointing_strategy(strategy),
        None => new,
    };
    if old.is_require_grad() {
        new.require_grad()
    } else {
        new
    }
}

/// Gives the parameters in `.0` unwritten tensors of their shape and dtype (no pages touched)
/// in place of their values: the model's views of the master buffer let go of it, so that
/// the step updates it in place instead of copying it.
struct Vacate(HashSet<ParamId>);

impl ModuleMapper for Vacate {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, old, mapper) = p.consume();
        if !self.0.contains(&id) {
            return Param::from_mapped_value(id, old, mapper);
        }
        // One element seen through zero strides: the placeholder owns no memory of its size.
        let inner = old.clone().inner();
        let options = TensorCreationOptions::new(inner.device()).with_dtype(inner.dtype());
        let new = Tensor::<D>::zeros([1; D], options).expand(old.dims());
        Param::from_mapped_value(id, standing_of(&old, new), mapper)
    }
}

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
        crate::optimizer::cast_params(model.clone(), DType::F32)
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
