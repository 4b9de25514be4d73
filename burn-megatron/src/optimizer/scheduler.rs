//! Megatron-Core's `OptimizerParamScheduler`: learning-rate warmup and decay, and
//! weight-decay increment, as pure functions of the step.

use burn::optim::LearningRate;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use std::f64::consts::PI;

/// How the learning rate decays after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LrDecayStyle {
    /// `max_lr` after warmup.
    Constant,
    /// Linear from `max_lr` to `min_lr`.
    Linear,
    /// Half a cosine from `max_lr` to `min_lr`.
    Cosine,
    /// `max_lr · √warmup / √step`, floored at `min_lr`.
    InverseSquareRoot,
    /// Warmup-stable-decay: `max_lr` until the last `wsd_decay_steps`, then annealed.
    Wsd,
}

/// The annealing shape of the WSD style's decay phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum WsdDecayStyle {
    /// `1 − r`.
    Linear,
    /// `(cos(π r) + 1) / 2`.
    Cosine,
    /// `2 · 0.5^r − 1`.
    Exponential,
    /// `1 − √r`.
    MinusSqrt,
}

/// How weight decay moves from `start_wd` to `end_wd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum WdIncrStyle {
    /// Constant (`start_wd` must equal `end_wd`).
    Constant,
    /// Linear.
    Linear,
    /// Half a cosine.
    Cosine,
}

/// The scheduler's settings, named as Megatron-Core's constructor arguments.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerParamSchedulerConfig {
    /// Learning rate at step 0 (start of warmup).
    pub init_lr: f64,
    /// Learning rate at the end of warmup.
    pub max_lr: f64,
    /// Floor of the decay.
    pub min_lr: f64,
    /// Warmup steps.
    pub lr_warmup_steps: usize,
    /// Step at which the decay reaches `min_lr` (warmup included).
    pub lr_decay_steps: usize,
    /// Decay style.
    pub lr_decay_style: LrDecayStyle,
    /// Steps of the WSD decay phase (required by [`LrDecayStyle::Wsd`]).
    pub wsd_decay_steps: Option<usize>,
    /// WSD annealing shape (required by [`LrDecayStyle::Wsd`]).
    pub lr_wsd_decay_style: Option<WsdDecayStyle>,
    /// Weight decay at step 0.
    pub start_wd: f64,
    /// Weight decay from `wd_incr_steps` on.
    pub end_wd: f64,
    /// Steps over which weight decay moves from `start_wd` to `end_wd`.
    pub wd_incr_steps: usize,
    /// Weight-decay increment style.
    pub wd_incr_style: WdIncrStyle,
}

/// Per-parameter-group overrides (Megatron's `max_lr`, `min_lr`, `wd_mult` group keys).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ParamGroupSchedule {
    /// This group's `max_lr` (the scheduler's when `None`).
    pub max_lr: Option<f64>,
    /// This group's `min_lr` (the scheduler's when `None`).
    pub min_lr: Option<f64>,
    /// Multiplier of the weight decay (1 when `None`).
    pub wd_mult: Option<f64>,
}

/// Learning-rate and weight-decay schedule with Megatron-Core's exact formulas.
///
/// ```
/// use burn_megatron::optimizer::*;
/// let s = OptimizerParamScheduler::new(OptimizerParamSchedulerConfig {
///     init_lr: 0.01, max_lr: 0.1, min_lr: 0.001,
///     lr_warmup_steps: 100, lr_decay_steps: 1000,
///     lr_decay_style: LrDecayStyle::Linear,
///     wsd_decay_steps: None, lr_wsd_decay_style: None,
///     start_wd: 0.01, end_wd: 0.01, wd_incr_steps: 1000, wd_incr_style: WdIncrStyle::Constant,
/// }).unwrap();
/// assert!((s.lr_at(50) - 0.055).abs() < 1e-12);
/// assert!((s.lr_at(500) - 0.056).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerParamScheduler {
    config: OptimizerParamSchedulerConfig,
    num_steps: usize,
}

impl OptimizerParamScheduler {
    /// Validates `config` (Megatron's assertions, as errors) and starts at step 0.
    pub fn new(config: OptimizerParamSchedulerConfig) -> Result<Self, String> {
        let c = &config;
        let fail = |m: String| Err(m);
        if c.min_lr < 0.0 {
            return fail(format!("min_lr ({}) must be >= 0", c.min_lr));
        }
        if c.max_lr < c.min_lr {
            return fail(format!(
                "max_lr ({}) must be >= min_lr ({})",
                c.max_lr, c.min_lr
            ));
        }
        if c.init_lr > c.max_lr {
            return fail(format!(
                "init_lr ({}) must be <= max_lr ({})",
                c.init_lr, c.max_lr
            ));
        }
        if c.lr_decay_steps == 0 {
            return fail("lr_decay_steps must be > 0".into());
        }
        if c.lr_warmup_steps >= c.lr_decay_steps {
            return fail(format!(
                "lr_warmup_steps ({}) must be < lr_decay_steps ({})",
                c.lr_warmup_steps, c.lr_decay_steps
            ));
        }
        if c.lr_decay_style == LrDecayStyle::Wsd {
            match (c.wsd_decay_steps, c.lr_wsd_decay_style) {
                (Some(s), Some(_)) if s > 0 && s <= c.lr_decay_steps => {}
                _ => {
                    return fail(format!(
                        "the WSD style needs wsd_decay_steps in 1..={} and lr_wsd_decay_style",
                        c.lr_decay_steps
                    ));
                }
            }
        }
        if c.start_wd < 0.0 || c.end_wd < c.start_wd {
            return fail(format!(
                "need 0 <= start_wd ({}) <= end_wd ({})",
                c.start_wd, c.end_wd
            ));
        }
        if c.wd_incr_style == WdIncrStyle::Constant && c.start_wd != c.end_wd {
            return fail(format!(
                "constant weight decay needs start_wd ({}) == end_wd ({})",
                c.start_wd, c.end_wd
            ));
        }
        if c.wd_incr_style != WdIncrStyle::Constant && c.wd_incr_steps == 0 {
            return fail("wd_incr_steps must be > 0 for an increasing weight decay".into());
        }
        Ok(Self {
            config,
            num_steps: 0,
        })
    }

    /// The settings.
    pub fn config(&self) -> &OptimizerParamSchedulerConfig {
        &self.config
    }

    /// Steps taken so far.
    pub fn num_steps(&self) -> usize {
        self.num_steps
    }

    /// Learning rate at `step` with the scheduler's own `max_lr` / `min_lr`.
    pub fn lr_at(&self, step: usize) -> f64 {
        self.group_lr_at(step, &ParamGroupSchedule::default())
    }

    /// Learning rate at `step` for a parameter group with its own `max_lr` / `min_lr`.
    pub fn group_lr_at(&self, step: usize, group: &ParamGroupSchedule) -> f64 {
        let c = &self.config;
        let max_lr = group.max_lr.unwrap_or(c.max_lr);
        let min_lr = group.min_lr.unwrap_or(c.min_lr);
        let (warmup, decay) = (c.lr_warmup_steps, c.lr_decay_steps);
        if warmup > 0 && step <= warmup {
            return c.init_lr + (max_lr - c.init_lr) * step as f64 / warmup as f64;
        }
        if c.lr_decay_style == LrDecayStyle::Constant {
            return max_lr;
        }
        if step > decay {
            return min_lr;
        }
        if c.lr_decay_style == LrDecayStyle::InverseSquareRoot {
            let lr = max_lr * (warmup.max(1) as f64).sqrt() / (step.max(1) as f64).sqrt();
            return lr.max(min_lr);
        }
        let ratio = (step - warmup) as f64 / (decay - warmup) as f64;
        let coeff = match c.lr_decay_style {
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => 0.5 * ((PI * ratio).cos() + 1.0),
            LrDecayStyle::Wsd => {
                let wsd = c.wsd_decay_steps.expect("validated");
                let anneal_start = decay - wsd;
                if step <= anneal_start {
                    1.0
                } else {
                    let r = (step - anneal_start) as f64 / wsd as f64;
                    match c.lr_wsd_decay_style.expect("validated") {
                        WsdDecayStyle::Linear => 1.0 - r,
                        WsdDecayStyle::Cosine => 0.5 * ((PI * r).cos() + 1.0),
                        WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
                        WsdDecayStyle::MinusSqrt => 1.0 - r.sqrt(),
                    }
                }
            }
            LrDecayStyle::Constant | LrDecayStyle::InverseSquareRoot => {
                unreachable!("returned above")
            }
        };
        min_lr + coeff * (max_lr - min_lr)
    }

    /// Weight decay at `step`.
    pub fn wd_at(&self, step: usize) -> f64 {
        let c = &self.config;
        if step > c.wd_incr_steps {
            return c.end_wd;
        }
        let ratio = step as f64 / c.wd_incr_steps.max(1) as f64;
        let coeff = match c.wd_incr_style {
            WdIncrStyle::Constant => return c.end_wd,
            WdIncrStyle::Linear => ratio,
            WdIncrStyle::Cosine => 0.5 * ((PI * (1.0 - ratio)).cos() + 1.0),
        };
        c.start_wd + coeff * (c.end_wd - c.start_wd)
    }

    /// Weight decay at `step` for a group with a `wd_mult`.
    pub fn group_wd_at(&self, step: usize, group: &ParamGroupSchedule) -> f64 {
        self.wd_at(step) * group.wd_mult.unwrap_or(1.0)
    }

    /// Advances by `increment` steps (Megatron's `step(increment)`); returns the new
    /// (learning rate, weight decay).
    pub fn advance(&mut self, increment: usize) -> (f64, f64) {
        self.num_steps += increment;
        (self.lr_at(self.num_steps), self.wd_at(self.num_steps))
    }
}

/// Burn's contract: `step` returns the learning rate to use for the coming iteration and
/// advances. Iteration `i` (from 0) thus trains with `lr_at(i)`, as in Megatron, whose
/// scheduler is built at step 0 and stepped after each iteration.
impl LrScheduler for OptimizerParamScheduler {
    fn step(&mut self) -> LearningRate {
        let lr = self.lr_at(self.num_steps);
        self.num_steps += 1;
        lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar("num_steps", self.num_steps as u64)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(n) = record.scalar::<u64>("num_steps") {
            self.num_steps = n as usize;
        }
    }
}
