//! Mappers and visitors over a module's float parameters that the flat optimizer's module
//! form is built from: each parameter flat with its path, and parameters replaced by new
//! values (or by placeholders) as autodiff had them.

use crate::module_path::{PathVisitor, visit_paths};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorCreationOptions};
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
pub(super) struct Vacate(pub(super) HashSet<ParamId>);

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
