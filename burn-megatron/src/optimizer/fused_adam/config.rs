//! The user-facing configuration: hyper-parameters and parameter groups.

use burn::config::Config;
use burn::module::{ParamGroup, ParamId};
use burn_megatron_kernels::KernelError;

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
/// [`MegatronOptimizer::new`](crate::optimizer::MegatronOptimizer::new).
#[derive(Debug, Clone)]
pub struct FusedAdam {
    pub(super) config: FusedAdamConfig,
    overrides: Vec<(ParamGroup, f32, f64)>,
}

impl FusedAdam {
    /// Parameters matching `group` (by id or module path) get a weight decay of
    /// `weight_decay × wd_mult` and a learning rate of `lr × lr_mult` (Megatron's per-group
    /// multipliers; `weight_decay` is the config's, or the schedule's once
    /// [`MegatronOptimizer::set_weight_decay`](crate::optimizer::MegatronOptimizer::set_weight_decay)
    /// is called). The first matching group wins; unmatched parameters follow the config
    /// (`wd_mult` 1, or 0 on 1-D parameters with `no_weight_decay_on_1d`). A negative or
    /// non-finite value is refused at the first step.
    pub fn with_param_group(mut self, group: ParamGroup, wd_mult: f32, lr_mult: f64) -> Self {
        self.overrides.push((group, wd_mult, lr_mult));
        self
    }

    /// `(wd_mult, lr_mult)` of a parameter.
    pub(super) fn options(&self, id: &ParamId, path: &str, dims: usize) -> (f32, f64) {
        if let Some(&(_, wd, mult)) = self.overrides.iter().find(|o| o.0.matches(id, Some(path))) {
            (wd, mult)
        } else if dims == 1 && self.config.no_weight_decay_on_1d {
            (0.0, 1.0)
        } else {
            (1.0, 1.0)
        }
    }
}
