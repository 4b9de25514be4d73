//! One rank's setup before its first step: its model chunks, the `ParallelTraining` that
//! holds its reducers and checkpoints, the optimizer and the learning-rate schedule, and
//! what `--load` restores.

use super::{Family, Shared, TrainArgs};
use crate::memory::RankMemory;
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::DType;
use burn_megatron::launch::RankContext;
use burn_megatron::moe::global_expert_name;
use burn_megatron::optimizer::{
    ConstantGradScaler, DynamicGradScaler, FusedAdamConfig, InnerOptimizer, MegatronOptimizer,
    NormType, OptimizerError, OptimizerParamScheduler, OptimizerParamSchedulerConfig, cast_params,
};
use burn_megatron::topology::PipelinePosition;
use burn_megatron::training::{ParallelTraining, ParallelTrainingConfig};
use std::sync::Arc;

fn dtype(args: &TrainArgs) -> DType {
    if args.bf16 {
        DType::BF16
    } else if args.fp16 {
        DType::F16
    } else {
        DType::F32
    }
}

/// The schedule of `args`: warmup from 0, decay over the whole run, the weight decay from
/// `--start-weight-decay` to `--end-weight-decay` over the whole run.
pub fn scheduler(args: &TrainArgs) -> Result<OptimizerParamScheduler, String> {
    let warmup = (args.lr_warmup_fraction * args.train_iters as f64).round() as usize;
    OptimizerParamScheduler::new(OptimizerParamSchedulerConfig {
        init_lr: 0.0,
        max_lr: args.lr,
        min_lr: args.min_lr,
        lr_warmup_steps: warmup,
        lr_decay_steps: args.train_iters,
        lr_decay_style: args.lr_decay_style.into(),
        wsd_decay_steps: args.lr_wsd_decay_iters,
        lr_wsd_decay_style: Some(args.lr_wsd_decay_style.into()),
        start_wd: args.start_weight_decay.unwrap_or(args.weight_decay),
        end_wd: args.end_weight_decay.unwrap_or(args.weight_decay),
        wd_incr_steps: args.train_iters,
        wd_incr_style: args.weight_decay_incr_style.into(),
    })
    .map_err(|e| format!("the learning-rate / weight-decay schedule (--lr, --min-lr, --lr-decay-style, --lr-wsd-decay-iters, --lr-warmup-fraction, --train-iters, --weight-decay, --start-weight-decay, --end-weight-decay, --weight-decay-incr-style): {e}"))
}

/// What a rank trains with: its model chunks (loaded when resuming), the one object for
/// its reducers and checkpoints, the optimizer and the schedule, where it starts.
pub(super) struct RankSetup<F: Family> {
    pub model: Vec<F::Chunk>,
    pub training: ParallelTraining,
    pub optim: MegatronOptimizer<Vec<F::Chunk>>,
    pub scheduler: OptimizerParamScheduler,
    pub start: usize,
    pub skipped: usize,
    pub memory: RankMemory,
}

/// Builds this rank's part of the model (its model chunks of its pipeline stage), its
/// optimizer, and loads `--load`.
pub(super) fn setup_rank<F: Family>(
    ctx: &RankContext,
    shared: &Shared<F>,
) -> Result<RankSetup<F>, String> {
    let args = &shared.args;
    let leader = ctx.state.global_rank() == 0;
    let mut memory = RankMemory::start_on(ctx.state.global_rank(), &ctx.device);
    let model: Vec<F::Chunk> = (0..args.num_model_chunks())
        .map(|c| {
            shared
                .family
                .init_chunk(ctx, PipelinePosition::of(&ctx.state, c))
        })
        .collect::<Result<_, _>>()?;
    let model = cast_params(model, dtype(args));
    memory.weights_built();
    let fused_adam = args
        .use_fused_adam
        .then(|| FusedAdamConfig::new().init())
        .transpose()
        .map_err(|e| e.to_string())?;
    // One object for the data-parallel reducers, the distributed optimizer's plans and the
    // checkpoints; keys tensors by global name, so any layout loads any other's.
    // ANCHOR: parallel_training
    let first_layers: Vec<usize> = model.iter().map(F::first_layer).collect();
    // Experts go by their global index, so a checkpoint loads at any expert-parallel size.
    let first_expert = model.first().map_or(0, F::first_expert);
    let names = Arc::new(move |path: &str| {
        global_expert_name(&F::global_name(&first_layers, path), first_expert)
    });
    let mut training = ParallelTrainingConfig::new()
        .with_overlap_grad_reduce(args.overlap_grad_reduce)
        .with_use_distributed_optimizer(args.use_distributed_optimizer)
        .init(ctx, &model, names)
        .map_err(|e| e.to_string())?;
    // ANCHOR_END: parallel_training
    let layout = training.checkpoint_rank().layout;
    // ANCHOR: make_optimizer
    // The weight decay is the scheduler's, set every step; no decay on biases and norms.
    let make_optimizer = |training: &ParallelTraining,
                          model: &Vec<F::Chunk>|
     -> Result<MegatronOptimizer<Vec<F::Chunk>>, OptimizerError> {
        let inner = match &fused_adam {
            Some(adam) => InnerOptimizer::FusedAdam(adam.clone()),
            None => InnerOptimizer::from(AdamWConfig::new().with_weight_decay(0.0).init()),
        };
        let optim = training
            .optimizer(inner, model)?
            .with_clip_grad(args.clip_grad, NormType::L2);
        Ok(match (args.fp16, args.loss_scale) {
            (false, _) => optim,
            (true, Some(s)) => optim.with_grad_scaler(ConstantGradScaler::new(s)),
            (true, None) => optim.with_grad_scaler(DynamicGradScaler::default()),
        })
    };
    // ANCHOR_END: make_optimizer
    let scheduler = scheduler(args)?;
    // ANCHOR: load
    let (model, optim, start, skipped) = match &args.load {
        None => {
            let optim = make_optimizer(&training, &model).map_err(|e| e.to_string())?;
            (model, optim, 0, 0usize)
        }
        Some(root) => {
            let r = training
                .load(
                    root,
                    args.ckpt_step,
                    model,
                    make_optimizer,
                    !args.no_load_optim,
                )
                .map_err(|e| e.to_string())?;
            if leader {
                for (iteration, e) in &r.skipped {
                    eprintln!(
                        " WARNING: checkpoint iteration {iteration} does not verify, skipped: {e}"
                    );
                }
                if r.saved_at != layout {
                    shared.println(format!(
                        " loaded iteration {} saved at {}, resharded to {layout}",
                        r.iteration, r.saved_at
                    ));
                }
            }
            let skipped = r.extra["skipped_iterations"].as_u64().unwrap_or(0) as usize;
            (r.model, r.optimizer, r.iteration, skipped)
        }
    };
    // ANCHOR_END: load
    if let Some(state) = optim.state_elements().filter(|_| leader) {
        // The distributed optimizer's point: 12 bytes of state per parameter, over DP.
        let params = model.num_params();
        shared.println(format!(
            " optimizer state on rank 0: {state} f32 elements for {params} parameters, {:.2} bytes per parameter",
            4.0 * state as f64 / params.max(1) as f64
        ));
    }
    Ok(RankSetup {
        model,
        training,
        optim,
        scheduler,
        start,
        skipped,
        memory,
    })
}
