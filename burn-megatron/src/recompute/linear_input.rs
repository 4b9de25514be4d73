//! Megatron's `layernorm` recomputation (its `CheckpointWithoutOutput`): a cheap op (a
//! norm) feeds column-parallel linear layers, and its output is not kept. Backward runs the
//! op again to rebuild that output for the layers' weight gradients, and forms their
//! gradients from it by hand, so the layers' products are not run again (as a [`recompute`]
//! region around op and layers would run them).
//!
//! The region keeps its input, which the norm kept anyway for its own backward. Under
//! sequence parallelism it also frees the all-gathered copy that the layers would
//! keep: the replay gathers again, as Megatron's linear layers do in backward.
//!
//! [`recompute`]: super::recompute

use super::ops::{RecomputeOps, Region};
use super::{Leaves, replayed, trained_params};
use crate::grad_hooks::{Phase, deliver_formed, enter_phase, hook_param, in_discard};
use crate::tensor_parallel::ColumnParallelLinear;
use burn::backend::Dispatch;
use burn::module::Module;
use burn::tensor::module::linear;
use burn::tensor::{DType, DispatchTensor, Tensor};

/// Runs `f(module, input)` (a norm, say) and each of `linears` on its output, as
/// `linears[i].forward_with_bias(f(module, input))` does, without keeping `f`'s output:
/// backward runs `f` again (gathering again under sequence parallelism) and forms the
/// layers' input and weight gradients from the incoming gradient, without their products'
/// forward. The layers must share one tensor-parallel group and sequence-parallel setting,
/// as the layers fed by one norm do.
///
/// Untracked, or inside a region that is itself recomputed, it is the plain call.
///
/// ```
/// use burn::nn::{RmsNorm, RmsNormConfig};
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::recompute::recompute_linear_input;
/// use burn_megatron::tensor_parallel::ColumnParallelLinearConfig;
/// use std::sync::Arc;
///
/// let device = Device::flex().autodiff();
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let norm: RmsNorm = RmsNormConfig::new(8).init(&device);
/// let fc = ColumnParallelLinearConfig::new(8, 16).init(&tp, &device).unwrap();
/// let x = Tensor::<3>::ones([4, 2, 8], &device).require_grad();
/// // The normed [4, 2, 8] is not kept; backward normalises again.
/// let (y, _) = recompute_linear_input(&norm, x.clone(), |n, x| n.forward(x), &[&fc]).remove(0);
/// let grads = y.sum().backward();
/// assert!(fc.weight.grad(&grads).is_some() && x.grad(&grads).is_some());
/// ```
pub fn recompute_linear_input<M, F>(
    module: &M,
    input: Tensor<3>,
    f: F,
    linears: &[&ColumnParallelLinear],
) -> Vec<(Tensor<3>, Option<Tensor<1>>)>
where
    M: Module + 'static,
    F: Fn(&M, Tensor<3>) -> Tensor<3> + Send + 'static,
{
    let (mut trained, anchor) = trained_params(module);
    let mut products_train = None;
    for l in linears {
        let weight = Some(&l.weight).filter(|w| w.is_require_grad());
        let bias = l.added_bias().filter(|b| b.is_require_grad());
        trained.extend(weight.map(|w| w.id).into_iter().chain(bias.map(|b| b.id)));
        products_train = products_train.or(weight.map(|w| w.val().into_dispatch()));
    }
    let input_tracked = input.is_tracked();
    if in_discard() || linears.is_empty() || (!input_tracked && trained.is_empty()) {
        let n = f(module, input);
        return linears
            .iter()
            .map(|l| l.forward_with_bias(n.clone()))
            .collect();
    }
    // A parent that trains, so that the region is tracked even when its input is not.
    let anchor = anchor
        .or(products_train)
        .unwrap_or_else(|| input.clone().into_dispatch());
    let saved = input.clone().set_require_grad(false);
    let (product, shapes) = {
        let _phase = enter_phase(Phase::Discard(trained));
        let untracked = module.clone().map(&mut Leaves { track: false });
        let n = f(&untracked, saved.clone());
        // Each layer maps its input itself, as its forward does, so that backward's
        // collectives and sums are the plain layers' (bit for bit).
        let products = linears
            .iter()
            .map(|l| {
                let n = l.parallel_input(n.clone());
                // Count the uses with an active reducer; the replay delivers them.
                let _ = hook_param(&l.weight, &n);
                let bias = l.added_bias().map(|b| {
                    let _ = hook_param(b, &n);
                    b.val().set_require_grad(false)
                });
                linear(n, l.weight.val().set_require_grad(false), bias)
            })
            .collect::<Vec<Tensor<3>>>();
        let shapes: Vec<[usize; 3]> = products.iter().map(|p| p.dims()).collect();
        // One output for the region: the products flattened end to end, so that each
        // layer's part is a contiguous block again (a cut along the feature dim would
        // leave strided views, which the next ops read slowly).
        let flat = products.into_iter().map(|p| p.reshape([-1])).collect();
        (Tensor::cat(flat, 0).set_require_grad(false), shapes)
    };
    let owned: Vec<ColumnParallelLinear> = linears.iter().map(|l| (*l).clone()).collect();
    let module = module.clone();
    let replay = move |grad: DispatchTensor| {
        let _phase = enter_phase(Phase::Replay);
        let fresh = module.clone().map(&mut Leaves { track: true });
        let x = if input_tracked {
            saved.require_grad()
        } else {
            saved
        };
        let n = f(&fresh, x.clone());
        let (surrogate, params) = linear_grads(&owned, n, grad);
        replayed(surrogate, x, input_tracked, &fresh, &module, params)
    };
    let out = Tensor::<1>::from_dispatch(Dispatch::recompute_region(
        product.into_dispatch(),
        input.clone().into_dispatch(),
        anchor,
        Region::new(Box::new(replay)),
    ));
    let mut start = 0;
    linears
        .iter()
        .zip(shapes)
        .map(|(l, shape)| {
            let len = shape.iter().product::<usize>();
            let part = out.clone().narrow(0, start, len).reshape(shape);
            start += len;
            l.finish(part, &input)
        })
        .collect()
}

/// Backward of the layers' products, formed as Burn's linear backward forms it, from the
/// gradient of their concatenation (`grad`) and their rebuilt input `n`: each trained
/// weight's `nᵀ·dy` (in f32 with gradient accumulation fusion) and added bias's `Σ dy`,
/// delivered to the reducer and paired with the parameter for the outer backward; and the
/// scalar `Σ ⟨mapped n, dy·Wᵀ⟩` whose backward takes `dy·Wᵀ` through each layer's input
/// mapping and `f` (`None` when `n` is not tracked).
fn linear_grads(
    linears: &[ColumnParallelLinear],
    n: Tensor<3>,
    grad: DispatchTensor,
) -> (Option<Tensor<1>>, Vec<(DispatchTensor, DispatchTensor)>) {
    let grad = Tensor::<1>::from_dispatch(grad);
    let tracked = n.is_tracked();
    let mut surrogate: Option<Tensor<1>> = None;
    let mut params = Vec::new();
    let mut start = 0;
    for l in linears {
        let mapped = l.parallel_input(n.clone());
        let [s, b, i] = mapped.dims();
        let o = l.weight.dims()[1];
        let dy = grad.clone().narrow(0, start, s * b * o).reshape([s, b, o]);
        start += s * b * o;
        if l.weight.is_require_grad() {
            let x = mapped.clone().detach().reshape([s * b, i]).transpose();
            let dy = dy.clone().reshape([s * b, o]);
            let dw = if l.accumulates_in_f32() {
                x.cast(DType::F32).matmul(dy.cast(DType::F32))
            } else {
                x.matmul(dy)
            };
            deliver_formed(&l.weight, &dw);
            params.push((l.weight.val().into_dispatch(), dw.inner().into_dispatch()));
        }
        if let Some(bias) = l.added_bias().filter(|b| b.is_require_grad()) {
            let db = dy.clone().reshape([s * b, o]).sum_dim(0).reshape([o]);
            deliver_formed(bias, &db);
            params.push((bias.val().into_dispatch(), db.inner().into_dispatch()));
        }
        if tracked {
            let w = l.weight.val().set_require_grad(false).transpose();
            let dn = linear(dy, w, None);
            let term = (mapped * dn).sum();
            surrogate = Some(match surrogate {
                Some(acc) => acc + term,
                None => term,
            });
        }
    }
    (surrogate, params)
}
