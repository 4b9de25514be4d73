//! One rank's training loop: micro-batches with gradient accumulation, the data-parallel
//! and sequence-parallel gradient reductions, the Megatron optimizer step, validation and
//! checkpoints.

use super::{Args, IterationLog, Shared};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Tensor};
use burn_megatron::checkpoint::{
    load_checkpoint, rank_dir, read_latest, save_checkpoint, write_latest,
};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::data::{BertBatch, BertDataset, BertSample};
use burn_megatron::data_parallel::{
    DataParallelConfig, OverlapReducer, finalize_model_grads, finalize_model_grads_overlapped,
};
use burn_megatron::launch::RankContext;
use burn_megatron::models::{Bert, BertConfig};
use burn_megatron::optimizer::{
    ConstantGradScaler, DynamicGradScaler, FusedAdamConfig, MegatronOptimizer, NormType,
    OptimizerParamScheduler, OptimizerParamSchedulerConfig, WdIncrStyle, cast_params,
    megatron_param_groups,
};
use burn_megatron::tensor_parallel::RngTracker;
use std::time::Instant;

fn scalar(t: Tensor<1>) -> f64 {
    t.into_data()
        .iter::<f32>()
        .next()
        .map_or(f64::NAN, f64::from)
}

fn dtype(args: &Args) -> DType {
    if args.bf16 {
        DType::BF16
    } else if args.fp16 {
        DType::F16
    } else {
        DType::F32
    }
}

/// The schedule of `args` (warmup from 0, decay over the whole run, constant weight decay).
pub fn scheduler(args: &Args) -> Result<OptimizerParamScheduler, String> {
    let warmup = (args.lr_warmup_fraction * args.train_iters as f64).round() as usize;
    OptimizerParamScheduler::new(OptimizerParamSchedulerConfig {
        init_lr: 0.0,
        max_lr: args.lr,
        min_lr: args.min_lr,
        lr_warmup_steps: warmup,
        lr_decay_steps: args.train_iters,
        lr_decay_style: args.lr_decay_style.into(),
        wsd_decay_steps: None,
        lr_wsd_decay_style: None,
        start_wd: args.weight_decay,
        end_wd: args.weight_decay,
        wd_incr_steps: 0,
        wd_incr_style: WdIncrStyle::Constant,
    })
    .map_err(|e| e.to_string())
}

/// (lm loss, sop loss) of one micro-batch, and its backward when `rng` is given.
fn micro_step(
    model: &Bert,
    samples: &[BertSample],
    rng: Option<&RngTracker>,
    scale: f64,
) -> Result<(f64, f64, Option<GradientsParams>), String> {
    let device = model.lm_bias.val().device();
    let b = BertBatch::new(samples, &device);
    let out = model.forward(b.ids, b.types, b.padding, rng);
    let (lm, sop) = model
        .loss(out, b.labels, b.loss_mask, b.is_random)
        .map_err(|e| e.to_string())?;
    let values = (scalar(lm.clone()), scalar(sop.clone()));
    let grads = rng.map(|_| GradientsParams::from_grads(((lm + sop) * scale).backward(), model));
    Ok((values.0, values.1, grads))
}

/// The mean validation losses over `eval_iters` global batches of `valid`.
fn evaluate(
    ctx: &RankContext,
    model: &Bert,
    shared: &Shared,
    valid: &BertDataset,
) -> Result<(f64, f64), String> {
    let (layout, dp_rank) = (&shared.layout, ctx.state.data_parallel_rank());
    let mut sums = [0.0f64; 2];
    for k in 0..shared.args.eval_iters {
        for micro in 0..layout.num_micro_batches() {
            let samples: Vec<BertSample> = layout
                .micro_batch(k, dp_rank, micro)
                .map(|i| valid.sample(i))
                .collect();
            let (lm, sop, _) = micro_step(model, &samples, None, 1.0)?;
            sums[0] += lm;
            sums[1] += sop;
        }
    }
    let n = (shared.args.eval_iters * layout.num_micro_batches()).max(1) as f64;
    let mut avg = vec![(sums[0] / n) as f32, (sums[1] / n) as f32];
    ctx.groups
        .dp
        .all_reduce_vec(&mut avg, ReduceOp::Avg)
        .map_err(|e| e.to_string())?;
    Ok((f64::from(avg[0]), f64::from(avg[1])))
}

/// What a rank hands back: its log (identical on every rank) and validation losses.
pub type RankOutput = (Vec<IterationLog>, Vec<(usize, f64, f64)>);

/// Trains this rank's part of the model.
pub fn train_rank(ctx: RankContext, shared: &Shared) -> Result<RankOutput, String> {
    let args = &shared.args;
    let (tp, dp) = (&ctx.groups.tp, &ctx.groups.dp);
    let tp_rank = ctx.state.tensor_model_parallel_rank();
    let dp_rank = ctx.state.data_parallel_rank();
    let leader = ctx.state.global_rank() == 0;
    let config: &BertConfig = &shared.model_config;
    let model = config.init(tp, &ctx.device).map_err(|e| e.to_string())?;
    let model = cast_params(model, dtype(args));
    let fused_adam = args
        .use_fused_adam
        .then(|| {
            let wd = args.weight_decay as f32;
            FusedAdamConfig::new().with_weight_decay(wd).init()
        })
        .transpose()
        .map_err(|e| e.to_string())?;
    let make_optimizer = |model: &Bert| {
        let mp = ctx.groups.mp.clone();
        let optim = if let Some(adam) = &fused_adam {
            MegatronOptimizer::fused_adam(adam.clone(), model, mp, tp_rank)
        } else {
            let adamw = AdamWConfig::new().with_weight_decay(args.weight_decay as f32);
            let groups = megatron_param_groups(
                model,
                adamw.build(),
                adamw.with_weight_decay(0.0).build(),
                None,
            );
            MegatronOptimizer::new(groups, model, mp, tp_rank)
        }
        .with_clip_grad(args.clip_grad, NormType::L2);
        match (args.fp16, args.loss_scale) {
            (false, _) => optim,
            (true, Some(s)) => optim.with_grad_scaler(ConstantGradScaler::new(s)),
            (true, None) => optim.with_grad_scaler(DynamicGradScaler::default()),
        }
    };
    let scheduler = scheduler(args)?;
    let (mut model, mut optim, start, mut skipped) = match &args.load {
        None => {
            let optim = make_optimizer(&model);
            (model, optim, 0, 0usize)
        }
        Some(root) => {
            let iteration = read_latest(root).map_err(|e| e.to_string())?.unwrap_or(0);
            let r = load_checkpoint(&rank_dir(root, iteration, tp_rank), model, make_optimizer)
                .map_err(|e| e.to_string())?;
            let skipped = r.extra["skipped_iterations"].as_u64().unwrap_or(0) as usize;
            (r.model, r.optimizer, r.iteration, skipped)
        }
    };

    let layout = &shared.layout;
    let n_micro = layout.num_micro_batches();
    let dp_config = DataParallelConfig::default();
    let reducer = args
        .overlap_grad_reduce
        .then(|| OverlapReducer::new(&model, dp, &dp_config));
    let tokens_per_iter = (args.global_batch_size * args.seq_length) as f64;
    let (mut log, mut evals) = (Vec::new(), Vec::new());
    for iteration in start..args.train_iters {
        let t0 = Instant::now();
        // Dropout masks are a function of (seed, iteration): nothing to checkpoint.
        let rng = RngTracker::new(args.seed ^ ((iteration as u64 + 1) << 20), tp_rank);
        let scale = optim.loss_scale() / n_micro as f64;
        let mut acc = GradientsAccumulator::new();
        let mut losses = [0.0f64; 2];
        for micro in 0..n_micro {
            let samples: Vec<BertSample> = layout
                .micro_batch(iteration, dp_rank, micro)
                .map(|i| shared.train.sample(i))
                .collect();
            let active = reducer.as_ref().map(|r| r.activate(micro + 1 == n_micro));
            let (lm, sop, grads) = micro_step(&model, &samples, Some(&rng), scale)?;
            drop(active);
            losses[0] += lm / n_micro as f64;
            losses[1] += sop / n_micro as f64;
            if let Some(g) = grads {
                acc.accumulate(&model, g);
            }
        }
        let mut grads = acc.grads();
        match &reducer {
            Some(r) => finalize_model_grads_overlapped(r, &model, &mut grads, tp, None, &dp_config),
            None => finalize_model_grads(&model, &mut grads, dp, tp, None, &dp_config),
        }
        .map_err(|e| e.to_string())?;
        let lr = scheduler.lr_at(iteration);
        let (m, report) = optim.step(lr, model, grads).map_err(|e| e.to_string())?;
        model = m;
        skipped += usize::from(!report.updated);
        let mut reduced = vec![losses[0] as f32, losses[1] as f32];
        dp.all_reduce_vec(&mut reduced, ReduceOp::Avg)
            .map_err(|e| e.to_string())?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let entry = IterationLog {
            iteration: iteration + 1,
            consumed_samples: (iteration + 1) * args.global_batch_size,
            lr,
            lm_loss: f64::from(reduced[0]),
            sop_loss: f64::from(reduced[1]),
            grad_norm: report.grad_norm,
            loss_scale: report.loss_scale,
            skipped_iterations: skipped,
            ms_per_iter: ms,
            tokens_per_s: tokens_per_iter / (ms / 1e3),
        };
        if leader {
            shared.report(&entry);
        }
        log.push(entry);
        let done = iteration + 1;
        if args.eval_interval > 0 && (done % args.eval_interval == 0 || done == args.train_iters) {
            let (lm, sop) = evaluate(&ctx, &model, shared, &shared.valid)?;
            if leader {
                shared.println(format!(
                    " validation loss at iteration {done} | lm loss: {lm:.6E} | sop loss: {sop:.6E} | lm PPL: {:.3}",
                    lm.exp()
                ));
            }
            evals.push((done, lm, sop));
        }
        let save_now = args.save_interval > 0 && done.is_multiple_of(args.save_interval);
        if let Some(root) = args
            .save
            .as_ref()
            .filter(|_| save_now || done == args.train_iters)
        {
            if dp_rank == 0 {
                let extra = serde_json::json!({ "skipped_iterations": skipped });
                save_checkpoint(&rank_dir(root, done, tp_rank), done, &model, &optim, extra)
                    .map_err(|e| e.to_string())?;
            }
            ctx.groups.world.barrier().map_err(|e| e.to_string())?;
            if leader {
                write_latest(root, done).map_err(|e| e.to_string())?;
                shared.println(format!(
                    " saved checkpoint at iteration {done} to {}",
                    root.display()
                ));
            }
        }
    }
    Ok((log, evals))
}
