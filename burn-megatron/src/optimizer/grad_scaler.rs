//! Loss scalers for f16 training (Megatron's `ConstantGradScaler` / `DynamicGradScaler`).

/// A loss scale that reacts to overflowing gradients.
pub trait GradScaler: Send + std::fmt::Debug {
    /// The current loss scale.
    fn scale(&self) -> f64;
    /// `1 / scale`, applied to the gradients before the step.
    fn inv_scale(&self) -> f64 {
        1.0 / self.scale()
    }
    /// Records whether this step's gradients held an inf or NaN.
    fn update(&mut self, found_inf: bool);
    /// The state to checkpoint.
    fn state(&self) -> GradScalerState;
    /// Restores a checkpointed state.
    fn load_state(&mut self, state: GradScalerState);
}

/// A scaler's checkpointable state.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GradScalerState {
    /// The loss scale.
    pub scale: f64,
    /// Clean steps since the last growth or overflow.
    pub growth_tracker: usize,
    /// Overflows still tolerated before backing off.
    pub hysteresis_tracker: i64,
}

/// A fixed loss scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConstantGradScaler {
    scale: f64,
}

impl ConstantGradScaler {
    /// A scaler that always uses `scale`.
    pub fn new(scale: f64) -> Self {
        Self { scale }
    }
}

impl GradScaler for ConstantGradScaler {
    fn scale(&self) -> f64 {
        self.scale
    }
    fn update(&mut self, _found_inf: bool) {}
    fn state(&self) -> GradScalerState {
        GradScalerState {
            scale: self.scale,
            growth_tracker: 0,
            hysteresis_tracker: 0,
        }
    }
    fn load_state(&mut self, state: GradScalerState) {
        self.scale = state.scale;
    }
}

/// Megatron's dynamic loss scaler.
///
/// On an overflow the growth tracker resets and the hysteresis tracker decrements; once it
/// reaches 0 the scale is multiplied by `backoff_factor` (not below `min_scale`), on this and
/// every further overflow. A clean step does not reset hysteresis; `growth_interval` clean
/// steps in a row reset both trackers and multiply the scale by `growth_factor`.
///
/// ```
/// use burn_megatron::optimizer::{DynamicGradScaler, GradScaler};
/// let mut s = DynamicGradScaler::default();
/// assert_eq!(s.scale(), 2f64.powi(32));
/// s.update(true); // hysteresis 2 → 1: scale kept
/// s.update(true); // hysteresis 0: halved
/// assert_eq!(s.scale(), 2f64.powi(31));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicGradScaler {
    scale: f64,
    min_scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: usize,
    hysteresis: i64,
    growth_tracker: usize,
    hysteresis_tracker: i64,
}

impl Default for DynamicGradScaler {
    /// Megatron's defaults: initial 2^32, min 1, growth ×2 every 1000 clean steps, backoff
    /// ×0.5, hysteresis 2.
    fn default() -> Self {
        Self::new(2f64.powi(32), 1.0, 2.0, 0.5, 1000, 2).expect("valid defaults")
    }
}

impl DynamicGradScaler {
    /// A dynamic scaler; errors on a non-positive scale, a growth factor ≤ 1, a backoff
    /// factor outside (0, 1), a zero interval or zero hysteresis.
    pub fn new(
        initial_scale: f64,
        min_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: usize,
        hysteresis: usize,
    ) -> Result<Self, String> {
        if !(initial_scale > 0.0 && min_scale > 0.0 && min_scale <= initial_scale) {
            return Err(format!(
                "need 0 < min_scale ({min_scale}) <= initial_scale ({initial_scale})"
            ));
        }
        if growth_factor <= 1.0 || !(0.0..1.0).contains(&backoff_factor) || backoff_factor == 0.0 {
            return Err(format!(
                "need growth_factor ({growth_factor}) > 1 and 0 < backoff_factor ({backoff_factor}) < 1"
            ));
        }
        if growth_interval == 0 || hysteresis == 0 {
            return Err(format!(
                "growth_interval ({growth_interval}) and hysteresis ({hysteresis}) must be > 0"
            ));
        }
        Ok(Self {
            scale: initial_scale,
            min_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis: hysteresis as i64,
            growth_tracker: 0,
            hysteresis_tracker: hysteresis as i64,
        })
    }

    /// Clean steps since the last growth or overflow.
    pub fn growth_tracker(&self) -> usize {
        self.growth_tracker
    }

    /// Overflows still tolerated before backing off.
    pub fn hysteresis_tracker(&self) -> i64 {
        self.hysteresis_tracker
    }
}

impl GradScaler for DynamicGradScaler {
    fn scale(&self) -> f64 {
        self.scale
    }

    fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.growth_tracker = 0;
            self.hysteresis_tracker -= 1;
            if self.hysteresis_tracker <= 0 {
                self.scale = (self.scale * self.backoff_factor).max(self.min_scale);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.growth_tracker = 0;
                self.hysteresis_tracker = self.hysteresis;
                self.scale *= self.growth_factor;
            }
        }
    }

    fn state(&self) -> GradScalerState {
        GradScalerState {
            scale: self.scale,
            growth_tracker: self.growth_tracker,
            hysteresis_tracker: self.hysteresis_tracker,
        }
    }

    fn load_state(&mut self, state: GradScalerState) {
        self.scale = state.scale;
        self.growth_tracker = state.growth_tracker;
        self.hysteresis_tracker = state.hysteresis_tracker;
    }
}

#[cfg(test)]
mod tests;
