//! Optimizer-side pieces of Megatron training. So far: the learning-rate / weight-decay
//! scheduler ([`OptimizerParamScheduler`]) and the loss scalers ([`DynamicGradScaler`],
//! [`ConstantGradScaler`]).

mod grad_scaler;
mod scheduler;

#[cfg(test)]
mod tests;

pub use grad_scaler::{ConstantGradScaler, DynamicGradScaler, GradScaler, GradScalerState};
pub use scheduler::{
    LrDecayStyle, OptimizerParamScheduler, OptimizerParamSchedulerConfig, ParamGroupSchedule,
    WdIncrStyle, WsdDecayStyle,
};
