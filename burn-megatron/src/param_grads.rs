//! Gradients addressed by `ParamId` and rank, flattened: the one place that turns Burn's
//! const-generic `GradientsParams` accessors into code that works for any parameter.
//!
//! Parameters of every rank are handled: [`float_params`] visits each parameter with its
//! rank `D` known at compile time and records the accessors of rank `D` (plain functions of
//! `D`, so the table cannot go stale), which the other helpers look up by the rank they are
//! given.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

/// A gradient flattened, with its dims.
pub(crate) type Flat = (Tensor<1>, Vec<usize>);

/// The rank-`D` accessors of `GradientsParams`, behind rank-erased function pointers.
#[derive(Clone, Copy)]
struct RankOps {
    get: fn(&GradientsParams, ParamId) -> Option<Tensor<1>>,
    remove: fn(&mut GradientsParams, ParamId) -> Option<Flat>,
    register: fn(&mut GradientsParams, ParamId, Tensor<1>, &[usize]),
}

fn ops_of<const D: usize>() -> RankOps {
    RankOps {
        get: |grads, id| grads.get::<D>(id).map(|g| g.reshape([-1])),
        remove: |grads, id| {
            grads.remove::<D>(id).map(|g| {
                let dims = g.dims().to_vec();
                (g.reshape([-1]), dims)
            })
        },
        register: |grads, id, flat, dims| {
            let shape: [usize; D] = dims.try_into().expect("dims of the registered rank");
            grads.register::<D>(id, flat.reshape(shape));
        },
    }
}

fn table() -> &'static RwLock<HashMap<usize, RankOps>> {
    static TABLE: OnceLock<RwLock<HashMap<usize, RankOps>>> = OnceLock::new();
    TABLE.get_or_init(|| {
        // The common ranks up front; any other is added when a parameter of it is visited.
        let ranks = [
            (1, ops_of::<1>()),
            (2, ops_of::<2>()),
            (3, ops_of::<3>()),
            (4, ops_of::<4>()),
        ];
        RwLock::new(ranks.into_iter().collect())
    })
}

fn learn<const D: usize>() {
    let known = table()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .contains_key(&D);
    if !known {
        table()
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(D, ops_of::<D>());
    }
}

fn ops(rank: usize) -> Option<RankOps> {
    table()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&rank)
        .copied()
}

/// Every float parameter of `module` with its rank, in visiting (field) order.
pub(crate) fn float_params<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Collect(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            learn::<D>();
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
    ops(rank).and_then(|o| (o.get)(grads, id)).map(f)
}

/// Removes the gradient of `id` (of rank `rank`) and returns it flattened, with its dims.
pub(crate) fn take_flat(grads: &mut GradientsParams, id: ParamId, rank: usize) -> Option<Flat> {
    ops(rank).and_then(|o| (o.remove)(grads, id))
}

/// Registers `flat` reshaped to `dims` as the gradient of `id`.
pub(crate) fn put_flat(grads: &mut GradientsParams, id: ParamId, flat: Tensor<1>, dims: &[usize]) {
    let o = ops(dims.len()).expect("a gradient's rank was learnt when it was taken");
    (o.register)(grads, id, flat, dims);
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

#[cfg(test)]
mod tests;

/// A flat tensor of `len` elements of `dtype` on `device`: each of `pieces` (offset, values)
/// cast to `dtype` at its offset, zeros elsewhere. Pieces must not overlap and must fit.
/// How a bucket or a shard of one is laid out on the device.
pub(crate) fn zero_padded(
    len: usize,
    dtype: DType,
    device: &Device,
    mut pieces: Vec<(usize, Tensor<1>)>,
) -> Tensor<1> {
    pieces.sort_by_key(|(at, _)| *at);
    let zeros = |n: usize| Tensor::<1>::zeros([n], (device, dtype));
    let mut parts = Vec::new();
    let mut filled = 0;
    for (at, values) in pieces.into_iter().filter(|(_, v)| v.dims()[0] > 0) {
        if at > filled {
            parts.push(zeros(at - filled));
        }
        filled = at + values.dims()[0];
        parts.push(values.cast(dtype));
    }
    if len > filled || parts.is_empty() {
        parts.push(zeros(len - filled));
    }
    Tensor::cat(parts, 0)
}
