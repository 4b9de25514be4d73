//! One rank's training loop: this stage's model chunks run the pipeline schedule over the
//! iteration's microbatches (gradient accumulation included), then the data-parallel,
//! sequence-parallel and tied-embedding gradient reductions, the Megatron optimizer step,
//! validation and checkpoints.

use super::setup::{RankSetup, setup_rank};
use super::{Eval, Family, IterationLog, MoeLog, Shared, Split};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_megatron::comm::{Buffer, CommunicatorExt, ReduceOp};
use burn_megatron::context_parallel::ContextParallel;
use burn_megatron::launch::RankContext;
use burn_megatron::optimizer::{MegatronOptimizer, OptimizerParamScheduler};
use burn_megatron::pipeline::{
    ForwardBackwardConfig, ForwardBackwardOutput, ForwardStep, GradSync, P2pCommunicator,
    P2pShapes, Span, forward_backward_func,
};
use burn_megatron::tensor_parallel::RngTracker;
use burn_megatron::training::ParallelTraining;
use burn_megatron_kernels::device::{ReadBack, thread_host_reads};
use std::time::Instant;

/// This rank's mean losses over its microbatches, `[lm]` or BERT's `[lm, sop]`, on last
/// stages: still on the device, read once per log interval as Megatron does.
pub(super) type Losses = Option<Tensor<1>>;

/// The losses every rank logs: lm, and sop for BERT.
pub(super) type SharedLosses = (f64, Option<f64>);

/// Runs the pipeline schedule over `chunks` on `split`'s microbatches of `iteration`:
/// backward when `rng` is given (training), forward only otherwise. A forward-only schedule
/// runs on the device without autodiff, so `chunks` must be `valid()` copies there. Returns
/// this rank's mean losses over the microbatches on the last stage (`None` elsewhere) with
/// the executor's output.
fn run_schedule<F: Family>(
    ctx: &RankContext,
    shared: &Shared<F>,
    chunks: &[F::Chunk],
    split: Split,
    iteration: usize,
    rng: Option<&RngTracker>,
    fb: ForwardBackwardConfig<'_>,
) -> Result<(Losses, ForwardBackwardOutput), String> {
    let dp_rank = ctx.state.data_parallel_rank();
    // Burn frees a graph no backward consumed only in a later backward: a forward-only pass
    // on the training device would keep every microbatch's activations until then (as
    // Megatron's evaluation runs under `torch.no_grad()`, this one runs without autodiff).
    let device = match fb.schedule.forward_only {
        true => ctx.device.clone().without_autodiff(),
        false => ctx.device.clone(),
    };
    let (pp, pp_backward) = (ctx.groups.pp.clone(), ctx.groups.pp_backward.clone());
    let p2p = P2pCommunicator::new(pp, pp_backward, P2pShapes::Variable, device.clone());
    let comm_type = match shared.args.cp_comm_type {
        super::CpCommType::AllGather => burn_megatron::context_parallel::CpCommType::AllGather,
        super::CpCommType::P2p => burn_megatron::context_parallel::CpCommType::P2p,
        super::CpCommType::A2a => burn_megatron::context_parallel::CpCommType::A2a,
    };
    // ANCHOR: context_parallel
    let cp = (ctx.state.context_parallel_size() > 1)
        .then(|| ContextParallel::new(ctx.groups.cp.clone(), shared.args.seq_length))
        .transpose()
        .map_err(|e| e.to_string())?
        .map(|cp| cp.with_comm_type(comm_type));
    // ANCHOR_END: context_parallel
    // ANCHOR: schedule
    let out = forward_backward_func(
        |s: ForwardStep<'_, F::Chunk, 3>| {
            let samples = shared.layout.micro_batch(iteration, dp_rank, s.microbatch);
            shared
                .family
                .forward_step(s, split, samples, rng, cp.as_ref(), &device)
        },
        chunks,
        &p2p,
        fb,
    )
    .map_err(|e| e.to_string())?;
    // ANCHOR_END: schedule
    // Each microbatch reports [lm] or [lm, sop]: their mean, summed on the device.
    let reports: Vec<Tensor<1>> = (out.losses.iter())
        .map(|l| Tensor::cat(l.report.clone(), 0).cast(DType::F32))
        .collect();
    let n = reports.len();
    let local = (n > 0).then(|| {
        let k = reports[0].dims()[0];
        Tensor::cat(reports, 0)
            .reshape([n, k])
            .mean_dim(0)
            .reshape([k])
    });
    Ok((local, out))
}

/// Several iterations' last-stage mean losses, read to the host at once (one device
/// synchronisation), averaged over data- and context-parallel ranks (a CP rank reports its
/// share × CP) and sent to every stage, so that every rank logs the same line. Every rank
/// calls it at the same iterations. Call it after the gradient reduction: an overlapped
/// reducer's worker uses the data-parallel communicator until it finishes.
pub(super) fn share_losses(
    ctx: &RankContext,
    pending: &[Losses],
    sop: bool,
) -> Result<Vec<SharedLosses>, String> {
    let mut v = vec![0.0f32; 2 * pending.len()];
    let local: Vec<Tensor<1>> = pending.iter().flatten().cloned().collect();
    if !local.is_empty() {
        if local.len() != pending.len() {
            return Err("a last stage lost an iteration's losses".into());
        }
        // [lm] or [lm, sop] per iteration, as pairs.
        let pairs: Vec<Tensor<1>> = (local.into_iter())
            .map(|l| match l.dims()[0] {
                1 => Tensor::cat(vec![l.clone(), l.zeros_like()], 0),
                _ => l.narrow(0, 0, 2),
            })
            .collect();
        v = Tensor::cat(pairs, 0).read_back().iter::<f32>().collect();
        ctx.groups
            .dp_cp
            .all_reduce_vec(&mut v, ReduceOp::Avg)
            .map_err(|e| e.to_string())?;
    }
    let mut buf = Buffer::F32(v);
    let last = ctx.state.pipeline_model_parallel_size() - 1;
    ctx.groups
        .pp
        .broadcast(&mut buf, last)
        .map_err(|e| e.to_string())?;
    let Buffer::F32(v) = buf else {
        unreachable!("an f32 broadcast stays f32")
    };
    Ok(v.chunks(2)
        .map(|p| (f64::from(p[0]), sop.then_some(f64::from(p[1]))))
        .collect())
}

/// The mean validation losses over the global batches `batches`.
pub(super) fn evaluate<F: Family>(
    ctx: &RankContext,
    shared: &Shared<F>,
    chunks: &[F::Chunk],
    batches: std::ops::Range<usize>,
) -> Result<(f64, Option<f64>), String> {
    let schedule = shared.args.schedule(&shared.layout).with_forward_only(true);
    let sop = shared.family.has_sop();
    let n = batches.len().max(1) as f64;
    let valid: Vec<F::Chunk> = chunks.iter().map(Module::valid).collect();
    let mut local = Vec::new();
    for k in batches {
        let fb = ForwardBackwardConfig::new(schedule);
        local.push(run_schedule(ctx, shared, &valid, Split::Valid, k, None, fb)?.0);
    }
    let shared_losses = share_losses(ctx, &local, sop)?;
    let sum = |f: fn(&SharedLosses) -> f64| shared_losses.iter().map(f).sum::<f64>() / n;
    Ok((sum(|l| l.0), sop.then(|| sum(|l| l.1.unwrap_or(0.0)))))
}

/// What a rank hands back.
#[derive(Debug, Clone)]
pub struct RankOutput {
    /// Its log (identical on every rank).
    pub log: Vec<IterationLog>,
    /// Validation losses.
    pub evals: Vec<Eval>,
    /// The last iteration's pipeline timeline, when asked for.
    pub spans: Vec<Span>,
    /// Its memory peak.
    pub peak: RankPeak,
    /// What [`Family::finish`] said (the samples).
    pub said: Vec<String>,
}

/// A rank's measured peak: (global rank, pipeline rank, bytes).
pub type RankPeak = (usize, usize, i64);

/// One training iteration's two halves, shared by this loop and burn-train's
/// (`learner`): the schedule's forward and backward with the gradient reductions, then
/// the optimizer step with its log line.
pub(super) struct Step<'a, F: Family> {
    pub ctx: &'a RankContext,
    pub shared: &'a Shared<F>,
    pub training: &'a ParallelTraining,
    pub hooks: Option<&'a [&'a dyn GradSync]>,
}

impl<F: Family> Step<'_, F> {
    /// The microbatches of `iteration` through the schedule, gradients reduced over DP
    /// (and SP, tied embeddings), and this rank's losses (on the device: [`share_losses`]
    /// reads them).
    #[allow(clippy::ptr_arg)] // `finalize` takes the model as the `Vec` it is
    pub fn forward_backward(
        &self,
        model: &Vec<F::Chunk>,
        optim: &MegatronOptimizer<Vec<F::Chunk>>,
        iteration: usize,
        timeline: Option<Instant>,
    ) -> Result<(GradientsParams, Losses, Vec<Span>), String> {
        let args = &self.shared.args;
        let tp_rank = self.ctx.state.tensor_model_parallel_rank();
        // Forwards since the last step (validation's) are not this iteration's.
        F::take_moe_stats(model);
        // Dropout masks are a function of (seed, iteration): nothing to checkpoint.
        // ANCHOR: forward_backward
        let rng = RngTracker::new(args.seed ^ ((iteration as u64 + 1) << 20), tp_rank);
        let mut fb = ForwardBackwardConfig::new(args.schedule(&self.shared.layout));
        fb.grad_scale = optim.loss_scale();
        fb.grad_sync = self.hooks;
        fb.timeline = timeline;
        let (losses, out) = run_schedule(
            self.ctx,
            self.shared,
            model,
            Split::Train,
            iteration,
            Some(&rng),
            fb,
        )?;
        let mut grads = out.grads;
        self.training
            .finalize(model, &mut grads)
            .map_err(|e| e.to_string())?;
        // ANCHOR_END: forward_backward
        Ok((grads, losses, out.spans))
    }

    /// The optimizer step of `iteration` at the schedule's learning rate and weight
    /// decay, and its log entry (its losses NaN until [`share_losses`] reads them).
    #[allow(clippy::too_many_arguments)]
    pub fn optimizer_step(
        &self,
        scheduler: &OptimizerParamScheduler,
        optim: &mut MegatronOptimizer<Vec<F::Chunk>>,
        model: Vec<F::Chunk>,
        grads: GradientsParams,
        iteration: usize,
        skipped: &mut usize,
        t0: Instant,
    ) -> Result<(Vec<F::Chunk>, IterationLog), String> {
        let args = &self.shared.args;
        let moe = self.moe_log(&model)?;
        // ANCHOR: optimizer_step
        let lr = scheduler.lr_at(iteration);
        optim
            .set_weight_decay(scheduler.wd_at(iteration))
            .map_err(|e| e.to_string())?;
        let (model, report) = optim.step(lr, model, grads).map_err(|e| e.to_string())?;
        // ANCHOR_END: optimizer_step
        *skipped += usize::from(!report.updated);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let tokens_per_iter = (args.global_batch_size * args.seq_length) as f64;
        let entry = IterationLog {
            iteration: iteration + 1,
            consumed_samples: (iteration + 1) * args.global_batch_size,
            lr,
            lm_loss: f64::NAN,
            sop_loss: None,
            grad_norm: report.grad_norm,
            loss_scale: report.loss_scale,
            skipped_iterations: *skipped,
            ms_per_iter: ms,
            tokens_per_s: tokens_per_iter / (ms / 1e3),
            moe,
        };
        Ok((model, entry))
    }

    /// What the MoE layers saw this iteration, over every layer, micro-batch and rank
    /// (collective over the world when the model has experts).
    fn moe_log(&self, model: &[F::Chunk]) -> Result<Option<MoeLog>, String> {
        let Some(moe) = self.shared.family.moe() else {
            return Ok(None);
        };
        let e = moe.num_experts;
        // Counts are already summed over the TP ranks that split the tokens; the loss is
        // each TP rank's part of it.
        let tp0 = self.ctx.state.tensor_model_parallel_rank() == 0;
        let (mut aux, mut counts) = (vec![0.0f32], vec![0i64; e + 1]);
        for s in F::take_moe_stats(model) {
            aux[0] += s.load_balancing_loss as f32;
            if tp0 {
                counts[0] += s.forwards as i64;
                for (c, &t) in counts[1..].iter_mut().zip(&s.tokens_per_expert) {
                    *c += t as i64;
                }
            }
        }
        let world = &self.ctx.groups.world;
        world
            .all_reduce_vec(&mut aux, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        world
            .all_reduce_vec(&mut counts, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let total = counts[1..].iter().sum::<i64>().max(1) as f64;
        Ok(Some(MoeLog {
            load_balancing_loss: (moe.moe_aux_loss_coeff > 0.0)
                .then(|| f64::from(aux[0]) / counts[0].max(1) as f64),
            expert_token_share: counts[1..].iter().map(|&c| c as f64 / total).collect(),
        }))
    }
}

/// Trains this rank's part of the model: its model chunks of its pipeline stage.
pub fn train_rank<F: Family>(ctx: RankContext, shared: &Shared<F>) -> Result<RankOutput, String> {
    let args = &shared.args;
    let leader = ctx.state.global_rank() == 0;
    let RankSetup {
        mut model,
        training,
        mut optim,
        scheduler,
        start,
        mut skipped,
        mut memory,
    } = setup_rank(&ctx, shared)?;
    let save = |done: usize,
                model: &Vec<F::Chunk>,
                optim: &MegatronOptimizer<Vec<F::Chunk>>,
                skipped: usize|
     -> Result<(), String> {
        let Some(root) = &args.save else {
            return Ok(());
        };
        // ANCHOR: save
        let extra = serde_json::json!({ "skipped_iterations": skipped });
        training
            .save(root, done, model, optim, extra)
            .map_err(|e| e.to_string())?;
        // ANCHOR_END: save
        if leader {
            shared.println(format!(
                " saved checkpoint at iteration {done} to {}",
                root.display()
            ));
        }
        Ok(())
    };
    let hooks = training.grad_sync();
    let (mut log, mut evals, mut spans) = (Vec::new(), Vec::new(), Vec::new());
    // This rank's host reads of device tensors inside its training steps (each one a device
    // synchronisation on a GPU), evaluation and saving left out.
    let mut step_reads = 0;
    // Its host waits for NCCL's streams, and this process's orderings of CUDA streams.
    #[cfg(feature = "cuda")]
    let mut step_syncs = SyncCounts::default();
    // Iterations whose losses are still on the device, read at the log interval.
    let mut pending: Vec<(IterationLog, Losses)> = Vec::new();
    for iteration in start..args.train_iters {
        let t0 = Instant::now();
        let reads = thread_host_reads();
        #[cfg(feature = "cuda")]
        let syncs = SyncCounts::now();
        memory.step_starts();
        let timeline =
            (args.timeline.is_some() && iteration + 1 == args.train_iters).then_some(shared.epoch);
        let step = Step {
            ctx: &ctx,
            shared,
            training: &training,
            hooks: hooks.as_deref(),
        };
        let (grads, losses, s) = step.forward_backward(&model, &optim, iteration, timeline)?;
        spans = s;
        memory.gradients_ready();
        let (m, entry) = step.optimizer_step(
            &scheduler,
            &mut optim,
            model,
            grads,
            iteration,
            &mut skipped,
            t0,
        )?;
        model = m;
        pending.push((entry, losses));
        let done = iteration + 1;
        if done.is_multiple_of(args.log_interval) || done == args.train_iters {
            let (entries, losses): (Vec<_>, Vec<_>) = pending.drain(..).unzip();
            let values = share_losses(&ctx, &losses, shared.family.has_sop())?;
            for (mut entry, (lm, sop)) in entries.into_iter().zip(values) {
                (entry.lm_loss, entry.sop_loss) = (lm, sop);
                if leader {
                    shared.report(&entry);
                }
                log.push(entry);
            }
        }
        step_reads += thread_host_reads() - reads;
        #[cfg(feature = "cuda")]
        step_syncs.add_since(&syncs);
        memory.step_done();
        if args.eval_interval > 0 && (done % args.eval_interval == 0 || done == args.train_iters) {
            let (lm, sop) = evaluate(&ctx, shared, &model, 0..args.eval_iters)?;
            memory.evaluated();
            if leader {
                let sop_part = sop.map_or(String::new(), |s| format!(" sop loss: {s:.6E} |"));
                shared.println(format!(
                    " validation loss at iteration {done} | lm loss: {lm:.6E} |{sop_part} lm PPL: {:.3}",
                    lm.exp()
                ));
            }
            evals.push((done, lm, sop));
        }
        let save_now = args.save_interval > 0 && done.is_multiple_of(args.save_interval);
        if save_now || done == args.train_iters {
            save(done, &model, &optim, skipped)?;
        }
    }
    // A wait of CubeCL's stream for a CUDA library's (cuBLASLt's GEMMs) that gave up let the
    // kernels after it run on unordered data: the run's numbers are not to be trusted.
    #[cfg(feature = "cuda")]
    burn_megatron::cuda::order::check_waits()?;
    // A run that trained no iteration (`--train-iters` at the loaded iteration) still
    // saves, at its own layout: how a checkpoint is resharded without training.
    if start == args.train_iters && start > 0 {
        save(start, &model, &optim, skipped)?;
    }
    if start < args.train_iters {
        let report = memory.report();
        shared.println(report);
        if leader {
            let per_step = step_reads as f64 / (args.train_iters - start) as f64;
            shared.println(format!(
                " host reads of device tensors per iteration (rank 0's, each a device \
                 synchronisation on a GPU): {per_step:.1}"
            ));
            #[cfg(feature = "cuda")]
            if let Some(line) = step_syncs.report(args.train_iters - start) {
                shared.println(line);
            }
        }
        // How pipeline and ring messages travelled (this process's ranks together).
        #[cfg(feature = "cuda")]
        {
            let p2p = burn_megatron::comm::p2p_stats();
            if p2p.device + p2p.host > 0 {
                shared.println(format!(
                    " point-to-point tensors of this process: {} in device memory, {} through host memory",
                    p2p.device, p2p.host
                ));
            }
        }
    }
    let said = shared.family.finish(&ctx, &model)?;
    if ctx.state.global_rank() == 0 {
        for line in &said {
            shared.println(line.clone());
        }
    }
    let peak = (
        ctx.state.global_rank(),
        ctx.state.pipeline_model_parallel_rank(),
        memory.peak(),
    );
    Ok(RankOutput {
        log,
        evals,
        spans,
        peak,
        said,
    })
}

/// Host waits for NCCL's streams (this thread's) and CUDA stream orderings (this process's),
/// summed over training steps.
#[cfg(feature = "cuda")]
#[derive(Debug, Default)]
struct SyncCounts {
    nccl_waits: u64,
    device_orders: u64,
    host_syncs: u64,
}

#[cfg(feature = "cuda")]
impl SyncCounts {
    fn now() -> Self {
        let orders = burn_megatron::cuda::order::order_stats();
        Self {
            nccl_waits: burn_megatron::comm::nccl::thread_host_waits(),
            device_orders: orders.device_orders,
            host_syncs: orders.host_syncs,
        }
    }

    fn add_since(&mut self, before: &Self) {
        let now = Self::now();
        self.nccl_waits += now.nccl_waits - before.nccl_waits;
        self.device_orders += now.device_orders - before.device_orders;
        self.host_syncs += now.host_syncs - before.host_syncs;
    }

    /// The per-iteration line, when anything was counted (a CUDA or NCCL run).
    fn report(&self, iterations: usize) -> Option<String> {
        if self.nccl_waits + self.device_orders + self.host_syncs == 0 {
            return None;
        }
        let per = |n: u64| n as f64 / iterations as f64;
        Some(
            format!(
                " host waits for NCCL streams per iteration (rank 0's thread): {:.1}; CUDA stream \
             orderings per iteration (this process): {:.1} on the device, {:.1} by host \
             synchronisation",
                per(self.nccl_waits),
                per(self.device_orders),
                per(self.host_syncs)
            ) + &match burn_megatron::comm::nccl::communicators() {
                0 => String::new(),
                n => format!("; NCCL communicators in this process: {n}"),
            },
        )
    }
}
