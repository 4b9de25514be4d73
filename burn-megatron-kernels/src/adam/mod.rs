//! Fused Adam / AdamW over a flat f32 buffer: gradient unscaling (1 / loss scale, times an
//! optional clipping coefficient), the inf/NaN check and the moment and parameter updates
//! in one pass over the elements.
//!
//! Contract: the step returns the new state and a count of non-finite gradient elements. It
//! consumes the state it is given: a backend may reuse buffers that nothing else holds. A
//! caller that decides about overflow *after* the step (the count is non-zero on some rank of
//! the model-parallel group) passes a clone and keeps the original, as Megatron skips the
//! step; one that checked before (as `MegatronOptimizer` does, from the sums of squares)
//! hands the state over and lets Flex update it in place.

#[cfg(feature = "cube")]
mod cube;
mod flex;
mod reference;

pub use reference::reference_adam_step;

use crate::KernelError;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Device, Slice, Tensor};

/// How weight decay enters the step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum WeightDecay {
    /// No weight decay.
    #[default]
    None,
    /// AdamW, decoupled: `param ← param·(1 − lr·λ) − lr·update`, as burn-optim's `AdamW`.
    /// This and `None` round as `AdamW` does; `L2` as `Adam` does (the same update, with
    /// the bias corrections folded differently).
    Decoupled(f32),
    /// Adam with an L2 penalty: `g ← g + λ·param` before the moments, as burn-optim's `Adam`
    /// with a `WeightDecayConfig`.
    L2(f32),
}

/// The hyper-parameters of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Learning rate (f64 like burn-optim's `LearningRate`; the decay factor is formed in f64).
    pub lr: f64,
    /// Decay of the first moment, in [0, 1).
    pub beta1: f32,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f32,
    /// Added to `√v̂`; positive.
    pub eps: f32,
    /// Weight decay and its form.
    pub weight_decay: WeightDecay,
    /// The 1-based number of this step, for the bias corrections `1 − βᵗ`.
    pub step: u32,
    /// Multiplies the raw gradient: `1 / loss scale` (1 without loss scaling).
    pub inv_scale: f32,
    /// Multiplies the unscaled gradient: the clipping coefficient (1 when not clipping).
    pub clip_coef: f32,
}

impl Default for AdamHyper {
    /// burn-optim's `AdamConfig` defaults (β = 0.9 / 0.999, ε = 1e-5), lr 1e-3, step 1, no
    /// weight decay, no loss scale, no clipping.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-5,
            weight_decay: WeightDecay::None,
            step: 1,
            inv_scale: 1.0,
            clip_coef: 1.0,
        }
    }
}

impl AdamHyper {
    /// Checks every field's domain, as [`fused_adam_step`] does before any work: lets a
    /// caller stepping several groups refuse before it hands over any state.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |what: &str| Err(KernelError::Argument(format!("{what} in {self:?}")));
        let (wd_ok, unit) = (
            match self.weight_decay {
                WeightDecay::None => true,
                WeightDecay::Decoupled(w) | WeightDecay::L2(w) => w.is_finite() && w >= 0.0,
            },
            0.0..1.0,
        );
        if self.step == 0 {
            bad("step must be ≥ 1 (bias correction 1 − β⁰ = 0)")
        } else if !self.lr.is_finite() || self.lr < 0.0 {
            bad("lr must be finite and ≥ 0")
        } else if !unit.contains(&self.beta1) || !unit.contains(&self.beta2) {
            bad("beta1 and beta2 must lie in [0, 1)")
        } else if !(self.eps.is_finite() && self.eps > 0.0) {
            bad("eps must be finite and > 0")
        } else if !(self.inv_scale.is_finite() && self.inv_scale > 0.0) {
            bad("inv_scale must be finite and > 0")
        } else if !(self.clip_coef.is_finite() && self.clip_coef > 0.0) {
            bad("clip_coef must be finite and > 0")
        } else if !wd_ok {
            bad("weight decay must be finite and ≥ 0")
        } else {
            Ok(())
        }
    }

    /// The f32 constants of the update, formed exactly as burn-optim forms them.
    pub(crate) fn scalars(&self) -> AdamScalars {
        let t = self.step.min(i32::MAX as u32) as i32;
        let (l2, decay) = match self.weight_decay {
            WeightDecay::None => (None, 0.0),
            WeightDecay::L2(w) => (Some(w), 0.0),
            WeightDecay::Decoupled(w) => (None, self.lr * f64::from(w)),
        };
        AdamScalars {
            inv_scale: self.inv_scale,
            clip: self.clip_coef,
            l2,
            beta1: self.beta1,
            beta2: self.beta2,
            one_minus_beta1: 1.0 - self.beta1,
            one_minus_beta2: 1.0 - self.beta2,
            correction1: 1.0 - self.beta1.powi(t),
            correction2: 1.0 - self.beta2.powi(t),
            adam_factor: (1.0 - self.beta2.powi(t)).sqrt() / (1.0 - self.beta1.powi(t)),
            adam_eps: self.eps * (1.0 - self.beta2.powi(t)).sqrt(),
            eps: self.eps,
            lr: self.lr as f32,
            keep: (1.0 - decay) as f32,
        }
    }
}

/// [`AdamHyper`] as the f32 values both implementations use.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamScalars {
    pub inv_scale: f32,
    pub clip: f32,
    pub l2: Option<f32>,
    pub beta1: f32,
    pub beta2: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
    pub correction1: f32,
    pub correction2: f32,
    /// burn-optim's `Adam` folds both corrections into `m · √(1 − β₂ᵗ)/(1 − β₁ᵗ)` over
    /// `√v + ε·√(1 − β₂ᵗ)` (same value, other roundings); the L2 form follows it.
    pub adam_factor: f32,
    pub adam_eps: f32,
    pub eps: f32,
    pub lr: f32,
    /// `1 − lr·λ` of decoupled decay (1 otherwise).
    pub keep: f32,
}

/// The fused step as a backend op: one kernel pass (plus a sum of per-cube flags) on Cube
/// backends, one native pass on Flex, Burn's own ops elsewhere.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait FusedAdamOps: Backend {
    /// One step of elements `[offset, offset + len)` of `[n]` f32 buffers, with gradient
    /// `grad` (`[len]`, any float dtype; `offset + len ≤ n`): returns the new `(param,
    /// exp_avg, exp_avg_sq)`, the other elements unchanged, and the number of non-finite
    /// unscaled gradient elements as an f32 `[1]` (exact below 2²⁴, non-zero iff any).
    /// A range lets one buffer be stepped a parameter's gradient at a time, each read where
    /// it lies.
    fn fused_adam(
        param: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        hyper: AdamHyper,
        offset: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

impl FusedAdamOps for Flex {
    fn fused_adam(
        param: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        hyper: AdamHyper,
        offset: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        flex::fused_adam(param, exp_avg, exp_avg_sq, grad, hyper, offset)
    }
}

/// An optimizer step is not differentiated: the inner backend's step, untracked.
impl<B: FusedAdamOps, C: CheckpointStrategy> FusedAdamOps for Autodiff<B, C> {
    fn fused_adam(
        param: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        hyper: AdamHyper,
        offset: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (p, m, v, found) = B::fused_adam(
            param.into_parts().0,
            exp_avg.into_parts().0,
            exp_avg_sq.into_parts().0,
            grad.into_parts().0,
            hyper,
            offset,
        );
        let wrap = Self::from_inner;
        (wrap(p), wrap(m), wrap(v), wrap(found))
    }
}

type Step<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
);

/// `step` (of whole buffers) applied to elements `[offset, offset + len(grad))` of the
/// state: the range sliced out, stepped, and written back; the whole buffers go straight
/// to `step`.
pub(crate) fn ranged<B: Backend>(
    [param, exp_avg, exp_avg_sq]: [FloatTensor<B>; 3],
    grad: FloatTensor<B>,
    offset: usize,
    step: impl FnOnce(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> Step<B>,
) -> Step<B> {
    let (n, len) = (param.shape().num_elements(), grad.shape().num_elements());
    if offset == 0 && len == n {
        return step(param, exp_avg, exp_avg_sq, grad);
    }
    let range = [Slice::from(offset..offset + len)];
    let cut = |t: &FloatTensor<B>| B::float_slice(t.clone(), &range);
    let (p, m, v, found) = step(cut(&param), cut(&exp_avg), cut(&exp_avg_sq), grad);
    let put = |t, x| B::float_slice_assign(t, &range, x);
    (put(param, p), put(exp_avg, m), put(exp_avg_sq, v), found)
}

/// The optimizer state of a flat parameter buffer: f32 `[n]` master weights and moments.
#[derive(Debug, Clone)]
pub struct FlatAdamState {
    /// The f32 master weights.
    pub param: Tensor<1>,
    /// First moment `m`.
    pub exp_avg: Tensor<1>,
    /// Second moment `v`.
    pub exp_avg_sq: Tensor<1>,
}

impl FlatAdamState {
    /// Fresh state for `param` (cast to f32): both moments zero, as before burn-optim's
    /// first step.
    pub fn new(param: Tensor<1>) -> Self {
        let param = param.cast(DType::F32);
        Self {
            exp_avg: param.zeros_like(),
            exp_avg_sq: param.zeros_like(),
            param,
        }
    }
}

/// One Adam / AdamW step over a flat buffer, fused: `g = grad · inv_scale · clip_coef`, the
/// count of non-finite `g`, then the moments and the parameter, as burn-optim computes them.
///
/// Returns the new state and the non-finite count (f32 `[1]`, left on the device so the
/// caller chooses when to sync, e.g. after a max all-reduce over the model-parallel group).
/// **If the count is non-zero the new state is garbage.** `state` is consumed, so a backend
/// may update buffers nothing else holds in place (Flex does); a caller that wants to keep
/// the old state on overflow passes a clone (handles, not copies), as below. Errors, before
/// any launch, on buffers of different lengths, state that is not f32, or hyper-parameters
/// outside their domain. One call per parameter group (each group its own buffer and weight
/// decay).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::{AdamHyper, FlatAdamState, WeightDecay, fused_adam_step};
/// let device = Device::flex();
/// let state = FlatAdamState::new(Tensor::<1>::from_floats([1.0, -2.0, 3.0], &device));
/// let grad = Tensor::<1>::from_floats([1024.0, f32::INFINITY, 0.0], &device);
/// let hyper = AdamHyper { lr: 0.01, inv_scale: 1.0 / 1024.0, weight_decay: WeightDecay::Decoupled(0.1), ..Default::default() };
/// let (_, non_finite) = fused_adam_step(state.clone(), grad, &hyper).unwrap();
/// assert_eq!(non_finite.into_scalar::<f32>(), 1.0); // overflow: keep `state`, skip the step
/// ```
pub fn fused_adam_step(
    state: FlatAdamState,
    grad: Tensor<1>,
    hyper: &AdamHyper,
) -> Result<(FlatAdamState, Tensor<1>), KernelError> {
    multi_tensor_fused_adam_step(state, vec![grad], hyper)
}

/// [`fused_adam_step`] with the gradient in consecutive pieces, e.g. one tensor per
/// parameter of the flat buffer, in order: on Flex one pass reads each where it lies (no
/// concatenation into a fresh buffer first); Cube backends concatenate them, then launch
/// the one kernel.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron_kernels::{AdamHyper, FlatAdamState, fused_adam_step, multi_tensor_fused_adam_step};
/// let device = Device::flex();
/// let state = FlatAdamState::new(Tensor::<1>::from_floats([1.0, -2.0, 3.0], &device));
/// let (a, b) = (Tensor::<1>::from_floats([0.5], &device), Tensor::<1>::from_floats([-1.0, 2.0], &device));
/// let hyper = AdamHyper::default();
/// let (pieces, _) = multi_tensor_fused_adam_step(state.clone(), vec![a.clone(), b.clone()], &hyper).unwrap();
/// let (flat, _) = fused_adam_step(state, Tensor::cat(vec![a, b], 0), &hyper).unwrap();
/// assert_eq!(pieces.param.into_data(), flat.param.into_data());
/// ```
pub fn multi_tensor_fused_adam_step(
    state: FlatAdamState,
    grads: Vec<Tensor<1>>,
    hyper: &AdamHyper,
) -> Result<(FlatAdamState, Tensor<1>), KernelError> {
    hyper.validate()?;
    let device = state.param.device();
    if let Some((i, g)) = grads.iter().enumerate().find(|(_, g)| g.device() != device) {
        return Err(KernelError::Argument(format!(
            "gradient piece {i} is on {:?}, the state on {device:?}",
            g.device()
        )));
    }
    let n: usize = grads.iter().map(|g| g.dims()[0]).sum();
    let FlatAdamState {
        param,
        exp_avg,
        exp_avg_sq,
    } = state;
    for (name, t) in [
        ("param", &param),
        ("exp_avg", &exp_avg),
        ("exp_avg_sq", &exp_avg_sq),
    ] {
        if t.dims()[0] != n {
            return Err(KernelError::Shape(format!(
                "{name} has {} elements, the gradient {n}",
                t.dims()[0]
            )));
        }
        if t.dtype() != DType::F32 {
            return Err(KernelError::Argument(format!(
                "{name} is {:?}; the optimizer state must be f32",
                t.dtype()
            )));
        }
    }
    // Flex steps the buffers in place a piece at a time; a GPU backend takes one launch
    // over one concatenated gradient.
    let pieces = match device == Device::flex() || grads.len() == 1 {
        true => grads,
        false => vec![Tensor::cat(
            grads.into_iter().map(|g| g.cast(DType::F32)).collect(),
            0,
        )],
    };
    let mut state = [param, exp_avg, exp_avg_sq].map(Tensor::into_dispatch);
    let (mut offset, mut found) = (0, Vec::with_capacity(pieces.len()));
    for g in pieces {
        let len = g.dims()[0];
        if len == 0 {
            continue;
        }
        let [p, m, v] = state;
        let (p, m, v, f) = Dispatch::fused_adam(p, m, v, g.into_dispatch(), *hyper, offset);
        state = [p, m, v];
        found.push(Tensor::<1>::from_dispatch(f));
        offset += len;
    }
    let [p, m, v] = state;
    let found = match found.len() {
        0 => Tensor::zeros([1], &device),
        1 => found.pop().expect("one count"),
        _ => Tensor::cat(found, 0).sum(),
    };
    let state = FlatAdamState {
        param: Tensor::from_dispatch(p),
        exp_avg: Tensor::from_dispatch(m),
        exp_avg_sq: Tensor::from_dispatch(v),
    };
    Ok((state, found))
}
