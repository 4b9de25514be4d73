//! Pipeline parallelism: the model's layers split into stages on different ranks,
//! microbatches flowing through them.
//!
//! - schedules: pure arithmetic — [`schedule_table`], [`num_warmup_microbatches`] and
//!   each rank's [`PipelineOp`] order for no pipelining, 1F1B and interleaved 1F1B
//!   ([`PipelineSchedule`]), validated before any work.
//! - p2p: activations to the next stage, gradients to the previous one
//!   ([`P2pCommunicator`]), with Megatron's shape exchange for variable sequence lengths.
//! - [`forward_backward_func`]: runs a schedule over this rank's model chunks, any model:
//!   a closure runs one chunk on one microbatch.
//! - the timeline: forward / backward / send / receive spans as a Chrome trace.
//!
//! A rank builds only its own chunks. With V chunks per stage (interleaving), chunk `v` of
//! pipeline rank `r` is virtual stage `v·P + r` and holds the layers
//! [`PipelinePosition::layer_range`](crate::topology::PipelinePosition::layer_range) gives
//! (`L/(P·V)` of them, unless the layout's [`LayerSplit`](crate::topology::LayerSplit) splits
//! them unevenly); the first virtual stage embeds, the last computes the loss.

mod deallocate;
mod executor;
mod p2p;
mod schedule;
mod timeline;

#[cfg(test)]
mod tests;

pub use crate::grad_hooks::GradSync;
pub use executor::{
    ChunkOutput, ForwardBackwardConfig, ForwardBackwardOutput, ForwardStep, MicrobatchLoss,
    MicrobatchLossValues, PipelineError, StageError, forward_backward_func, read_losses,
};
pub use p2p::{P2pCommunicator, P2pShapes};
pub use schedule::{
    Pass, PipelineOp, PipelineSchedule, ScheduleError, ScheduleKind, num_warmup_microbatches,
    schedule_table, virtual_stage,
};
pub use timeline::{Span, SpanKind, chrome_trace, idle_fractions, time_bounds};
