//! The two-layer tensor-parallel MLP the optimizer tests train, and its training loop at any
//! TP × DP layout with either optimizer.

use crate::{data, values};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron::comm::tensor::all_reduce;
use burn_megatron::comm::{Comm, LocalWorld, ReduceOp};
use burn_megatron::data_parallel::DataParallelConfig;
use burn_megatron::data_parallel::advanced::{DpReduction, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::optimizer::*;
use burn_megatron::tensor_parallel::*;
use burn_megatron::topology::ParallelConfig;
use std::sync::Arc;

/// Hidden size.
pub const D: usize = 8;
/// MLP width.
pub const FFN: usize = 32;
/// Training steps of [`run_layout`].
pub const STEPS: usize = 20;
/// Rows per step, split across data-parallel ranks.
pub const GLOBAL_BATCH: usize = 16;

/// Column-parallel then row-parallel linear, GeLU between.
#[derive(Module, Debug)]
pub struct TpMlp {
    /// `D → FFN`, split by columns.
    pub fc1: ColumnParallelLinear,
    /// `FFN → D`, split by rows.
    pub fc2: RowParallelLinear,
}

impl TpMlp {
    /// The MLP on `x`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

/// The MLP from fixed seeds (the same full weights at every TP size).
pub fn build(tp: &Comm, device: &Device) -> TpMlp {
    build_with(tp, device, false)
}

/// [`build`], with `gradient_accumulation_fusion` in both layers when `fusion`.
pub fn build_with(tp: &Comm, device: &Device, fusion: bool) -> TpMlp {
    let bias = MasterInit::Uniform {
        low: -0.3,
        high: 0.3,
    };
    TpMlp {
        fc1: ColumnParallelLinearConfig::new(D, FFN)
            .with_seed(3)
            .with_bias_initializer(bias)
            .with_gradient_accumulation_fusion(fusion)
            .init(tp, device)
            .unwrap(),
        fc2: RowParallelLinearConfig::new(FFN, D)
            .with_seed(4)
            .with_bias_initializer(bias)
            .with_gradient_accumulation_fusion(fusion)
            .init(tp, device)
            .unwrap(),
    }
}

/// Mean squared error of the whole batch of `step`, inputs in `dtype`, loss in f32.
pub fn loss(model: &TpMlp, step: usize, device: &Device, dtype: DType) -> Tensor<1> {
    let x = data([GLOBAL_BATCH, D], step % 4, 1, device).cast(dtype);
    let y = data([GLOBAL_BATCH, D], step % 4, 2, device).cast(dtype);
    (model.forward(x) - y)
        .cast(DType::F32)
        .powi_scalar(2)
        .mean()
        .reshape([1])
}

/// Warm-up then cosine decay over [`STEPS`].
pub fn scheduler() -> OptimizerParamScheduler {
    OptimizerParamScheduler::new(OptimizerParamSchedulerConfig {
        init_lr: 0.0,
        max_lr: 0.02,
        min_lr: 0.002,
        lr_warmup_steps: 5,
        lr_decay_steps: STEPS,
        lr_decay_style: LrDecayStyle::Cosine,
        wsd_decay_steps: None,
        lr_wsd_decay_style: None,
        start_wd: 0.01,
        end_wd: 0.01,
        wd_incr_steps: STEPS,
        wd_incr_style: WdIncrStyle::Constant,
    })
    .unwrap()
}

/// A one-rank model-parallel group.
pub fn solo() -> Comm {
    Arc::new(LocalWorld::new(1).communicator("mp", vec![0], 0).unwrap())
}

/// Casts every float parameter to a dtype (require_grad on).
pub struct CastAll(pub DType);

impl ModuleMapper for CastAll {
    fn map_float<const N: usize>(&mut self, p: Param<Tensor<N>>) -> Param<Tensor<N>> {
        let (id, t, mapper) = p.consume();
        Param::from_mapped_value(id, t.cast(self.0).detach().require_grad(), mapper)
    }
}

/// Which optimizer a run uses; both are AdamW with burn-optim's defaults (weight decay 1e-4
/// on every parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// burn-optim's `AdamW`, per parameter.
    Burn,
    /// The flat-buffer fused kernel.
    Fused,
}

/// `kind` for `model`, over `model_parallel`.
pub fn optimizer(kind: Kind, model: &TpMlp, mp: Comm, tp_rank: usize) -> MegatronOptimizer<TpMlp> {
    match kind {
        Kind::Burn => MegatronOptimizer::new(AdamWConfig::new().init(), model, mp, tp_rank),
        Kind::Fused => {
            let adam = FusedAdamConfig::new().with_no_weight_decay_on_1d(false);
            MegatronOptimizer::new(adam.init().unwrap(), model, mp, tp_rank)
        }
    }
}

/// One rank's trace: (global loss, grad norm) per step and its final fc1 weight shard.
pub type Trace = (Vec<(f32, f64)>, Vec<f32>);

/// Trains at TP = `tp` × DP = `dp` (global batch fixed) with clipping at 0.25, active in
/// early steps; one trace per rank.
pub fn run_layout(tp: usize, dp: usize, kind: Kind) -> Vec<Trace> {
    run_layout_with(tp, dp, kind, false)
}

/// [`run_layout`], the layers built by [`build_with`]`(.., fusion)`.
pub fn run_layout_with(tp: usize, dp: usize, kind: Kind, fusion: bool) -> Vec<Trace> {
    threads(
        &ParallelConfig::new(tp * dp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let mut model = build_with(g, d, fusion);
            let tp_rank = ctx.state.tensor_model_parallel_rank();
            let mut optim = optimizer(kind, &model, ctx.groups.mp.clone(), tp_rank)
                .with_clip_grad(0.25, NormType::L2);
            let sched = scheduler();
            let (dp_rank, local) = (ctx.state.data_parallel_rank(), GLOBAL_BATCH / dp);
            let mut out = Vec::new();
            for step in 0..STEPS {
                // Each data-parallel rank takes its disjoint shard of the same global batch.
                let x = data([GLOBAL_BATCH, D], step % 4, 1, d).narrow(0, dp_rank * local, local);
                let y = data([GLOBAL_BATCH, D], step % 4, 2, d).narrow(0, dp_rank * local, local);
                let l = (model.forward(x) - y).powi_scalar(2).mean();
                let mut grads = GradientsParams::from_grads(l.backward(), &model);
                finalize_model_grads(
                    &model,
                    &mut grads,
                    DpReduction::AllReduce(&ctx.groups.dp),
                    g,
                    None,
                    &DataParallelConfig::default(),
                )?;
                let (m, report) = optim.step(sched.lr_at(step), model, grads)?;
                model = m;
                let global = all_reduce(&*ctx.groups.dp, l.inner(), ReduceOp::Avg)?;
                out.push((values(global)[0], report.grad_norm.unwrap()));
            }
            Ok::<_, OptimizerError>((out, values(model.fc1.weight.val())))
        },
    )
    .unwrap()
}

/// Losses over [`STEPS`] single-rank steps with the model's parameters in `dtype` (FP32 master
/// weights when not f32), and the final fc1 weight as f32.
pub fn run_dtype(dtype: DType, kind: Kind) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = build(&solo(), &device);
    if dtype != DType::F32 {
        model = model.map(&mut CastAll(dtype));
    }
    let mut optim = optimizer(kind, &model, solo(), 0);
    let sched = scheduler();
    let losses = (0..STEPS)
        .map(|step| {
            let l = loss(&model, step, &device, dtype);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            let (m, report) = optim.step(sched.lr_at(step), model.clone(), grads).unwrap();
            assert!(report.updated);
            model = m;
            values(l.inner())[0]
        })
        .collect();
    (losses, values(model.fc1.weight.val()))
}
