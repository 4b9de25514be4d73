//! `forward_backward_func`: runs one rank's ops of a [`PipelineSchedule`] over its model
//! chunks, whatever the model.

use super::deallocate::{GradSlot, stand_in};
use super::p2p::P2pCommunicator;
use super::schedule::{Pass, PipelineOp, PipelineSchedule, ScheduleError, virtual_stage};
use super::timeline::{Recorder, Span, SpanKind};
use crate::comm::CommError;
use crate::grad_hooks::GradSync;
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::device::ReadBack;
use std::collections::HashMap;
use std::time::Instant;

/// The error a user's forward step may return.
pub type StageError = Box<dyn std::error::Error + Send + Sync>;

/// Why [`forward_backward_func`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The schedule's settings are invalid (checked before any work).
    #[error("invalid pipeline schedule: {0}")]
    Schedule(#[from] ScheduleError),
    /// The call's arguments disagree with each other (checked before any work), or a
    /// forward step returned the wrong kind of output for its stage.
    #[error("{0}")]
    Invalid(String),
    /// Sending or receiving failed (a peer failed, timed out or sent something else).
    #[error("pipeline communication failed: {0}")]
    Comm(#[from] CommError),
    /// The user's forward step failed.
    #[error("forward step of microbatch {} on model chunk {} failed: {source}", op.microbatch, op.chunk)]
    Stage {
        /// The op that failed.
        op: PipelineOp,
        /// The forward step's error.
        source: StageError,
    },
}

/// What one forward step of one model chunk produced.
#[derive(Debug)]
pub enum ChunkOutput<const D: usize> {
    /// The activation to send to the next stage (every virtual stage but the last).
    Activation(Tensor<D>),
    /// The last virtual stage's loss (a one-element tensor), averaged over the microbatch,
    /// and any values to hand back with it (e.g. the parts of a composite loss).
    Loss {
        /// The microbatch's loss.
        loss: Tensor<1>,
        /// Values reported back per microbatch, kept on the device like the loss (detached
        /// by the executor): [`read_losses`] reads them.
        report: Vec<Tensor<1>>,
    },
}

impl<const D: usize> ChunkOutput<D> {
    /// Whether the output is part of Burn's graph.
    fn is_tracked(&self) -> bool {
        match self {
            Self::Activation(a) => a.is_tracked(),
            Self::Loss { loss, .. } => loss.is_tracked(),
        }
    }
}

/// What a forward step is given.
#[derive(Debug)]
pub struct ForwardStep<'a, M, const D: usize> {
    /// The model chunk to run.
    pub model: &'a M,
    /// Which chunk of this rank it is (`0..V`).
    pub chunk: usize,
    /// The microbatch (`0..M`); the step loads its data.
    pub microbatch: usize,
    /// The previous stage's activation (a tracked leaf when training), `None` on the first
    /// virtual stage.
    pub input: Option<Tensor<D>>,
}

/// How [`forward_backward_func`] runs.
#[derive(Clone, Copy)]
pub struct ForwardBackwardConfig<'a> {
    /// P, M, V, G and forward-only.
    pub schedule: PipelineSchedule,
    /// Backward runs on `loss · grad_scale / M` (the loss scale of mixed precision; 1 by
    /// default).
    pub grad_scale: f64,
    /// One [`GradSync`] per model chunk (e.g. an overlapped data-parallel reducer each).
    /// With several chunks, give each reducer its own data-parallel communicator
    /// (`RankContext::chunk_data_parallel_groups`): their workers run at the same time.
    pub grad_sync: Option<&'a [&'a dyn GradSync]>,
    /// Record the timeline against this common start (`None`: no timeline).
    pub timeline: Option<Instant>,
}

impl std::fmt::Debug for ForwardBackwardConfig<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardBackwardConfig")
            .field("schedule", &self.schedule)
            .field("grad_scale", &self.grad_scale)
            .field("grad_sync", &self.grad_sync.map(<[_]>::len))
            .field("timeline", &self.timeline)
            .finish()
    }
}

impl ForwardBackwardConfig<'_> {
    /// Refuses a schedule that does not fit the pipeline group or the chunks, hooks that
    /// are not one per chunk, and a gradient scale that is not finite and positive.
    fn check(&self, p2p: &P2pCommunicator, chunks: usize) -> Result<(), PipelineError> {
        let (schedule, p) = (self.schedule, p2p.group().size());
        let v = schedule.num_model_chunks;
        if schedule.pipeline_size != p {
            return Err(PipelineError::Invalid(format!(
                "the schedule is for P = {} stages but the pipeline group {} has {p}",
                schedule.pipeline_size,
                p2p.group()
            )));
        }
        if chunks != v {
            return Err(PipelineError::Invalid(format!(
                "the schedule has V = {v} model chunks per stage but {chunks} chunks were given"
            )));
        }
        if let Some(r) = self.grad_sync.filter(|r| r.len() != v) {
            return Err(PipelineError::Invalid(format!(
                "{} grad_sync hooks for {v} model chunks (one per chunk)",
                r.len()
            )));
        }
        if !self.grad_scale.is_finite() || self.grad_scale <= 0.0 {
            return Err(PipelineError::Invalid(format!(
                "grad_scale must be finite and positive, got {}",
                self.grad_scale
            )));
        }
        Ok(())
    }

    /// Runs `schedule` with no loss scale, no overlap and no timeline.
    pub fn new(schedule: PipelineSchedule) -> Self {
        Self {
            schedule,
            grad_scale: 1.0,
            grad_sync: None,
            timeline: None,
        }
    }
}

/// A last-stage microbatch's loss and its reported values, still on the device.
///
/// The executor reads nothing back: on a GPU a read waits for every kernel queued before
/// it, so Megatron keeps its losses on the device until the log interval. Read them with
/// [`read_losses`] (one read for every microbatch), or sum them on
/// the device over several steps first.
#[derive(Debug, Clone)]
pub struct MicrobatchLoss {
    /// The microbatch.
    pub microbatch: usize,
    /// Its loss (before the division by M and the grad scale): one f32 element, detached.
    pub loss: Tensor<1>,
    /// What the forward step reported with it, detached.
    pub report: Vec<Tensor<1>>,
}

/// A microbatch's loss and reported values, read to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct MicrobatchLossValues {
    /// The microbatch.
    pub microbatch: usize,
    /// Its loss (before the division by M and the grad scale).
    pub loss: f64,
    /// The values of its report tensors, concatenated in order.
    pub report: Vec<f64>,
}

/// What [`forward_backward_func`] returns.
#[derive(Debug)]
pub struct ForwardBackwardOutput {
    /// On the rank holding the last virtual stage, each microbatch's loss in microbatch order
    /// (on the device); empty elsewhere.
    pub losses: Vec<MicrobatchLoss>,
    /// Every chunk's gradients summed over the microbatches (empty when forward-only).
    pub grads: GradientsParams,
    /// The most microbatches that held activations at once.
    pub peak_live_microbatches: usize,
    /// The timeline, when asked for.
    pub spans: Vec<Span>,
}

/// Every microbatch's loss and report in `losses` (a [`ForwardBackwardOutput`]'s, or several
/// steps' gathered on the device), read to the host in one read (one device synchronisation);
/// empty off the last stage.
pub fn read_losses(losses: &[MicrobatchLoss]) -> Vec<MicrobatchLossValues> {
    let parts: Vec<Tensor<1>> = losses
        .iter()
        .flat_map(|l| std::iter::once(&l.loss).chain(&l.report))
        .filter(|t| t.dims()[0] > 0)
        .map(|t| t.clone().cast(DType::F32))
        .collect();
    if parts.is_empty() {
        return Vec::new();
    }
    let values: Vec<f64> = Tensor::cat(parts, 0)
        .read_back()
        .iter::<f32>()
        .map(f64::from)
        .collect();
    let mut rest = values.as_slice();
    let mut take = |n: usize| {
        let (head, tail) = rest.split_at(n.min(rest.len()));
        rest = tail;
        head.to_vec()
    };
    losses
        .iter()
        .map(|l| MicrobatchLossValues {
            microbatch: l.microbatch,
            loss: take(l.loss.dims()[0]).first().copied().unwrap_or(f64::NAN),
            report: l.report.iter().flat_map(|r| take(r.dims()[0])).collect(),
        })
        .collect()
}

/// What a microbatch's forward left for its backward to start from.
enum Output {
    /// The activation sent to the next stage, as a one-element stand-in (Megatron's
    /// `deallocate_output_tensor`: its values are not kept); backward starts from the
    /// gradient the next stage returns, put in the slot.
    Sent(Tensor<1>, GradSlot),
    /// The last virtual stage's loss, already scaled by `grad_scale / M`.
    Loss(Tensor<1>),
}

struct Live<const D: usize> {
    input: Option<Tensor<D>>,
    output: Output,
}

/// Megatron's `forward_backward_func`: runs this rank's ops of `config.schedule` on `chunks`
/// (this rank's model chunks, chunk `v` being virtual stage `v·P + pp_rank`), passing
/// activations and gradients to its neighbours through `p2p`.
///
/// `forward_step` runs one chunk on one microbatch: on the first virtual stage it has no
/// input and embeds the microbatch; on the last it returns the loss. Gradients of each
/// microbatch are summed into one [`GradientsParams`] for all chunks; then reduce them over
/// data-parallel ranks (`finalize_model_grads`) and step the optimizer, as without pipelines.
/// A microbatch's graph is dropped as soon as its backward ran.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::comm::LocalWorld;
/// use burn_megatron::pipeline::*;
/// use std::sync::Arc;
///
/// // One stage: no pipelining, two microbatches.
/// let device = Device::flex().autodiff();
/// let world = LocalWorld::new(1);
/// let comm = |name: &str| Arc::new(world.communicator(name, vec![0], 0).unwrap());
/// let p2p = P2pCommunicator::new(comm("pp"), comm("pp-backward"), P2pShapes::Variable, device.clone());
/// // No bias: microbatch m's loss is ((m + 1)·Σw)², larger for the second whatever the
/// // random init (with a bias it was not, now and then).
/// let chunks = vec![LinearConfig::new(3, 1).with_bias(false).init(&device)];
/// let out = forward_backward_func(
///     |step: ForwardStep<'_, Linear, 2>| {
///         let x = Tensor::<2>::ones([4, 3], &device) * (step.microbatch as f32 + 1.0);
///         let loss = step.model.forward(x).powi_scalar(2).mean().reshape([1]);
///         Ok(ChunkOutput::Loss { loss, report: vec![] })
///     },
///     &chunks,
///     &p2p,
///     ForwardBackwardConfig::new(PipelineSchedule::new(1, 2)),
/// )
/// .unwrap();
/// // The losses stay on the device until read, both at once.
/// let losses = read_losses(&out.losses);
/// assert_eq!(losses.len(), 2);
/// assert!(losses[1].loss > losses[0].loss);
/// assert!(out.grads.get::<2>(chunks[0].weight.id).is_some());
/// ```
pub fn forward_backward_func<M, F, const D: usize>(
    mut forward_step: F,
    chunks: &[M],
    p2p: &P2pCommunicator,
    config: ForwardBackwardConfig<'_>,
) -> Result<ForwardBackwardOutput, PipelineError>
where
    M: Module,
    F: FnMut(ForwardStep<'_, M, D>) -> Result<ChunkOutput<D>, StageError>,
{
    let schedule = config.schedule;
    let (p, rank) = (p2p.group().size(), p2p.group().rank());
    let v = schedule.num_model_chunks;
    let m = schedule.num_microbatches;
    config.check(p2p, chunks.len())?;
    let ops = schedule.ops(rank)?;
    p2p.connect()?;
    // Auxiliary losses (MoE load balancing) inside the chunks are scaled as each
    // micro-batch's loss is, through the recomputed forwards of backward too.
    let _aux_scale = crate::aux_loss::scale_aux_losses((config.grad_scale / m as f64) as f32);
    let stages = p * v;
    let train = !schedule.forward_only;
    let mut recorder = Recorder::new(config.timeline);
    let mut live: HashMap<(usize, usize), Live<D>> = HashMap::new();
    let mut peak = 0;
    let mut forwards_done = vec![0usize; v];
    let mut losses = Vec::new();
    let mut acc = GradientsAccumulator::<M>::new();
    let mut warned_tracked = false;

    // No message names its microbatch or chunk: every rank walks the same schedule table,
    // so the n-th activation (or gradient) a rank receives on a channel is the one the n-th
    // matching op of its neighbour sent. Both channels are FIFO per pair of ranks.
    for op in ops {
        let vs = virtual_stage(p, rank, op.chunk);
        let (first, last) = (vs == 0, vs + 1 == stages);
        // The chunk's reduction may start once its last forward has run.
        let reducer_last = forwards_done[op.chunk] + usize::from(op.pass == Pass::Forward) == m;
        let _active = config
            .grad_sync
            .filter(|_| train)
            .map(|r| r[op.chunk].enter(reducer_last));
        match op.pass {
            Pass::Forward => {
                let input = (!first)
                    .then(|| recorder.time(SpanKind::Recv, op, || p2p.recv_forward::<D>(train)))
                    .transpose()?;
                let step = ForwardStep {
                    model: &chunks[op.chunk],
                    chunk: op.chunk,
                    microbatch: op.microbatch,
                    input: input.clone(),
                };
                let out = recorder
                    .time(SpanKind::Forward, op, || forward_step(step))
                    .map_err(|source| PipelineError::Stage { op, source })?;
                forwards_done[op.chunk] += 1;
                if !train && !warned_tracked && out.is_tracked() {
                    warned_tracked = true;
                    warn_tracked_forward_only();
                }
                let output = match (out, last) {
                    (ChunkOutput::Loss { loss, report }, true) => {
                        losses.push(microbatch_loss(op, &loss, report)?);
                        Output::Loss(loss * (config.grad_scale / m as f64))
                    }
                    (ChunkOutput::Activation(a), false) => {
                        recorder.time(SpanKind::Send, op, || p2p.send_forward(a.clone()))?;
                        let (stub, slot) = stand_in(a);
                        Output::Sent(stub, slot)
                    }
                    (out, _) => return Err(misplaced(op, &out, rank, vs, stages)),
                };
                if train {
                    live.insert((op.microbatch, op.chunk), Live { input, output });
                    peak = peak.max(live.len());
                } else {
                    peak = peak.max(1);
                }
            }
            Pass::Backward => {
                let Live { input, output } = live
                    .remove(&(op.microbatch, op.chunk))
                    .expect("a valid schedule runs each backward after its forward");
                // The root of this backward: the loss, or the sent output's stand-in, whose
                // backward gives the output the received gradient.
                let root = match output {
                    Output::Loss(loss) => loss,
                    Output::Sent(stub, slot) => {
                        let g = recorder.time(SpanKind::Recv, op, || p2p.recv_backward::<D>())?;
                        slot.put(g.inner());
                        stub.sum()
                    }
                };
                let (grads, input_grad) = recorder.time(SpanKind::Backward, op, || {
                    let grads = root.backward();
                    let input_grad = input.as_ref().and_then(|x| x.grad(&grads));
                    (
                        GradientsParams::from_grads(grads, &chunks[op.chunk]),
                        input_grad,
                    )
                });
                acc.accumulate(&chunks[op.chunk], grads);
                // Every stage but the first has an input; a chunk that ignored it sends zeros.
                if let Some(x) = input {
                    let g = input_grad.unwrap_or_else(|| x.inner().zeros_like());
                    recorder.time(SpanKind::Send, op, || p2p.send_backward(g))?;
                }
            }
        }
    }
    Ok(ForwardBackwardOutput {
        losses: {
            losses.sort_by_key(|l| l.microbatch);
            losses
        },
        grads: acc.grads(),
        peak_live_microbatches: peak,
        spans: recorder.spans,
    })
}

/// The last stage's loss of microbatch `op`, kept (detached, f32) for the report.
fn microbatch_loss(
    op: PipelineOp,
    loss: &Tensor<1>,
    report: Vec<Tensor<1>>,
) -> Result<MicrobatchLoss, PipelineError> {
    if loss.dims()[0] != 1 {
        return Err(PipelineError::Invalid(format!(
            "{op}: the loss must have one element, got dims {:?}",
            loss.dims()
        )));
    }
    Ok(MicrobatchLoss {
        microbatch: op.microbatch,
        loss: loss.clone().detach().cast(DType::F32),
        report: report.into_iter().map(Tensor::detach).collect(),
    })
}

/// A forward step that returned a loss where an activation was due, or the other way round.
fn misplaced<const D: usize>(
    op: PipelineOp,
    out: &ChunkOutput<D>,
    rank: usize,
    vs: usize,
    stages: usize,
) -> PipelineError {
    PipelineError::Invalid(match out {
        ChunkOutput::Loss { .. } => format!(
            "{op}: chunk {} of pipeline rank {rank} is virtual stage {vs} of {stages}, not the \
             last, but its forward step returned a loss",
            op.chunk
        ),
        ChunkOutput::Activation(_) => format!(
            "{op}: chunk {} of pipeline rank {rank} is the last virtual stage, but its forward \
             step returned an activation instead of the loss",
            op.chunk
        ),
    })
}

fn warn_tracked_forward_only() {
    tracing::warn!(
        "forward_backward_func: a forward-only schedule on tracked chunks builds Burn's graph, \
         which Burn frees only in a later backward, so each microbatch's activations stay \
         until then; evaluate on `valid()` copies of the chunks, with inputs on \
         `device.without_autodiff()`"
    );
}
