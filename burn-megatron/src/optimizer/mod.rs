//! Optimizer-side pieces of Megatron training. So far: the learning-rate / weight-decay
//! scheduler ([`OptimizerParamScheduler`]).

mod scheduler;

#[cfg(test)]
mod tests;

pub use scheduler::{
    LrDecayStyle, OptimizerParamScheduler, OptimizerParamSchedulerConfig, ParamGroupSchedule,
    WdIncrStyle, WsdDecayStyle,
};
