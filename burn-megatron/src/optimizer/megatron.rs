//! `MegatronOptimizer`: mixed precision (FP32 master weights), loss scaling with overflow
//! skipping, and clipping by the global gradient norm, around any burn-optim optimizer.

use super::cast::{Cast, cast_params, map_value, to_model_dtype};
use super::error::OptimizerError;
use super::fused_adam::{FlatAdam, FusedAdam};
use super::grad_norm::{
    LocalParts, NormGroups, NormType, agree_norm, clip_coefficient, clip_grads_of, local_norm_stats,
};
use super::grad_scaler::{GradScaler, GradScalerState};
use super::sharded_burn::ShardedBurn;
use crate::comm::{Comm, CommError};
use crate::data_parallel::advanced::OptimizerShards;
use crate::param_grads::{float_params, update_flat};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer, OptimizerRecord};
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::KernelError;

/// What one [`MegatronOptimizer::step`] did, for logging.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Whether the weights were updated (false: overflow, step skipped).
    pub updated: bool,
    /// The global gradient norm (unscaled), when the step was not skipped.
    pub grad_norm: Option<f64>,
    /// The clipping coefficient applied (1 when none).
    pub clip_coeff: f64,
    /// The loss scale used for this step's gradients.
    pub loss_scale: f64,
}

/// Wraps a burn-optim optimizer the way Megatron wraps torch optimizers.
///
/// One step: gradients cast to f32 and multiplied by `1 / loss_scale` → inf/NaN check agreed
/// across the model-parallel group (max-reduce) → on overflow the step is skipped, weights and
/// optimizer state untouched, the scaler updated → otherwise clip by the global norm → inner
/// step on the FP32 master weights → copy back to the model's dtype. FP32 models are stepped
/// directly (no master copy).
///
/// Around [`InnerOptimizer::FusedAdam`] it instead keeps flat FP32 buffers and steps each
/// parameter group in one fused kernel (Apex's `FusedAdam` with Megatron's `main_param`
/// buffers).
pub struct MegatronOptimizer<M: Module> {
    inner: Stepper,
    master: Option<M>,
    model_dtype: DType,
    scaler: Option<Box<dyn GradScaler>>,
    clip_grad: f64,
    norm_type: NormType,
    model_parallel: Comm,
    /// The group the expert parameters' share of the norm is summed over, once set.
    expert_model_parallel: Option<Comm>,
    tp_rank: usize,
    /// The scheduled weight decay, once [`MegatronOptimizer::set_weight_decay`] was called.
    weight_decay: Option<f64>,
}

/// What updates the weights.
enum Stepper {
    /// A burn-optim optimizer, per parameter.
    Burn(ModuleOptimizer),
    /// Flat buffers, one fused kernel per group.
    Fused(FlatAdam),
    /// A burn-optim optimizer on this data-parallel rank's pieces (ZeRO-1).
    Sharded(ShardedBurn),
}

impl<M: Module> std::fmt::Debug for MegatronOptimizer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronOptimizer")
            .field("fused", &matches!(self.inner, Stepper::Fused(_)))
            .field("model_dtype", &self.model_dtype)
            .field("scaler", &self.scaler)
            .field("clip_grad", &self.clip_grad)
            .finish_non_exhaustive()
    }
}

/// Multiplies every parameter of rank above 1 (Megatron's no-decay group is the 1-D ones)
/// by the factor, keeping ids and `require_grad`.
struct Decay(f64);

impl ModuleMapper for Decay {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if D == 1 {
            return p;
        }
        map_value(p, |t| t.mul_scalar(self.0))
    }
}

/// FP32 master weights to the model's dtype, one rounding pass per parameter.
struct ToModel(DType);

impl ModuleMapper for ToModel {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        // Detached before the rounding pass, so it records no autodiff op.
        map_value(p, |t| to_model_dtype(t.detach(), self.0))
    }
}

fn model_dtype<M: Module>(model: &M) -> DType {
    struct First(Option<DType>);
    impl burn::module::ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.get_or_insert(p.val().dtype());
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0.unwrap_or(DType::F32)
}

/// What [`MegatronOptimizer`] steps: the fused flat-buffer Adam, or any burn-optim optimizer
/// (`AdamWConfig::new().init()` and the like convert into it).
pub enum InnerOptimizer {
    /// The fused Adam / AdamW: the trainable parameters become segments of flat FP32
    /// buffers (one per parameter group, whatever the model's dtype), and a step is one
    /// read-back of per-parameter sums of squares (overflow check and norm), one collective,
    /// and one fused kernel per group. A trainable parameter without a gradient in a step is
    /// stepped with a zero gradient (Megatron's zeroed `main_grad`), where burn-optim would
    /// leave it alone.
    FusedAdam(FusedAdam),
    /// A burn-optim optimizer, per parameter, on FP32 master weights when the model is not
    /// f32.
    Burn(ModuleOptimizer),
}

impl From<FusedAdam> for InnerOptimizer {
    fn from(adam: FusedAdam) -> Self {
        Self::FusedAdam(adam)
    }
}

impl From<ModuleOptimizer> for InnerOptimizer {
    fn from(optimizer: ModuleOptimizer) -> Self {
        Self::Burn(optimizer)
    }
}

impl<M: Module + Clone> MegatronOptimizer<M> {
    /// Wraps `inner` for `model` (whose dtype decides whether FP32 master weights are kept).
    /// `model_parallel` is the tp × pp group over which the overflow check and the grad norm
    /// are reduced; `tp_rank` decides which duplicated parameters count in the norm.
    ///
    /// A training loop gets its optimizer from
    /// [`ParallelTraining::optimizer`](crate::training::ParallelTraining::optimizer), which
    /// passes these arguments (and shards it with the distributed optimizer); this is for a
    /// model driven without it.
    ///
    /// ```
    /// use burn::nn::LinearConfig;
    /// use burn::tensor::Device;
    /// use burn_megatron::comm::LocalWorld;
    /// use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer};
    /// use std::sync::Arc;
    /// let model = LinearConfig::new(4, 4).init(&Device::flex().autodiff());
    /// let solo = Arc::new(LocalWorld::new(1).communicator("mp", vec![0], 0).unwrap());
    /// let adam = FusedAdamConfig::new().with_weight_decay(0.01).init().unwrap();
    /// let optim = MegatronOptimizer::new(adam, &model, solo, 0);
    /// assert!(optim.is_fused());
    /// ```
    pub fn new(
        inner: impl Into<InnerOptimizer>,
        model: &M,
        model_parallel: Comm,
        tp_rank: usize,
    ) -> Self {
        let (stepper, master) = match inner.into() {
            InnerOptimizer::FusedAdam(adam) => (Stepper::Fused(FlatAdam::new(&adam, model)), None),
            InnerOptimizer::Burn(inner) => {
                let f32_master = model_dtype(model) != DType::F32;
                let master = f32_master.then(|| model.clone().map(&mut Cast(DType::F32)));
                (Stepper::Burn(inner), master)
            }
        };
        Self::with_stepper(stepper, master, model, model_parallel, tp_rank)
    }

    /// The wrapper around `inner` (with `master`, the FP32 master weights it keeps beside
    /// it), no scaler, no clipping, the inner optimizer's own weight decay.
    fn with_stepper(
        inner: Stepper,
        master: Option<M>,
        model: &M,
        model_parallel: Comm,
        tp_rank: usize,
    ) -> Self {
        Self {
            inner,
            master,
            model_dtype: model_dtype(model),
            scaler: None,
            clip_grad: 0.0,
            norm_type: NormType::L2,
            model_parallel,
            expert_model_parallel: None,
            tp_rank,
            weight_decay: None,
        }
    }

    /// Sums the expert parameters' share of the gradient norm and overflow check over
    /// `expert_model_parallel` (the expert tensor × expert × pipeline group,
    /// [`RankGroups::expert_mp`](crate::launch::RankGroups::expert_mp)) instead of the dense
    /// model-parallel group, so that each expert counts once (Megatron's expert grad-stats
    /// group).
    pub fn with_expert_model_parallel(mut self, expert_model_parallel: Comm) -> Self {
        self.expert_model_parallel = Some(expert_model_parallel);
        self
    }

    /// [`MegatronOptimizer::new`] as Megatron's distributed optimizer (ZeRO-1,
    /// `--use-distributed-optimizer`): this data-parallel rank keeps FP32 master weights and
    /// the optimizer's state only for the elements `shards`' plans give it, 12 bytes per
    /// parameter for Adam over the data-parallel size instead of 12 (the experts' over the
    /// expert data-parallel size). Its gradients must come from the plans' reduction
    /// ([`finalize_model_grads`] with [`DpReduction::ReduceScatter`] or
    /// [`OverlapReducer::distributed`], and [`finalize_expert_grads`] with
    /// `ReduceScatter` for experts); a step measures its shards
    /// (overflow and norm summed over the data-parallel groups too), steps them, and
    /// all-gathers the updated weights bucket by bucket. A model with experts needs expert
    /// plans ([`OptimizerShards::with_experts`]).
    ///
    /// A burn-optim `inner` steps this rank's pieces of the parameters as parameters of
    /// their own: build it without weight decay (see
    /// [`MegatronOptimizer::set_weight_decay`]) and without id-based parameter groups.
    /// Checkpoints gather the state into whole parameters, as for the unsharded optimizer.
    /// [`ParallelTraining::optimizer`](crate::training::ParallelTraining::optimizer) builds
    /// this when configured with `use_distributed_optimizer`.
    ///
    /// [`finalize_model_grads`]: crate::data_parallel::advanced::finalize_model_grads
    /// [`DpReduction::ReduceScatter`]: crate::data_parallel::advanced::DpReduction::ReduceScatter
    /// [`finalize_expert_grads`]: crate::data_parallel::advanced::finalize_expert_grads
    /// [`OverlapReducer::distributed`]: crate::data_parallel::advanced::OverlapReducer::distributed
    /// [`OptimizerShards::with_experts`]: crate::data_parallel::advanced::OptimizerShards::with_experts
    pub fn distributed(
        inner: impl Into<InnerOptimizer>,
        model: &M,
        shards: OptimizerShards,
        model_parallel: Comm,
        tp_rank: usize,
    ) -> Result<Self, CommError> {
        let stepper = match inner.into() {
            InnerOptimizer::FusedAdam(adam) => {
                Stepper::Fused(FlatAdam::distributed(&adam, model, shards)?)
            }
            InnerOptimizer::Burn(inner) => {
                Stepper::Sharded(ShardedBurn::new(inner, model, shards)?)
            }
        };
        Ok(Self::with_stepper(
            stepper,
            None,
            model,
            model_parallel,
            tp_rank,
        ))
    }

    /// Megatron's weight-decay schedule: from the next step on, every parameter's decoupled
    /// weight decay is `wd × wd_mult` — call it each step with
    /// [`OptimizerParamScheduler::wd_at`](crate::optimizer::OptimizerParamScheduler::wd_at).
    ///
    /// The fused Adam scales its groups' `wd_mult` (0 on 1-D parameters by default). Around a
    /// burn-optim optimizer the wrapper decays the weights itself, `p ← p·(1 − lr·wd)` before
    /// the inner step on every parameter but the 1-D ones (Megatron's no-decay group), which
    /// is AdamW's own decay: build the inner optimizer without weight decay. Refuses a
    /// negative or non-finite `wd`.
    pub fn set_weight_decay(&mut self, wd: f64) -> Result<(), OptimizerError> {
        if !(wd.is_finite() && wd >= 0.0) {
            return Err(OptimizerError::Kernel(KernelError::Argument(format!(
                "weight decay must be finite and ≥ 0, got {wd}"
            ))));
        }
        match &mut self.inner {
            Stepper::Fused(flat) => flat.set_weight_decay(wd as f32),
            // Rounded to f32 as burn-optim's AdamW holds its weight decay, so that the two
            // paths (and AdamW built with that decay) agree bit for bit.
            Stepper::Burn(_) | Stepper::Sharded(_) => {
                self.weight_decay = Some(f64::from(wd as f32))
            }
        }
        Ok(())
    }

    /// The model-parallel (tp × pp) group the overflow check and the norm are reduced over.
    pub(crate) fn model_parallel(&self) -> &Comm {
        &self.model_parallel
    }

    /// Whether it steps the fused Adam ([`InnerOptimizer::FusedAdam`]).
    pub fn is_fused(&self) -> bool {
        matches!(self.inner, Stepper::Fused(_))
    }

    /// This rank's index in the data-parallel group of a distributed optimizer
    /// ([`MegatronOptimizer::distributed`]); `None` for the others.
    pub fn data_parallel_rank(&self) -> Option<usize> {
        self.shards().map(|s| s.dp().group().rank())
    }

    /// This rank's index in the expert data-parallel group of a distributed optimizer that
    /// shards experts; `None` for the others.
    pub fn expert_data_parallel_rank(&self) -> Option<usize> {
        self.shards()
            .and_then(|s| s.expert_dp())
            .map(|c| c.group().rank())
    }

    fn shards(&self) -> Option<&OptimizerShards> {
        match &self.inner {
            Stepper::Fused(f) => f.shards(),
            Stepper::Sharded(s) => Some(s.shards()),
            Stepper::Burn(_) => None,
        }
    }

    /// A burn-optim optimizer's state for a checkpoint: its record over the model's whole
    /// parameters and its FP32 master weights (when it keeps them). Collective over the
    /// data-parallel group for a distributed one; `None` for the fused optimizer.
    pub(crate) fn burn_state(
        &self,
        model: &M,
    ) -> Result<Option<(OptimizerRecord, Option<M>)>, OptimizerError> {
        Ok(match &self.inner {
            Stepper::Burn(inner) => Some((inner.to_record(), self.master.clone())),
            Stepper::Sharded(s) => {
                let (record, master) = s.whole(model)?;
                Some((record, Some(master)))
            }
            Stepper::Fused(_) => None,
        })
    }

    /// What a checkpoint's master weights are read into, for a burn-optim optimizer that
    /// keeps them.
    pub(crate) fn master_template(&self, model: &M) -> Option<M> {
        match &self.inner {
            Stepper::Burn(_) => self.master.clone(),
            Stepper::Sharded(_) => Some(cast_params(model.clone(), DType::F32)),
            Stepper::Fused(_) => None,
        }
    }

    /// Elements of optimizer state this rank holds for the fused optimizer or a distributed
    /// one: FP32 master weights and two moments, each as long as the parameter elements it
    /// steps (all of them, or this rank's shards). `None` for a plain burn-optim optimizer,
    /// whose state lives inside it.
    pub fn state_elements(&self) -> Option<usize> {
        match &self.inner {
            Stepper::Fused(f) => Some(3 * f.state_elements()),
            // The master pieces and Adam's two moments of each.
            Stepper::Sharded(s) => Some(3 * s.state_elements()),
            Stepper::Burn(_) => None,
        }
    }

    /// Scales losses with `scaler` (f16 training).
    pub fn with_grad_scaler(mut self, scaler: impl GradScaler + 'static) -> Self {
        self.scaler = Some(Box::new(scaler));
        self
    }

    /// Clips gradients to a global norm of `max_norm` (0 disables clipping).
    pub fn with_clip_grad(mut self, max_norm: f64, norm_type: NormType) -> Self {
        self.clip_grad = max_norm;
        self.norm_type = norm_type;
        self
    }

    /// The current loss scale (1 without a scaler): multiply the loss by it before backward.
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale())
    }

    /// The scaler, for checkpointing its state.
    pub fn grad_scaler(&self) -> Option<&dyn GradScaler> {
        self.scaler.as_deref()
    }

    /// The wrapped burn-optim optimizer (its state is keyed by `ParamId`, shared with the
    /// model); `None` for the fused optimizer, whose state is flat.
    pub fn inner(&self) -> Option<&ModuleOptimizer> {
        match &self.inner {
            Stepper::Burn(inner) => Some(inner),
            Stepper::Fused(_) | Stepper::Sharded(_) => None,
        }
    }

    /// The FP32 master weights of a burn-optim optimizer on a bf16 / f16 model.
    pub fn master(&self) -> Option<&M> {
        self.master.as_ref()
    }

    pub(crate) fn flat(&self) -> Option<&FlatAdam> {
        match &self.inner {
            Stepper::Fused(flat) => Some(flat),
            Stepper::Burn(_) | Stepper::Sharded(_) => None,
        }
    }

    pub(crate) fn flat_mut(&mut self) -> Option<&mut FlatAdam> {
        match &mut self.inner {
            Stepper::Fused(flat) => Some(flat),
            Stepper::Burn(_) | Stepper::Sharded(_) => None,
        }
    }

    /// Takes the checkpointed loss-scaler state.
    pub(crate) fn restore_scaler(&mut self, scaler: Option<GradScalerState>) {
        if let (Some(s), Some(state)) = (self.scaler.as_mut(), scaler) {
            s.load_state(state);
        }
    }

    /// Takes a checkpointed burn-optim state: the inner optimizer's record and the master
    /// weights (no-op for the fused optimizer).
    pub(crate) fn restore(
        mut self,
        record: OptimizerRecord,
        master: Option<M>,
    ) -> Result<Self, OptimizerError> {
        match self.inner {
            Stepper::Burn(inner) => Ok(Self {
                inner: Stepper::Burn(inner.load_record(record)),
                master,
                ..self
            }),
            Stepper::Sharded(ref mut sharded) => {
                if let Some(m) = &master {
                    sharded.load_whole(record, m)?;
                }
                Ok(self)
            }
            Stepper::Fused(_) => Ok(self),
        }
    }

    /// One step with learning rate `lr` on `grads` of the *scaled* loss.
    pub fn step(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<(M, StepReport), OptimizerError> {
        let loss_scale = self.loss_scale();
        let skipped = StepReport {
            updated: false,
            grad_norm: None,
            clip_coeff: 1.0,
            loss_scale,
        };
        let (dp, expert_dp) = match self.shards() {
            Some(s) => (Some(s.dp().clone()), s.expert_dp().cloned()),
            None => (None, None),
        };
        let groups = NormGroups {
            model_parallel: &self.model_parallel,
            experts: self.expert_model_parallel.as_ref(),
            dp: dp.as_ref(),
            expert_dp: expert_dp.as_ref(),
            norm_type: self.norm_type,
        };
        let inner = match &mut self.inner {
            Stepper::Burn(inner) => inner,
            Stepper::Sharded(sharded) => {
                let measured =
                    sharded.measure(&grads, self.tp_rank, self.norm_type, 1.0 / loss_scale);
                let parts = LocalParts {
                    non_finite: measured.non_finite,
                    dense: measured.norm_part,
                    experts: measured.expert_norm_part,
                };
                let Some(norm) = agree_norm(parts, groups, self.scaler.as_mut())? else {
                    return Ok((model, skipped));
                };
                // AdamW's decoupled decay on the master pieces, as `Decay` on whole tensors.
                let decay = self
                    .weight_decay
                    .map(|wd| 1.0 - lr * wd)
                    .filter(|&f| f != 1.0);
                let (model, clip_coeff) =
                    sharded.apply(measured, lr, self.clip_grad, norm, decay, model)?;
                let report = StepReport {
                    updated: true,
                    grad_norm: Some(norm),
                    clip_coeff,
                    loss_scale,
                };
                return Ok((model, report));
            }
            Stepper::Fused(flat) => {
                let inv_scale = 1.0 / loss_scale;
                let stats = flat.local_stats(&grads, self.tp_rank, self.norm_type, inv_scale)?;
                let parts = LocalParts {
                    non_finite: stats.non_finite,
                    dense: stats.norm_part,
                    experts: stats.expert_norm_part,
                };
                let Some(norm) = agree_norm(parts, groups, self.scaler.as_mut())? else {
                    return Ok((model, skipped));
                };
                let clip_coeff = clip_coefficient(self.clip_grad, norm);
                // The model lets go of its views of the master buffer, so that the step
                // updates it in place instead of copying it.
                let model = flat.vacate(model);
                flat.apply(stats.pieces, lr, inv_scale, clip_coeff)?;
                let model = flat.model_from(model)?;
                let report = StepReport {
                    updated: true,
                    grad_norm: Some(norm),
                    clip_coeff,
                    loss_scale,
                };
                return Ok((model, report));
            }
        };
        let params = float_params(&model);
        let mut grads = unscale(grads, &params, 1.0 / loss_scale);
        let is_expert = |id: ParamId| crate::tensor_parallel::parallel_attrs(id).expert;
        let (experts, dense): (Vec<_>, Vec<_>) = match &self.expert_model_parallel {
            Some(_) => params.iter().partition(|&&(id, _)| is_expert(id)),
            None => (Vec::new(), params.clone()),
        };
        // One sum-of-squares pass gives overflow and norm; one collective agrees on both.
        let stats = local_norm_stats(&dense, &grads, self.tp_rank, self.norm_type, true);
        let expert_stats = local_norm_stats(&experts, &grads, self.tp_rank, self.norm_type, true);
        let parts = LocalParts {
            non_finite: stats.non_finite || expert_stats.non_finite,
            dense: stats.norm_part,
            experts: expert_stats.norm_part,
        };
        let Some(norm) = agree_norm(parts, groups, self.scaler.as_mut())? else {
            return Ok((model, skipped));
        };
        let clip_coeff = clip_grads_of(&params, &mut grads, self.clip_grad, norm);
        let report = StepReport {
            updated: true,
            grad_norm: Some(norm),
            clip_coeff,
            loss_scale,
        };
        // AdamW's decoupled decay, `p·(1 − lr·wd)`, in the same f64 → element arithmetic.
        let decay = self
            .weight_decay
            .map(|wd| Decay(1.0 - lr * wd))
            .filter(|d| d.0 != 1.0);
        let model = match self.master.take() {
            None => match decay {
                Some(mut d) => inner.step(lr, model.map(&mut d), grads),
                None => inner.step(lr, model, grads),
            },
            Some(master) => {
                let master = match decay {
                    Some(mut d) => master.map(&mut d),
                    None => master,
                };
                let master = inner.step(lr, master, grads);
                let model = master.clone().map(&mut ToModel(self.model_dtype));
                self.master = Some(master);
                model
            }
        };
        Ok((model, report))
    }
}

/// Gradients cast to f32 and multiplied by `factor`.
fn unscale(
    mut grads: GradientsParams,
    params: &[(ParamId, usize)],
    factor: f64,
) -> GradientsParams {
    for &(id, rank) in params {
        let _ = update_flat::<std::convert::Infallible>(&mut grads, id, rank, |g| {
            let g = g.cast(DType::F32);
            Ok(if factor == 1.0 { g } else { g * factor })
        });
    }
    grads
}
