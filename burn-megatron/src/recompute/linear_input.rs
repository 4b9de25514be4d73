//! Megatron's `CheckpointWithoutOutput`: a cheap op feeds parallel linear layers, and its
//! output is not kept. Backward runs the op again to rebuild that output for the layers'
//! weight gradients, and forms their gradients from it by hand, so the layers' products
//! are not run again (as a [`recompute`] region around op and layers would run them).
//! Megatron's `layernorm` module is a norm before column-parallel layers; `mlp_act` is the
//! MLP's activation before its row-parallel second layer.
//!
//! The region keeps its input, which the op kept anyway for its own backward. Under
//! sequence parallelism the replay gathers again, as the layers themselves do in backward.
//!
//! [`recompute`]: super::recompute

use super::ops::{RecomputeOps, Region};
use super::{Leaves, RecomputeError, replayed, sink, trained_params};
use crate::grad_hooks::{Phase, deliver_formed, enter_phase, hook_param, in_discard};
use crate::tensor_parallel::{ColumnParallelLinear, LinearShard, RowParallelLinear};
use crate::tensor_parallel::{matmul_bias, product, refuse_adapter};
use burn::backend::Dispatch;
use burn::module::Module;
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
    let g = move |m: &M, mut parts: Vec<Tensor<3>>| f(m, parts.remove(0));
    linear_products(module, input.clone(), 1, g, linears).finish(linears, &input)
}

/// [`recompute_linear_input`] before a row-parallel layer: runs
/// `linear.forward_with_bias(f(module, parts))`, where `parts` are `input` cut into `parts`
/// equal pieces along dim 0 (so that a function of several tensors, a gated unit's gate and
/// up projections, takes them stacked as one input), without keeping `f`'s output: backward
/// runs `f` again and forms the layer's gradients from it. Errors when dim 0 of `input` does
/// not split into `parts`.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn::tensor::activation::silu;
/// use burn_megatron::comm::{Comm, LocalWorld};
/// use burn_megatron::recompute::recompute_row_linear_input;
/// use burn_megatron::tensor_parallel::RowParallelLinearConfig;
/// use std::sync::Arc;
///
/// let device = Device::flex().autodiff();
/// let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
/// let fc2 = RowParallelLinearConfig::new(16, 8).init(&tp, &device).unwrap();
/// // Gate and up projections, [4, 2, 16] each, stacked along dim 0.
/// let gate_up = Tensor::<3>::ones([8, 2, 16], &device).require_grad();
/// // silu(gate) · up, [4, 2, 16], is not kept; backward forms it again.
/// let none: Option<burn::module::Param<Tensor<1>>> = None;
/// let (y, _) = recompute_row_linear_input(&none, gate_up.clone(), 2, |_, p| {
///     silu(p[0].clone()) * p[1].clone()
/// }, &fc2).unwrap();
/// let grads = y.sum().backward();
/// assert!(fc2.weight.grad(&grads).is_some() && gate_up.grad(&grads).is_some());
/// ```
pub fn recompute_row_linear_input<M, F>(
    module: &M,
    input: Tensor<3>,
    parts: usize,
    f: F,
    linear: &RowParallelLinear,
) -> Result<(Tensor<3>, Option<Tensor<1>>), RecomputeError>
where
    M: Module + 'static,
    F: Fn(&M, Vec<Tensor<3>>) -> Tensor<3> + Send + 'static,
{
    let rows = input.dims()[0];
    if parts == 0 || !rows.is_multiple_of(parts) {
        return Err(RecomputeError(format!(
            "recompute_row_linear_input: dim 0 of the input ({rows}) does not split into \
             {parts} equal parts"
        )));
    }
    Ok(linear_products(module, input.clone(), parts, f, &[linear])
        .finish(&[linear], &input)
        .remove(0))
}

/// What [`linear_products`] gives: the region's output (the products flattened end to end)
/// with each product's shape, or, where no region was needed, the layers' finished outputs.
pub(crate) enum Products {
    /// The region's output, one product after another, and their shapes.
    Packed(Box<Tensor<1>>, Vec<[usize; 3]>),
    /// The plain layers' outputs (untracked, or inside another region).
    Finished(Vec<(Tensor<3>, Option<Tensor<1>>)>),
}

impl Products {
    /// Each layer's output as its `forward_with_bias` gives it (`anchor`: the region input,
    /// where skipped biases are hooked).
    pub(crate) fn finish<L: LinearShard>(
        self,
        linears: &[&L],
        anchor: &Tensor<3>,
    ) -> Vec<(Tensor<3>, Option<Tensor<1>>)> {
        let (out, shapes) = match self {
            Products::Finished(outs) => return outs,
            Products::Packed(out, shapes) => (*out, shapes),
        };
        let mut start = 0;
        let whole = shapes.len() == 1;
        linears
            .iter()
            .zip(shapes)
            .map(|(l, shape)| {
                let len = shape.iter().product::<usize>();
                // A cut's backward pads its gradient with zeros to the whole output's size:
                // a single product needs no cut.
                let part = if whole {
                    out.clone().reshape(shape)
                } else {
                    out.clone().narrow(0, start, len).reshape(shape)
                };
                start += len;
                l.parallel().finish(part, anchor)
            })
            .collect()
    }
}

impl Products {
    /// The products as one `[n·s, b, f]` tensor, stacked along dim 0, where the region
    /// formed them, they share one shape, and every layer hands its product on as it is (no
    /// gather, no returned bias); otherwise `self`, for [`finish`](Self::finish).
    pub(crate) fn stacked<L: LinearShard>(self, linears: &[&L]) -> Result<Tensor<3>, Self> {
        match self {
            Products::Packed(out, shapes)
                if shapes.iter().all(|s| *s == shapes[0])
                    && linears.iter().all(|l| l.parallel().finishes_as_is()) =>
            {
                let [s, b, f] = shapes[0];
                Ok((*out).reshape([shapes.len() * s, b, f]))
            }
            other => Err(other),
        }
    }
}

/// The region of [`recompute_linear_input`] and [`recompute_row_linear_input`] over any
/// parallel linear layers sharing one group and one input mapping.
pub(crate) fn linear_products<M, F, L>(
    module: &M,
    input: Tensor<3>,
    parts: usize,
    f: F,
    linears: &[&L],
) -> Products
where
    M: Module + 'static,
    F: Fn(&M, Vec<Tensor<3>>) -> Tensor<3> + Send + 'static,
    L: LinearShard,
{
    let (mut trained, anchor) = trained_params(module);
    let mut products_train = None;
    for l in linears {
        let l = l.parallel();
        refuse_adapter(l.weight, l.name);
        let weight = Some(l.weight).filter(|w| w.is_require_grad());
        let bias = l.added_bias().filter(|b| b.is_require_grad());
        trained.extend(weight.map(|w| w.id).into_iter().chain(bias.map(|b| b.id)));
        products_train = products_train.or(weight.map(|w| w.val().into_dispatch()));
    }
    let input_tracked = input.is_tracked();
    if in_discard() || linears.is_empty() || (!input_tracked && trained.is_empty()) {
        let n = f(module, input.clone().chunk(parts, 0));
        return Products::Finished(
            linears
                .iter()
                .map(|l| l.parallel().forward(n.clone()))
                .collect(),
        );
    }
    // A parent that trains, so that the region is tracked even when its input is not.
    let anchor = anchor
        .or(products_train)
        .unwrap_or_else(|| input.clone().into_dispatch());
    let saved = input.clone().set_require_grad(false);
    let (product, shapes) = {
        let _phase = enter_phase(Phase::Discard(trained));
        let untracked = module.clone().map(&mut Leaves { track: false });
        let n = f(&untracked, saved.clone().chunk(parts, 0));
        // Each layer maps its input itself, as its forward does, so that backward's
        // collectives and sums are the plain layers' (bit for bit).
        let products = linears
            .iter()
            .map(|l| {
                let l = l.parallel();
                let n = l.parallel_input(n.clone());
                // Count the uses with an active reducer; the replay delivers them.
                let _ = hook_param(l.weight, &n);
                let bias = l.added_bias().map(|b| {
                    let _ = hook_param(b, &n);
                    b.val().set_require_grad(false)
                });
                // The plain layer's product (not the f32-accumulating one: this region
                // forms the weight gradients itself).
                matmul_bias(n, l.weight.val().set_require_grad(false), bias, false)
            })
            .collect::<Vec<Tensor<3>>>();
        let shapes: Vec<[usize; 3]> = products.iter().map(|p| p.dims()).collect();
        // One output for the region: the products flattened end to end, so that each
        // layer's part is a contiguous block again (a cut along the feature dim would
        // leave strided views, which the next ops read slowly).
        let flat = products.into_iter().map(|p| p.reshape([-1])).collect();
        (Tensor::cat(flat, 0).set_require_grad(false), shapes)
    };
    let owned: Vec<L> = linears.iter().map(|l| (*l).clone()).collect();
    let module = module.clone();
    let replay = move |grad: DispatchTensor| {
        let _phase = enter_phase(Phase::Replay);
        let fresh = module.clone().map(&mut Leaves { track: true });
        // One leaf per part, so that each part's gradient is formed on its own (a cut of
        // one tracked input would add a zero-padded copy per part).
        let xs: Vec<Tensor<3>> = saved
            .chunk(parts, 0)
            .into_iter()
            .map(|x| if input_tracked { x.require_grad() } else { x })
            .collect();
        let n = f(&fresh, xs.clone());
        let (surrogate, params) = linear_grads(&owned, n, grad);
        replayed(surrogate, &xs, input_tracked, &fresh, &module, params)
    };
    let out = Tensor::<1>::from_dispatch(Dispatch::recompute_region(
        product.into_dispatch(),
        input.into_dispatch(),
        anchor,
        Region::new(Box::new(replay)),
    ));
    Products::Packed(Box::new(out), shapes)
}
/// Backward of the layers' products, formed as the layers' linear backward forms it, from the
/// gradient of their concatenation (`grad`) and their rebuilt input `n`: each trained
/// weight's `nᵀ·dy` (in f32 with gradient accumulation fusion) and added bias's `Σ dy`,
/// delivered to the reducer, or paired with the parameter for the outer backward where no
/// reducer kept it; and a
/// scalar whose backward takes each layer's `dy·Wᵀ` through its input mapping and `f`, as
/// the gradient of the mapped `n` (`None` when `n` is not tracked).
fn linear_grads<L: LinearShard>(
    linears: &[L],
    n: Tensor<3>,
    grad: DispatchTensor,
) -> (Option<Tensor<1>>, Vec<(DispatchTensor, DispatchTensor)>) {
    let grad = Tensor::<1>::from_dispatch(grad);
    let tracked = n.is_tracked();
    let mut surrogate: Option<Tensor<1>> = None;
    let mut params = Vec::new();
    let mut start = 0;
    for l in linears {
        let l = l.parallel();
        let mapped = l.parallel_input(n.clone());
        let [s, b, i] = mapped.dims();
        let o = l.weight.dims()[1];
        let dy = grad.clone().narrow(0, start, s * b * o).reshape([s, b, o]);
        start += s * b * o;
        if l.weight.is_require_grad() {
            let x = mapped.clone().detach().reshape([s * b, i]).transpose();
            let dy = dy.clone().reshape([s * b, o]);
            let dw = if l.fusion {
                x.cast(DType::F32).matmul(dy.cast(DType::F32))
            } else {
                product(x, dy)
            };
            if !deliver_formed(l.weight, &dw) {
                params.push((l.weight.val().into_dispatch(), dw.inner().into_dispatch()));
            }
        }
        if let Some(bias) = l.added_bias().filter(|b| b.is_require_grad()) {
            let db = dy.clone().reshape([s * b, o]).sum_dim(0).reshape([o]);
            if !deliver_formed(bias, &db) {
                params.push((bias.val().into_dispatch(), db.inner().into_dispatch()));
            }
        }
        if tracked {
            let w = l.weight.val().set_require_grad(false).transpose();
            let dn = product(dy, w);
            let term = sink(mapped, dn);
            surrogate = Some(match surrogate {
                Some(acc) => acc + term,
                None => term,
            });
        }
    }
    (surrogate, params)
}
