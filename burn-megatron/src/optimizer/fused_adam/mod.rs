//! Fused Adam / AdamW over flat FP32 buffers, one per parameter group: the optimizer behind
//! [`MegatronOptimizer::new`](super::MegatronOptimizer::new).
//!
//! Every trainable parameter is a segment of its group's flat master buffer (f32, as
//! Megatron's distributed optimizer keeps `main_param` buffers). A step gathers the
//! gradients into one flat buffer per group, reads the per-parameter sums of squares back
//! once (overflow check and global norm from the same numbers), and then runs one fused
//! kernel per group: unscale × clip, moments, update. The model's weights are the master
//! segments rounded to the model's dtype in one pass per group.

mod config;
mod flat;
mod mappers;
mod modules;
mod sharded;

pub use config::{FusedAdam, FusedAdamConfig};
pub(crate) use flat::{Buffer, FlatAdam, Place, Sharding};
pub(crate) use mappers::Replace;
pub(crate) use sharded::{check_covers_experts, gather_pieces};
