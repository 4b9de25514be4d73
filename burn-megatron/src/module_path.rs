//! Visiting and mapping a module's float parameters (and visiting its int and bool ones) with
//! their module paths (`"0.layers.1.
//! mlp.dense_h_to_4h.weight"`), the names checkpoints and optimizer groups go by.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Bool, Int, Tensor};

/// Sees each float parameter with its path (and each int and bool one, if it asks).
pub(crate) trait PathVisitor {
    fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>);
    fn visit_int<const D: usize>(&mut self, _path: &str, _p: &Param<Tensor<D, Int>>) {}
    fn visit_bool<const D: usize>(&mut self, _path: &str, _p: &Param<Tensor<D, Bool>>) {}
}

/// Replaces each float parameter, knowing its path.
pub(crate) trait PathMapper {
    fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<D>>) -> Param<Tensor<D>>;
}

struct Paths<T> {
    path: Vec<String>,
    inner: T,
}

impl<T: PathVisitor> ModuleVisitor for Paths<&mut T> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        self.inner.visit(&self.path.join("."), p);
    }
    fn visit_int<const D: usize>(&mut self, p: &Param<Tensor<D, Int>>) {
        self.inner.visit_int(&self.path.join("."), p);
    }
    fn visit_bool<const D: usize>(&mut self, p: &Param<Tensor<D, Bool>>) {
        self.inner.visit_bool(&self.path.join("."), p);
    }
}

impl<T: PathMapper> ModuleMapper for Paths<&mut T> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        self.inner.map(&self.path.join("."), p)
    }
}

/// Runs `visitor` over `module`'s parameters, in module order.
pub(crate) fn visit_paths<M: Module>(module: &M, visitor: &mut impl PathVisitor) {
    module.visit(&mut Paths {
        path: Vec::new(),
        inner: visitor,
    });
}

/// `module` with each float parameter replaced by `mapper`.
pub(crate) fn map_paths<M: Module>(module: M, mapper: &mut impl PathMapper) -> M {
    // Else a layer's held update of its statistics would replace the value written here.
    commit_running_states(&module);
    module.map(&mut Paths {
        path: Vec::new(),
        inner: mapper,
    })
}

/// `(i, ".rest")` when `path` is `{prefix}.{i}` or under it.
pub(crate) fn layer_index<'a>(prefix: &str, path: &'a str) -> Option<(usize, &'a str)> {
    let rest = path.strip_prefix(prefix)?.strip_prefix('.')?;
    let (index, tail) = rest.find('.').map_or((rest, ""), |at| rest.split_at(at));
    Some((index.parse().ok()?, tail))
}

/// Whether `path` is the module `pattern` names or lies under it.
pub(crate) fn is_under(pattern: &glob::Pattern, path: &str) -> bool {
    let prefixes = path.match_indices('.').map(|(at, _)| &path[..at]);
    prefixes.chain([path]).any(|p| pattern.matches(p))
}

/// Commits the update each `RunningState` (`BatchNorm`'s running statistics) holds apart:
/// Burn keeps a layer's latest update aside until the layer's next forward or `valid()`, so a
/// visitor reads the statistics one update late and a mapper's value is replaced by the held
/// update. `valid()` commits them in place (the statistics' values are shared with `module`);
/// the module it returns is dropped. Training is unchanged: the next forward commits the
/// same value.
pub(crate) fn commit_running_states<M: Module>(module: &M) {
    drop(module.valid());
}
