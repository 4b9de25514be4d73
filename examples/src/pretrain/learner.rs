//! burn-train's `Learner` driving a tensor-, pipeline- and data-parallel GPT: one learner
//! per rank, each on its own thread (or process), with the usual metrics and renderer on
//! rank 0 only.
//!
//! Burn 0.22's hook points carry our step: [`TrainStep::step`] runs the schedule's forward
//! and backward and the gradient reductions (the same code as `gpt_pretrain`'s loop);
//! [`TrainStep::optimize`] steps [`MegatronOptimizer`](burn_megatron::optimizer::MegatronOptimizer)
//! (the learner's own optimizer is never used); the learner's LR scheduler is our
//! [`OptimizerParamScheduler`]. burn-train's multi-device and DDP strategies are not used:
//! they all-reduce every parameter over every device, which would sum different TP shards.
//! The default single-device strategy runs the step on the calling thread, where our
//! gradient hooks live.
//!
//! An epoch is `--eval-interval` iterations followed by `--eval-iters` validation batches,
//! the same number on every rank; checkpoints go through `ParallelTraining::save` at
//! `--save-interval`, the learner's checkpointers stay off.

use super::gpt::GptFamily;
use super::setup::{RankSetup, setup_rank};
use super::train::{RankOutput, Step, evaluate};
use super::{Eval, Family, IterationLog, Shared};
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, ExecutionError, Tensor};
use burn::train::logger::{EvaluationProgressLogger, InMemoryMetricLogger, TrainingProgressLogger};
use burn::train::metric::MetricDefinition;
use burn::train::metric::{Adaptor, LearningRateMetric, LossInput, LossMetric};
use burn::train::renderer::tui::TuiMetricsRendererWrapper;
use burn::train::renderer::{
    CliMetricsRenderer, EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::{
    InferenceStep, Interrupter, ItemLazy, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingError,
};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::launch::RankContext;
use burn_megatron::models::Gpt;
use burn_megatron::optimizer::OptimizerParamScheduler;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How rank 0 shows progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Renderer {
    /// burn-train's terminal UI (a line renderer when stdout is not a terminal).
    Tui,
    /// burn-train's line renderer.
    Cli,
    /// Nothing (tests).
    None,
}

/// burn-train's side of a run.
#[derive(Debug, Clone, clap::Args)]
pub struct LearnerOptions {
    /// Where burn-train writes its metric logs (rank 0 only).
    #[arg(long, default_value = "learner_tp_artifacts")]
    pub artifact_dir: PathBuf,
    /// How rank 0 renders.
    #[arg(long, value_enum, default_value = "tui")]
    pub renderer: Renderer,
}

/// What one rank's learner reports: the language-model loss, averaged over DP.
#[derive(Debug, Clone)]
pub struct LmOutput {
    loss: Tensor<1>,
}

impl ItemLazy for LmOutput {
    fn sync(self) -> Result<Self, ExecutionError> {
        self.loss.device().flush()?;
        Ok(Self {
            loss: self.loss.without_autodiff(),
        })
    }
}

impl Adaptor<LossInput> for LmOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

/// A rank's state between the learner's calls.
struct RankState {
    ctx: RankContext,
    shared: Arc<Shared<GptFamily>>,
    setup: RankSetup<GptFamily>,
    /// Iterations done.
    iteration: usize,
    losses: (f64, Option<f64>),
    started: Instant,
    log: Vec<IterationLog>,
    evals: Vec<Eval>,
    valid: Vec<f64>,
    /// Rank 0's renderer asks to stop here; every rank agrees at the next step.
    render_stop: Interrupter,
    stop: Interrupter,
}

/// The learner's handle on a rank's state (a skipped module field).
#[derive(Clone)]
pub struct RankHandle(Arc<Mutex<RankState>>);

impl std::fmt::Debug for RankHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RankHandle")
    }
}

/// The model burn-train drives on one rank: this rank's GPT chunks.
#[derive(Module, Debug)]
pub struct RankGpt {
    chunks: Vec<Gpt>,
    #[module(skip)]
    rank: RankHandle,
}

fn fail(stop: &Interrupter, rank: usize, message: String) {
    stop.fail(TrainingError::Workers(vec![
        burn::train::train::WorkerFailure {
            device_id: rank,
            message,
        },
    ]));
}

impl RankGpt {
    fn scalar(device: &Device, v: f64) -> LmOutput {
        LmOutput {
            loss: Tensor::from_data([v as f32], device),
        }
    }
}

impl TrainStep for RankGpt {
    type Input = usize;
    type Output = LmOutput;

    fn step(&self, _item: usize) -> TrainOutput<LmOutput> {
        let mut guard = self.rank.0.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        st.started = Instant::now();
        st.setup.memory.step_starts();
        let hooks = st.setup.training.grad_sync();
        let step = Step {
            ctx: &st.ctx,
            shared: &st.shared,
            training: &st.setup.training,
            hooks: hooks.as_deref(),
        };
        // burn-train logs every step's loss: read it now (one read per iteration).
        let sop = super::Family::has_sop(&st.shared.family);
        let out = step
            .forward_backward(&self.chunks, &st.setup.optim, st.iteration, None)
            .and_then(|(grads, local, spans)| {
                let shared = super::train::share_losses(&st.ctx, &[local], sop)?;
                Ok((grads, shared[0], spans))
            });
        // Stop together: a stop asked on rank 0's renderer reaches every rank here.
        let mut flag = vec![f32::from(u8::from(st.render_stop.should_stop()))];
        let agreed = (st.ctx.groups.world)
            .all_reduce_vec(&mut flag, ReduceOp::Max)
            .map_err(|e| e.to_string());
        let device = st.ctx.device.clone();
        let rank = st.ctx.state.global_rank();
        match (out, agreed) {
            (Ok((grads, losses, _)), Ok(())) => {
                if flag[0] > 0.0 {
                    st.stop.stop(Some("stopped from the renderer"));
                }
                st.losses = losses;
                TrainOutput {
                    grads,
                    item: Self::scalar(&device, losses.0),
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                fail(&st.stop, rank, e.to_string());
                TrainOutput {
                    grads: GradientsParams::new(),
                    item: Self::scalar(&device, f64::NAN),
                }
            }
        }
    }

    fn optimize(
        self,
        _unused: &mut ModuleOptimizer,
        _lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let Self { chunks, rank } = self;
        let mut guard = rank.0.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        if st.stop.error().is_some() {
            drop(guard);
            return Self { chunks, rank };
        }
        st.setup.memory.gradients_ready();
        let step = Step {
            ctx: &st.ctx,
            shared: &st.shared,
            training: &st.setup.training,
            hooks: None,
        };
        let mut skipped = st.setup.skipped;
        // The learner's scheduler gave the same rate (`lr_at(iteration)`); ours also sets
        // the weight decay.
        let done = step.optimizer_step(
            &st.setup.scheduler,
            &mut st.setup.optim,
            chunks.clone(),
            grads,
            st.iteration,
            &mut skipped,
            st.started,
        );
        let chunks = match done {
            Ok((chunks, mut entry)) => {
                (entry.lm_loss, entry.sop_loss) = st.losses;
                st.setup.skipped = skipped;
                st.setup.memory.step_done();
                st.iteration += 1;
                if st.ctx.state.global_rank() == 0 {
                    st.shared.report(&entry);
                }
                st.log.push(entry);
                if let Err(e) = save_if_due(st, &chunks) {
                    fail(&st.stop, st.ctx.state.global_rank(), e);
                }
                chunks
            }
            Err(e) => {
                fail(&st.stop, st.ctx.state.global_rank(), e);
                chunks
            }
        };
        drop(guard);
        Self { chunks, rank }
    }
}

fn save_if_due(st: &RankState, chunks: &Vec<Gpt>) -> Result<(), String> {
    let args = &st.shared.args;
    let done = st.iteration;
    let due = args.save_interval > 0 && done.is_multiple_of(args.save_interval);
    let Some(root) = args
        .save
        .as_ref()
        .filter(|_| due || done == args.train_iters)
    else {
        return Ok(());
    };
    let extra = serde_json::json!({ "skipped_iterations": st.setup.skipped });
    st.setup
        .training
        .save(root, done, chunks, &st.setup.optim, extra)
        .map_err(|e| e.to_string())
}

impl InferenceStep for RankGpt {
    type Input = usize;
    type Output = LmOutput;

    /// Validation batch `k`: every rank runs it (the collectives need them all); the
    /// epoch's last one records the mean as our loop's validation does.
    fn step(&self, k: usize) -> LmOutput {
        let mut guard = self.rank.0.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        let device = st.ctx.device.clone();
        let result = evaluate_one(st, &self.chunks, k);
        match result {
            Ok(lm) => {
                st.valid.push(lm);
                if st.valid.len() == st.shared.args.eval_iters {
                    let mean = st.valid.iter().sum::<f64>() / st.valid.len() as f64;
                    st.evals.push((st.iteration, mean, None));
                    if st.ctx.state.global_rank() == 0 {
                        st.shared.println(format!(
                            " validation loss at iteration {} | lm loss: {mean:.6E} | lm PPL: {:.3}",
                            st.iteration,
                            mean.exp()
                        ));
                    }
                    st.valid.clear();
                }
                Self::scalar(&device, lm)
            }
            Err(e) => {
                fail(&st.stop, st.ctx.state.global_rank(), e);
                Self::scalar(&device, f64::NAN)
            }
        }
    }
}

fn evaluate_one(st: &RankState, chunks: &[Gpt], k: usize) -> Result<f64, String> {
    evaluate(&st.ctx, &st.shared, chunks, k..k + 1).map(|(lm, _)| lm)
}

/// Iteration indices as burn-train items: every rank gets the same count, and the step
/// reads its own data-parallel share of each global batch.
#[derive(Debug, Clone)]
struct Iterations(usize);

struct IterationsIter {
    next: usize,
    total: usize,
}

impl Iterator for IterationsIter {
    type Item = Result<usize, DatasetError>;
    fn next(&mut self) -> Option<Self::Item> {
        (self.next < self.total).then(|| {
            self.next += 1;
            Ok(self.next - 1)
        })
    }
}

impl DataLoaderIterator<usize> for IterationsIter {
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.total, Some("iterations".into()))
    }
}

impl DataLoader<usize> for Iterations {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<usize> + 'a> {
        Box::new(IterationsIter {
            next: 0,
            total: self.0,
        })
    }
    fn num_items(&self) -> usize {
        self.0
    }
    fn to_device(&self, _device: &Device) -> Arc<dyn DataLoader<usize>> {
        Arc::new(self.clone())
    }
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<usize>> {
        Arc::new(Iterations(end.min(self.0).saturating_sub(start)))
    }
}

/// Ranks other than 0 render nothing.
struct Silent;

impl MetricsRendererTraining for Silent {
    fn update_train(&mut self, _: MetricState) {}
    fn update_valid(&mut self, _: MetricState) {}
}
impl MetricsRendererEvaluation for Silent {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
}
impl TrainingProgressLogger for Silent {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _: usize) {}
    fn start_split(&mut self, _: &str, _: usize) {}
    fn update_split(&mut self, _: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _: String) {}
}
impl EvaluationProgressLogger for Silent {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}
impl MetricsRenderer for Silent {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: MetricDefinition) {}
}

/// One rank under burn-train: builds its part of the model and optimizer as our loop
/// does, then hands them to a `Learner`.
pub(super) fn learner_rank(
    ctx: RankContext,
    shared: &Arc<Shared<GptFamily>>,
    options: &LearnerOptions,
) -> Result<RankOutput, String> {
    let args = &shared.args;
    let per_epoch = if args.eval_interval == 0 {
        args.train_iters
    } else {
        args.eval_interval
    };
    let setup = setup_rank(&ctx, shared)?;
    if setup.start != 0 || !args.train_iters.is_multiple_of(per_epoch) {
        return Err(format!(
            "learner: an epoch is --eval-interval ({per_epoch}) iterations, so --train-iters \
             ({}) must be a multiple of it, and a run starts at iteration 0 (resumed at {})",
            args.train_iters, setup.start
        ));
    }
    let leader = ctx.state.global_rank() == 0;
    let chunks = setup.model.clone();
    let scheduler: OptimizerParamScheduler = setup.scheduler.clone();
    let (render_stop, stop) = (Interrupter::new(), Interrupter::new());
    let state = RankState {
        ctx,
        shared: shared.clone(),
        setup,
        iteration: 0,
        losses: (f64::NAN, None),
        started: Instant::now(),
        log: Vec::new(),
        evals: Vec::new(),
        valid: Vec::new(),
        render_stop: render_stop.clone(),
        stop: stop.clone(),
    };
    let handle = RankHandle(Arc::new(Mutex::new(state)));
    let model = RankGpt {
        chunks,
        rank: handle.clone(),
    };
    // The learner's own optimizer is never stepped (`optimize` is ours).
    let learner = Learner::new(model, SgdConfig::new().init(), scheduler);
    let valid_items = if args.eval_interval == 0 {
        0
    } else {
        args.eval_iters
    };
    let training = SupervisedTraining::new(
        &options.artifact_dir,
        Arc::new(Iterations(per_epoch)),
        Arc::new(Iterations(valid_items)),
    )
    .num_epochs(args.train_iters / per_epoch)
    .with_interrupter(stop.clone())
    .with_application_logger(None)
    .metrics((LossMetric::new(),))
    .metric_train_numeric(LearningRateMetric::new());
    let renderer: Box<dyn MetricsRenderer> = match (leader, options.renderer) {
        (true, Renderer::Tui) if std::io::stdout().is_terminal() => {
            Box::new(TuiMetricsRendererWrapper::new(render_stop, None))
        }
        (true, Renderer::Tui | Renderer::Cli) => Box::new(CliMetricsRenderer::new()),
        _ => Box::new(Silent),
    };
    let training = training.renderer(renderer);
    let training = if leader && options.renderer != Renderer::None {
        training
    } else {
        training.with_metric_logger(InMemoryMetricLogger::new())
    };
    let result = training.launch(learner);
    drop(result.renderer);
    // The trained chunks; the state's handle must go for the state to be taken back.
    let RankGpt { chunks, rank } = result.model;
    drop(rank);
    if let Some(e) = result.error {
        return Err(format!("learner: {e}"));
    }
    let st = Arc::try_unwrap(handle.0)
        .map_err(|_| "learner: the model outlived the run".to_string())?
        .into_inner()
        .unwrap_or_else(|p| p.into_inner());
    // As our loop does after its last iteration: the samples, the Hugging Face directory.
    let said = st.shared.family.finish(&st.ctx, &chunks)?;
    if st.ctx.state.global_rank() == 0 {
        for line in &said {
            st.shared.println(line.clone());
        }
    }
    let peak = (
        st.ctx.state.global_rank(),
        st.ctx.state.pipeline_model_parallel_rank(),
        st.setup.memory.peak(),
    );
    Ok(RankOutput {
        log: st.log,
        evals: st.evals,
        spans: Vec::new(),
        peak,
        said,
    })
}
