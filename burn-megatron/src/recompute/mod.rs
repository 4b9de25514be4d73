//! Activation recomputation (Megatron's `--recompute-granularity`): a region of the forward
//! keeps only its input, and runs again during backward to rebuild what its backward needs.
//!
//! [`recompute`] wraps any module's forward in such a region. Its first forward runs
//! untracked, so that none of its activations are kept; the region's output enters the
//! autodiff graph through one op whose backward runs the forward again (tracked, on a graph
//! of its own), backpropagates the incoming gradient through it, and hands the gradients of
//! the region's input and of the module's parameters to the outer backward. This is the
//! pipeline executor's stage boundary, inside one backward: an input held as a leaf, and a
//! backward started from the output's gradient.
//!
//! What the replay repeats exactly:
//! - dropout: the region is given a [`RngTracker`] and replays a fork of it taken before
//!   its first forward, so it draws the same masks (dropout from Burn's global RNG, e.g.
//!   `burn::nn::Dropout`, would not replay: use the tracker inside a region);
//! - the tensor-parallel collectives inside the region: every rank replays the same region
//!   at the same point of the same backward, so they run again in the same order;
//! - the data-parallel reducer's gradient hooks: the first forward counts each parameter's
//!   use, the replay delivers it (see `OverlapReducer`).
//!
//! [`recompute_linear_input`] is the narrower region Megatron's `layernorm` module needs: a
//! norm's output feeding linear layers is dropped after their products, and rebuilt in
//! backward for their weight gradients, without running the products again.
//!
//! The models apply it from a [`RecomputeConfig`] (Megatron's `--recompute-granularity`,
//! `--recompute-method`, `--recompute-num-layers`, `--recompute-modules`).
//!
//! # A Burn user's own model
//!
//! ```
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Tensor, activation::gelu};
//! use burn_megatron::recompute::recompute;
//!
//! let device = Device::flex().autodiff();
//! let (fc1, fc2) = (LinearConfig::new(4, 16).init(&device), LinearConfig::new(16, 4).init(&device));
//! let x = Tensor::<2>::ones([3, 4], &device).require_grad();
//! // The [3, 16] activations inside are not kept; backward runs the two layers again.
//! let y = recompute(&(fc1.clone(), fc2.clone()), x.clone(), None, |(fc1, fc2), x, _rng| {
//!     fc2.forward(gelu(fc1.forward(x)))
//! });
//! let grads = y.sum().backward();
//! assert!(fc1.weight.grad(&grads).is_some() && x.grad(&grads).is_some());
//! ```
//!
//! The closure runs twice and must be a function of its arguments: tensors it captures are
//! constants (a mask, rotary tables), never tensors that require a gradient (pass those as
//! the input, or as parameters of the module), since the replay's graph must not reach the
//! outer one.

mod config;
mod linear_input;
mod ops;
#[cfg(test)]
mod tests;

pub use config::{
    RecomputeConfig, RecomputeError, RecomputeGranularity, RecomputeMethod, RecomputeModule,
};
pub(crate) use linear_input::linear_products;
pub use linear_input::{recompute_linear_input, recompute_row_linear_input};
pub use ops::{RecomputeOps, Region, Replayed};

use crate::grad_hooks::{Phase, enter_phase, in_discard};
use crate::tensor_parallel::RngTracker;
use burn::backend::Dispatch;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DispatchTensor, Tensor};
use std::collections::HashSet;

/// Runs `f(module, input, rng)` as a recomputed region: its activations are not kept, and
/// backward runs it again (with a replay of `rng`) to produce the gradients of `input` and
/// of `module`'s parameters. Untracked (inference, or nothing in it trains), it is a plain
/// call of `f`. See the [module documentation](self).
pub fn recompute<M, F, const D: usize, const E: usize>(
    module: &M,
    input: Tensor<D>,
    rng: Option<&RngTracker>,
    f: F,
) -> Tensor<E>
where
    M: Module + 'static,
    F: Fn(&M, Tensor<D>, Option<&RngTracker>) -> Tensor<E> + Send + 'static,
{
    // Inside another region's first forward, nothing is kept anyway.
    if in_discard() {
        return f(module, input, rng);
    }
    let (trained, anchor) = trained_params(module);
    let input_tracked = input.is_tracked();
    if !input_tracked && trained.is_empty() {
        return f(module, input, rng);
    }
    let replay_rng = rng.map(RngTracker::fork);
    let saved = input.clone().set_require_grad(false);
    let output = {
        let _phase = enter_phase(Phase::Discard(trained));
        let untracked = module.clone().map(&mut Leaves { track: false });
        f(&untracked, saved.clone(), rng).set_require_grad(false)
    };
    // A parent that trains, so that the region is tracked even when its input is not: a
    // parameter's leaf itself (a leaf needs no gradient in backward), else the input.
    let anchor = anchor.unwrap_or_else(|| input.clone().into_dispatch());
    let module = module.clone();
    let replay = move |grad: DispatchTensor| {
        let _phase = enter_phase(Phase::Replay);
        let fresh = module.clone().map(&mut Leaves { track: true });
        let x = if input_tracked {
            saved.require_grad()
        } else {
            saved
        };
        let y = f(&fresh, x.clone(), replay_rng.as_ref());
        let scalar = y
            .is_tracked()
            .then(|| sink(y, Tensor::<E>::from_dispatch(grad)));
        replayed(scalar, &[x], input_tracked, &fresh, &module, Vec::new())
    };
    Tensor::from_dispatch(Dispatch::recompute_region(
        output.into_dispatch(),
        input.into_dispatch(),
        anchor,
        Region::new(Box::new(replay)),
    ))
}

/// A zero scalar whose backward gives `y` the gradient `grad` (Burn has no backward from a
/// tensor with a given gradient; `Σ y ⊙ grad` would form a product and its gradient, two
/// more tensors of `y`'s size).
pub(crate) fn sink<const D: usize>(y: Tensor<D>, grad: Tensor<D>) -> Tensor<1> {
    Tensor::from_dispatch(Dispatch::gradient_sink(
        y.into_dispatch(),
        grad.into_dispatch(),
    ))
}

/// The end of a replay: backward from `scalar` (the incoming gradient sunk into the
/// replayed output; `None` when the replay is untracked) to the gradient of the replayed
/// input, given as its parts `xs` along dim 0 (zeros for a part the region ignores: a
/// tracked input's producer expects a gradient), and to each of `fresh`'s parameters,
/// paired with `module`'s original leaf after `params` (gradients the replay formed
/// itself).
fn replayed<M: Module, const D: usize>(
    scalar: Option<Tensor<1>>,
    xs: &[Tensor<D>],
    input_tracked: bool,
    fresh: &M,
    module: &M,
    mut params: Vec<(DispatchTensor, DispatchTensor)>,
) -> Replayed {
    let mut grads = scalar.map(|s| s.backward());
    let input_grad = input_tracked.then(|| {
        let mut parts: Vec<Tensor<D>> = xs
            .iter()
            .map(|x| {
                let grad = grads.as_mut().and_then(|g| x.grad_remove(g));
                grad.unwrap_or_else(|| x.clone().inner().zeros_like())
            })
            .collect();
        let grad = if parts.len() == 1 {
            parts.remove(0)
        } else {
            Tensor::cat(parts, 0)
        };
        grad.into_dispatch()
    });
    if let Some(grads) = grads {
        let mut by_id = GradientsParams::from_grads(grads, fresh);
        module.visit(&mut Pair {
            grads: &mut by_id,
            out: &mut params,
        });
    }
    Replayed { input_grad, params }
}

/// [`recompute`] of a function without parameters (e.g. attention's core: scores, softmax,
/// dropout and the weighted sum of values).
pub fn recompute_fn<F, const D: usize, const E: usize>(
    input: Tensor<D>,
    rng: Option<&RngTracker>,
    f: F,
) -> Tensor<E>
where
    F: Fn(Tensor<D>, Option<&RngTracker>) -> Tensor<E> + Send + 'static,
{
    let none: Option<Param<Tensor<1>>> = None;
    recompute(&none, input, rng, move |_, x, rng| f(x, rng))
}

/// The ids of `module`'s trained (gradient-requiring) float parameters, and the first
/// one's value.
fn trained_params<M: Module>(module: &M) -> (HashSet<ParamId>, Option<DispatchTensor>) {
    #[derive(Default)]
    struct Collect(HashSet<ParamId>, Option<DispatchTensor>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.insert(param.id);
                self.1.get_or_insert_with(|| param.val().into_dispatch());
            }
        }
    }
    let mut c = Collect::default();
    module.visit(&mut c);
    (c.0, c.1)
}

/// Re-leafs the trained parameters: untracked for the first forward, fresh leaves (new
/// autodiff nodes, the same ids and values) for the replay.
struct Leaves {
    track: bool,
}

impl ModuleMapper for Leaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !param.is_require_grad() {
            return param;
        }
        let track = self.track;
        param.map(|t| {
            let t = t.set_require_grad(false);
            if track { t.require_grad() } else { t }
        })
    }
}

/// Pairs each trained parameter's original value with its gradient from the replay.
struct Pair<'a> {
    grads: &'a mut GradientsParams,
    out: &'a mut Vec<(DispatchTensor, DispatchTensor)>,
}

impl ModuleVisitor for Pair<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        if let Some(g) = self.grads.remove::<D>(param.id) {
            self.out
                .push((param.val().into_dispatch(), g.into_dispatch()));
        }
    }
}
