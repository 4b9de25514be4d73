//! Gradients addressed by `ParamId` and rank, flattened: the one place that turns Burn's
//! const-generic `GradientsParams` accessors into code that works for any parameter.
//!
//! Parameters of rank 1 to 4 are handled; others are left alone.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// Every float parameter of `module` with its rank, in visiting (field) order.
pub(crate) fn float_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Collect(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push((param.id, D));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Runs `f` on the flattened gradient of `id` (of rank `rank`), if there is one.
pub(crate) fn with_flat<R>(
    grads: &GradientsParams,
    id: ParamId,
    rank: usize,
    f: impl FnOnce(Tensor<1>) -> R,
) -> Option<R> {
    match rank {
        1 => grads.get::<1>(id).map(f),
        2 => grads.get::<2>(id).map(|g| f(g.reshape([-1]))),
        3 => grads.get::<3>(id).map(|g| f(g.reshape([-1]))),
        4 => grads.get::<4>(id).map(|g| f(g.reshape([-1]))),
        _ => None,
    }
}

/// Removes the gradient of `id` (of rank `rank`) and returns it flattened, with its dims.
pub(crate) fn take_flat(
    grads: &mut GradientsParams,
    id: ParamId,
    rank: usize,
) -> Option<(Tensor<1>, Vec<usize>)> {
    fn one<const D: usize>(
        grads: &mut GradientsParams,
        id: ParamId,
    ) -> Option<(Tensor<1>, Vec<usize>)> {
        grads.remove::<D>(id).map(|g| {
            let dims = g.dims().to_vec();
            (g.reshape([-1]), dims)
        })
    }
    match rank {
        1 => one::<1>(grads, id),
        2 => one::<2>(grads, id),
        3 => one::<3>(grads, id),
        4 => one::<4>(grads, id),
        _ => None,
    }
}

/// Registers `flat` reshaped to `dims` as the gradient of `id`.
pub(crate) fn put_flat(grads: &mut GradientsParams, id: ParamId, flat: Tensor<1>, dims: &[usize]) {
    match *dims {
        [_] => grads.register::<1>(id, flat),
        [a, b] => grads.register::<2>(id, flat.reshape([a, b])),
        [a, b, c] => grads.register::<3>(id, flat.reshape([a, b, c])),
        [a, b, c, d] => grads.register::<4>(id, flat.reshape([a, b, c, d])),
        _ => {}
    }
}

/// Replaces the gradient of `id` (of rank `rank`) by `f` of it, flattened; no-op when absent.
pub(crate) fn update_flat<E>(
    grads: &mut GradientsParams,
    id: ParamId,
    rank: usize,
    f: impl FnOnce(Tensor<1>) -> Result<Tensor<1>, E>,
) -> Result<(), E> {
    if let Some((g, dims)) = take_flat(grads, id, rank) {
        put_flat(grads, id, f(g)?, &dims);
    }
    Ok(())
}
