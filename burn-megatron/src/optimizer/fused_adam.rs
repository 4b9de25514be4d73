//! Fused Adam / AdamW over flat FP32 buffers, one per parameter group: the optimizer behind
//! [`MegatronOptimizer::fused_adam`](super::MegatronOptimizer::fused_adam).
//!
//! Every trainable parameter is a segment of its group's flat master buffer (f32, as
//! Megatron's distributed optimizer keeps `main_param` buffers). A step gathers the
//! gradients into one flat buffer per group, reads the per-parameter sums of squares back
//! once (overflow check and global norm from the same numbers), and then runs one fused
//! kernel per group: unscale × clip, moments, update. The model's weights are the master
//! segments rounded to the model's dtype in one pass per group.

use crate::param_grads::with_flat;
use crate::tensor_parallel::parallel_attrs;
use burn::config::Config;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, Tensor};
use burn_megatron_kernels::{
    AdamHyper, FlatAdamState, KernelError, WeightDecay, fused_adam_step, master_to_model,
    master_to_model_segments, segment_sum_of_squares,
};
use std::collections::HashMap;

use super::NormType;

/// Hyper-parameters of [`FusedAdam`]; the defaults are burn-optim's `AdamWConfig`'s.
#[derive(Config, Debug)]
pub struct FusedAdamConfig {
    /// Decay of the first moment.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Decay of the second moment.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to `√v̂`.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// Weight decay of the parameters that have it.
    #[config(default = 1e-4)]
    pub weight_decay: f32,
    /// `true`: AdamW (decoupled decay, bit-identical to burn-optim's `AdamW`); `false`: Adam
    /// with an L2 penalty (bit-identical to `Adam` with a `WeightDecayConfig`).
    #[config(default = true)]
    pub decoupled_weight_decay: bool,
    /// Megatron's default: biases and norm weights (every 1-D parameter) get no weight decay.
    #[config(default = true)]
    pub no_weight_decay_on_1d: bool,
}

impl FusedAdamConfig {
    /// The optimizer with these hyper-parameters, refusing values outside their domain.
    ///
    /// ```
    /// use burn::module::ParamGroup;
    /// use burn_megatron::optimizer::FusedAdamConfig;
    /// let adam = FusedAdamConfig::new().with_weight_decay(0.01).init().unwrap()
    ///     .with_param_group(ParamGroup::from_regex(".*embedding.*").unwrap(), 0.0, 1.0);
    /// assert!(FusedAdamConfig::new().with_beta_1(1.0).init().is_err());
    /// ```
    pub fn init(&self) -> Result<FusedAdam, KernelError> {
        let bad = |what: &str| Err(KernelError::Argument(format!("{what} in {self:?}")));
        let unit = 0.0..1.0;
        if !unit.contains(&self.beta_1) || !unit.contains(&self.beta_2) {
            bad("beta_1 and beta_2 must lie in [0, 1)")
        } else if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            bad("epsilon must be finite and > 0")
        } else if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            bad("weight_decay must be finite and ≥ 0")
        } else {
            Ok(FusedAdam {
                config: self.clone(),
                overrides: Vec::new(),
            })
        }
    }
}

/// Fused Adam / AdamW with Megatron's parameter groups; hand it to
/// [`MegatronOptimizer::fused_adam`](super::MegatronOptimizer::fused_adam).
#[derive(Debug, Clone)]
pub struct FusedAdam {
    config: FusedAdamConfig,
    overrides: Vec<(ParamGroup, f32, f64)>,
}

impl FusedAdam {
    /// Parameters matching `group` (by id or module path) get `weight_decay` and a learning
    /// rate of `lr × lr_mult`. The first matching group wins; unmatched parameters follow the
    /// config. A negative or non-finite value is refused at the first step.
    pub fn with_param_group(mut self, group: ParamGroup, weight_decay: f32, lr_mult: f64) -> Self {
        self.overrides.push((group, weight_decay, lr_mult));
        self
    }

    fn options(&self, id: &ParamId, path: &str, dims: usize) -> (f32, f64) {
        if let Some(&(_, wd, mult)) = self.overrides.iter().find(|o| o.0.matches(id, Some(path))) {
            (wd, mult)
        } else if dims == 1 && self.config.no_weight_decay_on_1d {
            (0.0, 1.0)
        } else {
            (self.config.weight_decay, 1.0)
        }
    }
}

/// Which flat buffer of the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buffer {
    Master,
    ExpAvg,
    ExpAvgSq,
}

impl Buffer {
    pub(crate) const ALL: [Buffer; 3] = [Buffer::Master, Buffer::ExpAvg, Buffer::ExpAvgSq];

    pub(crate) fn file_stem(self) -> &'static str {
        match self {
            Buffer::Master => "master",
            Buffer::ExpAvg => "exp_avg",
            Buffer::ExpAvgSq => "exp_avg_sq",
        }
    }

    fn of(self, state: &FlatAdamState) -> &Tensor<1> {
        match self {
            Buffer::Master => &state.param,
            Buffer::ExpAvg => &state.exp_avg,
            Buffer::ExpAvgSq => &state.exp_avg_sq,
        }
    }
}

/// One parameter's place in its group's buffers.
#[derive(Debug, Clone)]
struct Slot {
    id: ParamId,
    rank: usize,
    len: usize,
    dtype: DType,
}

#[derive(Debug)]
struct Group {
    slots: Vec<Slot>,
    weight_decay: f32,
    lr_mult: f64,
    state: FlatAdamState,
}

impl Group {
    fn lengths(&self) -> Vec<usize> {
        self.slots.iter().map(|s| s.len).collect()
    }

    /// `buffer` cut into one `[len]` segment per slot.
    fn segments(&self, buffer: Buffer) -> Vec<Tensor<1>> {
        let flat = buffer.of(&self.state);
        let mut offset = 0;
        self.slots
            .iter()
            .map(|s| {
                offset += s.len;
                flat.clone().narrow(0, offset - s.len, s.len)
            })
            .collect()
    }

    /// The master segments in each slot's model dtype: one rounding pass when the group has
    /// one half dtype.
    fn model_segments(&self) -> Result<Vec<Tensor<1>>, KernelError> {
        let half = |d: DType| match d {
            DType::BF16 => Some(FloatDType::BF16),
            DType::F16 => Some(FloatDType::F16),
            _ => None,
        };
        let first = self.slots[0].dtype;
        if let (Some(h), true) = (half(first), self.slots.iter().all(|s| s.dtype == first))
            && let Ok(segments) =
                master_to_model_segments(self.state.param.clone(), &self.lengths(), h)
        {
            return Ok(segments);
        }
        // Mixed dtypes, or a device without the half type (where a plain cast is the answer).
        Ok(self
            .segments(Buffer::Master)
            .into_iter()
            .zip(&self.slots)
            .map(|(t, s)| match half(s.dtype) {
                Some(h) => master_to_model(t.clone(), h).unwrap_or_else(|_| t.cast(s.dtype)),
                None => t.cast(s.dtype),
            })
            .collect())
    }
}

/// What one rank's gradients say before the model-parallel reduction.
pub(crate) struct LocalStats {
    /// Each group's flat f32 gradient, still multiplied by the loss scale.
    pub flats: Vec<Tensor<1>>,
    /// Whether any gradient element is inf or NaN (or so large its square overflows f32).
    pub non_finite: bool,
    /// This rank's part of the unscaled norm: the sum of squares (L2) or the largest |g| (Inf)
    /// over the parameters it counts.
    pub norm_part: f64,
}

/// The flat state of [`FusedAdam`] for one model.
#[derive(Debug)]
pub(crate) struct FlatAdam {
    config: FusedAdamConfig,
    groups: Vec<Group>,
    step: u32,
}

/// Visits float parameters with their module path.
struct Walk<F> {
    path: Vec<String>,
    f: F,
}

impl<F: FnMut(&str, ParamId, usize, Tensor<1>, bool)> ModuleVisitor for Walk<F> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let value = p.val();
        let trainable = value.is_require_grad();
        let flat = value.inner().reshape([-1]);
        (self.f)(&self.path.join("."), p.id, D, flat, trainable);
    }
}

fn walk<M: Module>(module: &M, f: impl FnMut(&str, ParamId, usize, Tensor<1>, bool)) {
    module.visit(&mut Walk {
        path: Vec::new(),
        f,
    });
}

/// Replaces the parameters found in `values` (flat, reshaped back), keeping how each took
/// part in autodiff.
struct Replace(HashMap<ParamId, Tensor<1>>);

impl ModuleMapper for Replace {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, old, mapper) = p.consume();
        let Some(flat) = self.0.remove(&id) else {
            return Param::from_mapped_value(id, old, mapper);
        };
        let new = flat.reshape(old.dims());
        // An autodiff parameter stays one, under its own checkpointing strategy.
        let new = match old.gradient_checkpointing_strategy() {
            Some(strategy) => {
                Tensor::from_inner(new).with_gradient_checkpointing_strategy(strategy)
            }
            None => new,
        };
        let new = if old.is_require_grad() {
            new.require_grad()
        } else {
            new
        };
        Param::from_mapped_value(id, new, mapper)
    }
}

impl FlatAdam {
    /// Flat buffers for `model`'s trainable parameters (cast to f32), grouped by
    /// `(weight decay, lr_mult)` in the order the groups are first met.
    pub(crate) fn new<M: Module>(adam: &FusedAdam, model: &M) -> Self {
        let mut groups: Vec<(f32, f64, Vec<Slot>, Vec<Tensor<1>>)> = Vec::new();
        walk(model, |path, id, dims, flat, trainable| {
            if !trainable {
                return;
            }
            let (wd, mult) = adam.options(&id, path, dims);
            let slot = Slot {
                id,
                rank: dims,
                len: flat.dims()[0],
                dtype: flat.dtype(),
            };
            let key = |g: &&mut (f32, f64, Vec<Slot>, Vec<Tensor<1>>)| {
                g.0.to_bits() == wd.to_bits() && g.1.to_bits() == mult.to_bits()
            };
            let f32_flat = flat.cast(DType::F32);
            match groups.iter_mut().find(|g| key(g)) {
                Some(g) => {
                    g.2.push(slot);
                    g.3.push(f32_flat);
                }
                None => groups.push((wd, mult, vec![slot], vec![f32_flat])),
            }
        });
        let groups = groups
            .into_iter()
            .map(|(weight_decay, lr_mult, slots, flats)| Group {
                slots,
                weight_decay,
                lr_mult,
                state: FlatAdamState::new(Tensor::cat(flats, 0)),
            })
            .collect();
        Self {
            config: adam.config.clone(),
            groups,
            step: 0,
        }
    }

    /// Steps taken (skipped ones not counted), as burn-optim's time counter.
    pub(crate) fn steps(&self) -> u32 {
        self.step
    }

    /// Gathers the gradients (zeros for a trainable parameter without one) and measures them.
    pub(crate) fn local_stats(
        &self,
        grads: &GradientsParams,
        tp_rank: usize,
        norm_type: NormType,
        inv_scale: f64,
    ) -> Result<LocalStats, KernelError> {
        let flats: Vec<Tensor<1>> = self
            .groups
            .iter()
            .map(|g| {
                let device = g.state.param.device();
                let parts = g.slots.iter().map(|s| {
                    with_flat(grads, s.id, s.rank, |t| t.inner().cast(DType::F32))
                        .unwrap_or_else(|| Tensor::zeros([s.len], &device))
                });
                Tensor::cat(parts.collect(), 0)
            })
            .collect();
        if flats.is_empty() {
            return Ok(LocalStats {
                flats,
                non_finite: false,
                norm_part: 0.0,
            });
        }
        // One read-back for every group: per-parameter sums of squares, then (Inf norm) the
        // per-parameter largest |g|.
        let mut stats = Vec::new();
        for (g, flat) in self.groups.iter().zip(&flats) {
            stats.push(segment_sum_of_squares(flat.clone(), &g.lengths())?);
        }
        if norm_type == NormType::Inf {
            for (g, flat) in self.groups.iter().zip(&flats) {
                let mut offset = 0;
                for s in &g.slots {
                    let seg = flat.clone().narrow(0, offset, s.len);
                    offset += s.len;
                    stats.push(match s.len {
                        0 => Tensor::zeros([1], &flat.device()),
                        _ => seg.abs().max(),
                    });
                }
            }
        }
        let values: Vec<f32> = Tensor::cat(stats, 0).into_data().iter::<f32>().collect();
        let slots: Vec<&Slot> = self.groups.iter().flat_map(|g| &g.slots).collect();
        let (sums, maxes) = values.split_at(slots.len());
        let non_finite = sums.iter().any(|s| !s.is_finite());
        let counted = |i: &usize| parallel_attrs(slots[*i].id).counts_in_grad_norm(tp_rank);
        let norm_part = match norm_type {
            NormType::L2 => {
                let sum: f64 = (0..slots.len())
                    .filter(counted)
                    .map(|i| f64::from(sums[i]))
                    .sum();
                sum * inv_scale * inv_scale
            }
            NormType::Inf => {
                let max = (0..slots.len())
                    .filter(counted)
                    .map(|i| f64::from(maxes[i]))
                    .fold(0.0, f64::max);
                max * inv_scale
            }
        };
        Ok(LocalStats {
            flats,
            non_finite,
            norm_part,
        })
    }

    /// One fused step per group on the flat gradients of [`Self::local_stats`].
    pub(crate) fn apply(
        &mut self,
        flats: Vec<Tensor<1>>,
        lr: f64,
        inv_scale: f64,
        clip_coef: f64,
    ) -> Result<(), KernelError> {
        let c = &self.config;
        let step = self.step + 1;
        let hypers: Vec<AdamHyper> = self
            .groups
            .iter()
            .map(|g| AdamHyper {
                lr: lr * g.lr_mult,
                beta1: c.beta_1,
                beta2: c.beta_2,
                eps: c.epsilon,
                weight_decay: match (g.weight_decay, c.decoupled_weight_decay) {
                    (0.0, _) => WeightDecay::None,
                    (w, true) => WeightDecay::Decoupled(w),
                    (w, false) => WeightDecay::L2(w),
                },
                step,
                inv_scale: inv_scale as f32,
                clip_coef: clip_coef as f32,
            })
            .collect();
        // Every group's arguments are checked before any state is handed over, so a refused
        // step leaves the optimizer as it was.
        for h in &hypers {
            h.validate()?;
        }
        for ((g, flat), hyper) in self.groups.iter_mut().zip(flats).zip(&hypers) {
            // The state is moved in (nothing else holds it), so Flex updates it in place. The
            // non-finite count is known to be zero: overflow was checked before the step.
            let empty = placeholder(&g.state);
            let state = std::mem::replace(&mut g.state, empty);
            g.state = fused_adam_step(state, flat, hyper)?.0;
        }
        self.step = step;
        Ok(())
    }

    /// `model` with its trainable parameters set from the master weights, in their dtypes.
    pub(crate) fn model_from<M: Module>(&self, model: M) -> Result<M, KernelError> {
        let mut values = HashMap::new();
        for g in &self.groups {
            values.extend(g.slots.iter().map(|s| s.id).zip(g.model_segments()?));
        }
        Ok(model.map(&mut Replace(values)))
    }

    /// `model` with its trainable parameters replaced by their f32 segments of `buffer`
    /// (plain tensors, no autodiff): the state in module form, for checkpoints.
    pub(crate) fn state_module<M: Module>(&self, buffer: Buffer, model: &M) -> M {
        let values = self
            .groups
            .iter()
            .flat_map(|g| g.slots.iter().map(|s| s.id).zip(g.segments(buffer)))
            .collect();
        model.clone().map(&mut Replace(values))
    }

    /// Takes the state from modules written by [`Self::state_module`] (in [`Buffer::ALL`]
    /// order) and the step count.
    pub(crate) fn load(&mut self, modules: [&impl Module; 3], step: u32) -> Result<(), String> {
        let mut next = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let mut buffers = Vec::with_capacity(3);
            for module in modules {
                let mut by_id = HashMap::new();
                walk(module, |_, id, _, flat, _| {
                    by_id.insert(id, flat);
                });
                let mut parts = Vec::with_capacity(g.slots.len());
                for s in &g.slots {
                    match by_id.remove(&s.id) {
                        Some(t) if t.dims()[0] == s.len => parts.push(t.cast(DType::F32)),
                        Some(t) => {
                            return Err(format!(
                                "{:?}: {} elements, not {}",
                                s.id,
                                t.dims()[0],
                                s.len
                            ));
                        }
                        None => return Err(format!("no optimizer state for parameter {:?}", s.id)),
                    }
                }
                buffers.push(Tensor::cat(parts, 0));
            }
            let [param, exp_avg, exp_avg_sq]: [Tensor<1>; 3] = buffers
                .try_into()
                .map_err(|_| "three buffers".to_string())?;
            next.push(FlatAdamState {
                param,
                exp_avg,
                exp_avg_sq,
            });
        }
        for (g, state) in self.groups.iter_mut().zip(next) {
            g.state = state;
        }
        self.step = step;
        Ok(())
    }
}

/// Empty buffers standing in for a group's state while the step owns it.
fn placeholder(state: &FlatAdamState) -> FlatAdamState {
    let empty = || Tensor::<1>::zeros([0], &state.param.device());
    FlatAdamState {
        param: empty(),
        exp_avg: empty(),
        exp_avg_sq: empty(),
    }
}
