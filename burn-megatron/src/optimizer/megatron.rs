//! `MegatronOptimizer`: mixed precision (FP32 master weights), loss scaling with overflow
//! skipping, and clipping by the global gradient norm, around any burn-optim optimizer.

use super::grad_norm::{NormType, clip_grads_of, grad_norm_of};
use super::grad_scaler::{GradScaler, GradScalerState};
use crate::comm::{Comm, CommError, CommunicatorExt, ReduceOp};
use crate::param_grads::{float_params, update_flat, with_flat};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer, OptimizerRecord};
use burn::tensor::{DType, FloatDType, Tensor};
use burn_megatron_kernels::master_to_model;

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
pub struct MegatronOptimizer<M: Module> {
    inner: ModuleOptimizer,
    master: Option<M>,
    model_dtype: DType,
    scaler: Option<Box<dyn GradScaler>>,
    clip_grad: f64,
    norm_type: NormType,
    model_parallel: Comm,
    tp_rank: usize,
}

impl<M: Module> std::fmt::Debug for MegatronOptimizer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronOptimizer")
            .field("model_dtype", &self.model_dtype)
            .field("scaler", &self.scaler)
            .field("clip_grad", &self.clip_grad)
            .finish_non_exhaustive()
    }
}

/// Casts every float parameter, keeping ids and whether it requires grad.
struct Cast(DType);

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, t, mapper) = p.consume();
        let rg = t.is_require_grad();
        Param::from_mapped_value(id, t.cast(self.0).detach().set_require_grad(rg), mapper)
    }
}

/// FP32 master weights to the model's half dtype: one fused rounding pass per parameter
/// (`master_to_model`, bit-exact with `half`'s round-to-nearest-even).
struct ToModel(DType);

impl ModuleMapper for ToModel {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, t, mapper) = p.consume();
        let rg = t.is_require_grad();
        let t = t.detach();
        let half = match self.0 {
            DType::BF16 => Some(FloatDType::BF16),
            DType::F16 => Some(FloatDType::F16),
            _ => None,
        };
        let model = match half {
            Some(dtype) if t.dtype() == DType::F32 => {
                // Only a device without the half type refuses, and a plain cast there would
                // fail the same way.
                master_to_model(t.clone(), dtype).unwrap_or_else(|_| t.cast(self.0))
            }
            _ => t.cast(self.0),
        };
        Param::from_mapped_value(id, model.set_require_grad(rg), mapper)
    }
}

/// `model` with every float parameter cast to `dtype` (ids and `require_grad` kept): how a
/// model is put in bf16 / f16 before [`MegatronOptimizer::new`] keeps its FP32 master copy.
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::{DType, Device};
/// use burn_megatron::optimizer::cast_params;
/// let model = cast_params(LinearConfig::new(2, 2).init(&Device::flex().autodiff()), DType::BF16);
/// assert_eq!(model.weight.val().dtype(), DType::BF16);
/// ```
pub fn cast_params<M: Module>(model: M, dtype: DType) -> M {
    model.map(&mut Cast(dtype))
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

impl<M: Module + Clone> MegatronOptimizer<M> {
    /// Wraps `inner` for `model` (whose dtype decides whether FP32 master weights are kept).
    /// `model_parallel` is the tp × pp group over which the overflow check and the grad norm
    /// are reduced; `tp_rank` decides which duplicated parameters count in the norm.
    pub fn new(
        inner: impl Into<ModuleOptimizer>,
        model: &M,
        model_parallel: Comm,
        tp_rank: usize,
    ) -> Self {
        let dtype = model_dtype(model);
        let master = (dtype != DType::F32).then(|| model.clone().map(&mut Cast(DType::F32)));
        Self {
            inner: inner.into(),
            master,
            model_dtype: dtype,
            scaler: None,
            clip_grad: 0.0,
            norm_type: NormType::L2,
            model_parallel,
            tp_rank,
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

    /// The wrapped optimizer (its state is keyed by `ParamId`, shared with the model).
    pub fn inner(&self) -> &ModuleOptimizer {
        &self.inner
    }

    /// The FP32 master weights (bf16 / f16 models only).
    pub fn master(&self) -> Option<&M> {
        self.master.as_ref()
    }

    /// Takes a checkpointed state: the inner optimizer's record, the master weights and the
    /// scaler's state.
    pub(crate) fn restore(
        mut self,
        record: OptimizerRecord,
        master: Option<M>,
        scaler: Option<GradScalerState>,
    ) -> Self {
        if let (Some(s), Some(state)) = (self.scaler.as_mut(), scaler) {
            s.load_state(state);
        }
        Self {
            inner: self.inner.load_record(record),
            master,
            ..self
        }
    }

    /// One step with learning rate `lr` on `grads` of the *scaled* loss.
    pub fn step(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<(M, StepReport), CommError> {
        let loss_scale = self.loss_scale();
        let params = float_params(&model);
        let mut grads = unscale(grads, &params, 1.0 / loss_scale);
        let local_inf = params.iter().any(|&(id, d)| {
            with_flat(&grads, id, d, |g| {
                let finite: Tensor<1> = g.clone().is_finite().float();
                finite.min().into_scalar::<f32>() < 1.0
            })
            .unwrap_or(false)
        });
        let mut found = vec![if local_inf { 1.0f32 } else { 0.0 }];
        self.model_parallel
            .all_reduce_vec(&mut found, ReduceOp::Max)?;
        let found_inf = found[0] > 0.0;
        if let Some(s) = self.scaler.as_mut() {
            s.update(found_inf);
        }
        if found_inf {
            let report = StepReport {
                updated: false,
                grad_norm: None,
                clip_coeff: 1.0,
                loss_scale,
            };
            return Ok((model, report));
        }
        let norm = grad_norm_of(
            &params,
            &grads,
            self.tp_rank,
            &self.model_parallel,
            self.norm_type,
        )?;
        let clip_coeff = if self.clip_grad > 0.0 {
            clip_grads_of(&params, &mut grads, self.clip_grad, norm)
        } else {
            1.0
        };
        let report = StepReport {
            updated: true,
            grad_norm: Some(norm),
            clip_coeff,
            loss_scale,
        };
        let model = match self.master.take() {
            None => self.inner.step(lr, model, grads),
            Some(master) => {
                let master = self.inner.step(lr, master, grads);
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
