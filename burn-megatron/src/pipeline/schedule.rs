//! Pipeline schedules as pure arithmetic: which microbatch and model chunk each rank runs
//! forward or backward, in which order. No model, no communication.
//!
//! One mechanism covers Megatron-Core's three schedules:
//! - **no pipelining** (P = 1): forward and backward of each microbatch in turn;
//! - **1F1B** (V = 1): `min(P − r − 1, M)` warmup forwards, then one forward and one
//!   backward alternately, then the remaining backwards;
//! - **interleaved 1F1B** (V > 1): the same three phases over the `M·V` virtual microbatches
//!   of [`schedule_table`], with `(P − r − 1)·2 + (V − 1)·G` warmup forwards.
//!
//! ```
//! use burn_megatron::pipeline::{PipelineOp, PipelineSchedule};
//!
//! // Two stages, four microbatches: stage 0 warms up with one forward.
//! let ops = PipelineSchedule::new(2, 4).ops(0).unwrap();
//! assert_eq!(&ops[..3], &[PipelineOp::forward(0, 0), PipelineOp::forward(1, 0), PipelineOp::backward(0, 0)]);
//! ```

use std::fmt;

/// The `(microbatch, model chunk)` of each virtual microbatch of the interleaved schedule,
/// Megatron-Core's `get_schedule_table`: for each group of `microbatch_group_size_per_vp_stage`
/// consecutive microbatches, for each chunk, the group's microbatches. The last group takes
/// whatever microbatches remain.
///
/// ```
/// use burn_megatron::pipeline::schedule_table;
/// assert_eq!(
///     schedule_table(4, 2, 2),
///     vec![(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
/// );
/// ```
pub fn schedule_table(
    num_microbatches: usize,
    num_model_chunks: usize,
    microbatch_group_size_per_vp_stage: usize,
) -> Vec<(usize, usize)> {
    let group = microbatch_group_size_per_vp_stage.max(1);
    let mut table = Vec::with_capacity(num_microbatches * num_model_chunks);
    let mut start = 0;
    while start < num_microbatches {
        let end = if start + group >= num_microbatches {
            num_microbatches
        } else {
            start + group
        };
        for chunk in 0..num_model_chunks {
            table.extend((start..end).map(|microbatch| (microbatch, chunk)));
        }
        start = end;
    }
    table
}

/// Forwards a rank runs before its first backward (Megatron-Core's warmup count).
///
/// Without interleaving (`num_model_chunks == 1`): `min(P − r − 1, M)`. Interleaved:
/// `(P − r − 1)·2 + (V − 1)·G`, capped at `M·V` (then every forward is warmup).
///
/// ```
/// use burn_megatron::pipeline::num_warmup_microbatches;
/// assert_eq!(num_warmup_microbatches(4, 0, 8, 1, 4), 3);
/// assert_eq!(num_warmup_microbatches(4, 0, 8, 2, 4), 10);
/// ```
pub fn num_warmup_microbatches(
    pipeline_size: usize,
    pipeline_rank: usize,
    num_microbatches: usize,
    num_model_chunks: usize,
    microbatch_group_size_per_vp_stage: usize,
) -> usize {
    let later_stages = pipeline_size.saturating_sub(pipeline_rank + 1);
    if num_model_chunks <= 1 {
        return later_stages.min(num_microbatches);
    }
    let warmup = later_stages * 2 + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage;
    warmup.min(num_microbatches * num_model_chunks)
}

/// Whether an op runs a model chunk forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
}

/// One step of a rank's schedule: run `chunk` forward or backward on `microbatch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PipelineOp {
    /// Forward or backward.
    pub pass: Pass,
    /// The microbatch, `0..M`.
    pub microbatch: usize,
    /// This rank's model chunk, `0..V`.
    pub chunk: usize,
}

impl PipelineOp {
    /// A forward of `chunk` on `microbatch`.
    pub fn forward(microbatch: usize, chunk: usize) -> Self {
        Self {
            pass: Pass::Forward,
            microbatch,
            chunk,
        }
    }

    /// A backward of `chunk` on `microbatch`.
    pub fn backward(microbatch: usize, chunk: usize) -> Self {
        Self {
            pass: Pass::Backward,
            microbatch,
            chunk,
        }
    }
}

impl fmt::Display for PipelineOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = match self.pass {
            Pass::Forward => 'F',
            Pass::Backward => 'B',
        };
        write!(f, "{p}{}.{}", self.microbatch, self.chunk)
    }
}

/// Which of Megatron-Core's schedules a [`PipelineSchedule`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// One stage: `forward_backward_no_pipelining`.
    NoPipelining,
    /// `forward_backward_pipelining_without_interleaving` (1F1B).
    OneFOneB,
    /// `forward_backward_pipelining_with_interleaving`.
    Interleaved,
}

/// A combination of pipeline settings that no schedule can run; every variant names the
/// numbers involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A size that must be positive is zero.
    #[error("{what} must be at least 1, got 0")]
    Zero {
        /// Which size.
        what: &'static str,
    },
    /// Model chunks per stage (virtual pipeline) without pipeline parallelism.
    #[error(
        "a virtual pipeline of {num_model_chunks} model chunks per stage needs pipeline parallelism (P > 1), got P = {pipeline_size}"
    )]
    VirtualWithoutPipeline {
        /// V.
        num_model_chunks: usize,
        /// P.
        pipeline_size: usize,
    },
    /// The interleaved schedule's group size is outside `[P, M]`.
    #[error(
        "the microbatch group size per virtual pipeline stage must lie in [P, M] = [{pipeline_size}, {num_microbatches}], got {group_size}"
    )]
    GroupSizeOutOfRange {
        /// G.
        group_size: usize,
        /// P.
        pipeline_size: usize,
        /// M.
        num_microbatches: usize,
    },
    /// The last microbatch group is non-empty but smaller than P: a dependency bubble.
    #[error(
        "M = {num_microbatches} microbatches are not divisible by the microbatch group size G = {group_size}, and the remainder {remainder} is below the pipeline size P = {pipeline_size} (M % G must be 0 or at least P)"
    )]
    FinalGroupTooSmall {
        /// M.
        num_microbatches: usize,
        /// G.
        group_size: usize,
        /// M % G.
        remainder: usize,
        /// P.
        pipeline_size: usize,
    },
    /// A pipeline rank outside `0..P`.
    #[error("pipeline rank {rank} is outside 0..{pipeline_size}")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// P.
        pipeline_size: usize,
    },
}

/// The settings of one `forward_backward_func` call: P stages, M microbatches, V model chunks
/// per stage, G microbatches per group of the interleaved table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineSchedule {
    /// P.
    pub pipeline_size: usize,
    /// M.
    pub num_microbatches: usize,
    /// V (1: no interleaving).
    pub num_model_chunks: usize,
    /// G (Megatron's `microbatch_group_size_per_vp_stage`, default P).
    pub microbatch_group_size_per_vp_stage: usize,
    /// Forwards only (evaluation): no backward, no warmup limit. Run it on `valid()` copies
    /// of the chunks, with inputs and the p2p's device without autodiff: on an autodiff
    /// device every forward builds Burn's graph, and Burn frees a graph that no backward
    /// consumed only in a later backward, so each microbatch's activations would stay until
    /// the next training step (Megatron evaluates under `torch.no_grad()`).
    pub forward_only: bool,
    /// GPipe's order instead of 1F1B: every forward, then every backward. For comparison
    /// only: all `M·V` microbatches hold their activations at once.
    pub all_forward_first: bool,
}

impl PipelineSchedule {
    /// `pipeline_size` stages over `num_microbatches` microbatches, one chunk per stage.
    pub fn new(pipeline_size: usize, num_microbatches: usize) -> Self {
        Self {
            pipeline_size,
            num_microbatches,
            num_model_chunks: 1,
            microbatch_group_size_per_vp_stage: pipeline_size,
            forward_only: false,
            all_forward_first: false,
        }
    }

    /// `num_model_chunks` chunks per stage (the interleaved schedule when above 1).
    #[must_use]
    pub fn with_model_chunks(mut self, num_model_chunks: usize) -> Self {
        self.num_model_chunks = num_model_chunks;
        self
    }

    /// The interleaved table's group size G (`None`: P, Megatron's default).
    #[must_use]
    pub fn with_microbatch_group_size(mut self, group_size: Option<usize>) -> Self {
        self.microbatch_group_size_per_vp_stage = group_size.unwrap_or(self.pipeline_size);
        self
    }

    /// Forwards only (see [`forward_only`](Self::forward_only) for the device to run on).
    #[must_use]
    pub fn with_forward_only(mut self, forward_only: bool) -> Self {
        self.forward_only = forward_only;
        self
    }

    /// All forwards before any backward (GPipe), for comparison with 1F1B.
    #[must_use]
    pub fn with_all_forward_first(mut self, all_forward_first: bool) -> Self {
        self.all_forward_first = all_forward_first;
        self
    }

    /// The schedule these settings select.
    pub fn kind(&self) -> ScheduleKind {
        if self.pipeline_size == 1 {
            ScheduleKind::NoPipelining
        } else if self.num_model_chunks == 1 {
            ScheduleKind::OneFOneB
        } else {
            ScheduleKind::Interleaved
        }
    }

    /// Checks the combination before any work, as Megatron-Core does at the start of each
    /// schedule.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        let (p, m, v, g) = (
            self.pipeline_size,
            self.num_microbatches,
            self.num_model_chunks,
            self.microbatch_group_size_per_vp_stage,
        );
        for (size, what) in [
            (p, "the pipeline size P"),
            (m, "the number of microbatches M"),
            (v, "the number of model chunks per stage V"),
            (g, "the microbatch group size per virtual pipeline stage G"),
        ] {
            if size == 0 {
                return Err(ScheduleError::Zero { what });
            }
        }
        if v > 1 && p == 1 {
            return Err(ScheduleError::VirtualWithoutPipeline {
                num_model_chunks: v,
                pipeline_size: p,
            });
        }
        if self.kind() == ScheduleKind::Interleaved {
            if g < p || g > m {
                return Err(ScheduleError::GroupSizeOutOfRange {
                    group_size: g,
                    pipeline_size: p,
                    num_microbatches: m,
                });
            }
            let remainder = m % g;
            if remainder != 0 && remainder < p {
                return Err(ScheduleError::FinalGroupTooSmall {
                    num_microbatches: m,
                    group_size: g,
                    remainder,
                    pipeline_size: p,
                });
            }
        }
        Ok(())
    }

    /// Forwards pipeline rank `rank` runs before its first backward (all of them when
    /// forward-only or all-forward-first).
    pub fn num_warmup(&self, rank: usize) -> usize {
        if self.forward_only || self.all_forward_first {
            return self.num_microbatches * self.num_model_chunks;
        }
        num_warmup_microbatches(
            self.pipeline_size,
            rank,
            self.num_microbatches,
            self.num_model_chunks,
            self.microbatch_group_size_per_vp_stage,
        )
    }

    /// The ops of pipeline rank `rank`, in order: warmup forwards, then alternately one
    /// forward and one backward, then the remaining backwards. Virtual microbatch `i` runs
    /// forward on `schedule_table[i]` and backward on the same microbatch with chunk
    /// `V − 1 − chunk` (gradients flow from the last virtual stage back).
    pub fn ops(&self, rank: usize) -> Result<Vec<PipelineOp>, ScheduleError> {
        self.validate()?;
        if rank >= self.pipeline_size {
            return Err(ScheduleError::RankOutOfRange {
                rank,
                pipeline_size: self.pipeline_size,
            });
        }
        let v = self.num_model_chunks;
        let table = schedule_table(
            self.num_microbatches,
            v,
            self.microbatch_group_size_per_vp_stage,
        );
        let forward = |i: usize| PipelineOp::forward(table[i].0, table[i].1);
        let backward = |i: usize| PipelineOp::backward(table[i].0, v - 1 - table[i].1);
        let total = table.len();
        let warmup = self.num_warmup(rank);
        let mut ops: Vec<PipelineOp> = (0..warmup).map(forward).collect();
        for i in 0..total - warmup {
            ops.push(forward(warmup + i));
            ops.push(backward(i));
        }
        if !self.forward_only {
            ops.extend((total - warmup..total).map(backward));
        }
        Ok(ops)
    }
}

/// The position of `(pipeline_rank, chunk)` in the chain of `P·V` virtual stages: chunk `v`
/// of rank `r` is stage `v·P + r`, so activations go round the ring of ranks V times.
pub fn virtual_stage(pipeline_size: usize, pipeline_rank: usize, chunk: usize) -> usize {
    chunk * pipeline_size + pipeline_rank
}
