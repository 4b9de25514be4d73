//! Optimizer-side pieces of Megatron training. So far: the learning-rate / weight-decay
//! scheduler ([`OptimizerParamScheduler`]) and the loss scalers ([`DynamicGradScaler`],
//! [`ConstantGradScaler`]), and the global gradient norm with tensor-parallel
//! de-duplication ([`global_grad_norm`], [`clip_grads_by_total_norm`]), and
//! [`MegatronOptimizer`] around burn-optim optimizers or the fused flat-buffer Adam
//! ([`FusedAdamConfig`]).
//!
//! The distributed optimizer (ZeRO-1, `--use-distributed-optimizer`) is
//! [`MegatronOptimizer::distributed`]: this rank's pieces of each bucket, which
//! `data_parallel`'s shard plan (`shard_plan.rs`) assigns and its reduce-scatter
//! (`reduce_scatter.rs`) fills, are stepped by `fused_adam/sharded.rs` (the fused Adam) or
//! `sharded_burn.rs` (a burn-optim optimizer, its pieces as 1-D parameters), and the
//! updated weights all-gathered.

mod cast;
mod error;
mod fused_adam;
mod grad_norm;
mod grad_scaler;
mod megatron;
mod param_groups;
mod scheduler;
mod sharded_burn;

#[cfg(test)]
mod tests;

pub use cast::cast_params;
pub use error::OptimizerError;
pub(crate) use fused_adam::Buffer;
pub use fused_adam::{FusedAdam, FusedAdamConfig};
pub use grad_norm::{NormType, clip_grads_by_total_norm, global_grad_norm};
pub use grad_scaler::{ConstantGradScaler, DynamicGradScaler, GradScaler, GradScalerState};
pub use megatron::{InnerOptimizer, MegatronOptimizer, StepReport};
pub use param_groups::{LrMultScheduler, megatron_param_groups, one_dimensional_params};
pub use scheduler::{
    LrDecayStyle, OptimizerParamScheduler, OptimizerParamSchedulerConfig, ParamGroupSchedule,
    WdIncrStyle, WsdDecayStyle,
};
