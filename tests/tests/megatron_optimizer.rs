//! `MegatronOptimizer` with `finalize_model_grads`: TP × DP parity with AdamW + scheduler +
//! clipping (global batch fixed), bf16 master weights,
//! and an f16 overflow that is skipped.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron::comm::tensor::all_reduce;
use burn_megatron::comm::{Comm, LocalWorld, ReduceOp};
use burn_megatron::data_parallel::{DataParallelConfig, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::optimizer::*;
use burn_megatron::tensor_parallel::*;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::*;
use std::sync::Arc;

const D: usize = 8;
const FFN: usize = 32;
const STEPS: usize = 20;

#[derive(Module, Debug)]
struct TpMlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}

fn build(tp: &Comm, device: &Device) -> TpMlp {
    let bias = MasterInit::Uniform {
        low: -0.3,
        high: 0.3,
    };
    TpMlp {
        fc1: ColumnParallelLinearConfig::new(D, FFN)
            .with_seed(3)
            .with_bias_initializer(bias)
            .init(tp, device)
            .unwrap(),
        fc2: RowParallelLinearConfig::new(FFN, D)
            .with_seed(4)
            .with_bias_initializer(bias)
            .init(tp, device)
            .unwrap(),
    }
}

fn loss(model: &TpMlp, step: usize, device: &Device, dtype: DType) -> Tensor<1> {
    let x = data([16, D], step % 4, 1, device).cast(dtype);
    let y = data([16, D], step % 4, 2, device).cast(dtype);
    let out = model.fc2.forward(gelu(model.fc1.forward(x)));
    (out - y)
        .cast(DType::F32)
        .powi_scalar(2)
        .mean()
        .reshape([1])
}

fn scheduler() -> OptimizerParamScheduler {
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

const GLOBAL_BATCH: usize = 16;

/// (global loss, grad norm) per step at TP = `tp` × DP = `dp`, global batch fixed, with
/// clipping at 0.5 (active in early steps).
fn run_layout(tp: usize, dp: usize) -> Vec<Vec<(f32, f64)>> {
    threads(
        &ParallelConfig::new(tp * dp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let mut model = build(g, d);
            let tp_rank = ctx.state.tensor_model_parallel_rank();
            let mut optim = MegatronOptimizer::new(
                AdamWConfig::new().init(),
                &model,
                ctx.groups.mp.clone(),
                tp_rank,
            )
            .with_clip_grad(0.5, NormType::L2);
            let sched = scheduler();
            let (dp_rank, local) = (ctx.state.data_parallel_rank(), GLOBAL_BATCH / dp);
            let mut out = Vec::new();
            for step in 0..STEPS {
                // Each data-parallel rank takes its disjoint shard of the same global batch.
                let x = data([GLOBAL_BATCH, D], step % 4, 1, d).narrow(0, dp_rank * local, local);
                let y = data([GLOBAL_BATCH, D], step % 4, 2, d).narrow(0, dp_rank * local, local);
                let l = (model.fc2.forward(gelu(model.fc1.forward(x))) - y)
                    .powi_scalar(2)
                    .mean();
                let mut grads = GradientsParams::from_grads(l.backward(), &model);
                finalize_model_grads(
                    &model,
                    &mut grads,
                    &ctx.groups.dp,
                    g,
                    None,
                    &DataParallelConfig::default(),
                )?;
                let (m, report) = optim.step(sched.lr_at(step), model, grads)?;
                model = m;
                let global = all_reduce(&*ctx.groups.dp, l.inner(), ReduceOp::Avg)?;
                out.push((values(global)[0], report.grad_norm.unwrap()));
            }
            Ok::<_, burn_megatron::comm::CommError>(out)
        },
    )
    .unwrap()
}

#[test]
fn tp_by_dp_training_matches_single_rank_with_clipping() {
    let one = run_layout(1, 1).remove(0);
    assert!(
        one[STEPS - 1].0 < 0.8 * one[0].0,
        "the loss must fall: {one:?}"
    );
    for (tp, dp) in [(2, 1), (4, 1), (1, 2), (2, 2), (4, 2)] {
        for trace in run_layout(tp, dp) {
            for (step, ((l, n), (rl, rn))) in trace.iter().zip(&one).enumerate() {
                assert!(
                    (l - rl).abs() <= 1e-5,
                    "{tp}×{dp} step {step}: loss {l} vs {rl}"
                );
                assert!(
                    (n - rn).abs() <= 1e-5 * rn,
                    "{tp}×{dp} step {step}: norm {n} vs {rn}"
                );
            }
        }
    }
}

fn solo() -> Comm {
    Arc::new(LocalWorld::new(1).communicator("mp", vec![0], 0).unwrap())
}

/// Losses over 20 steps with the model's parameters in `dtype` (FP32 master weights when not f32).
fn run_dtype(dtype: DType) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut model = build(&solo(), &device);
    if dtype != DType::F32 {
        model = model.map(&mut CastAll(dtype));
    }
    let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, solo(), 0);
    let sched = scheduler();
    (0..STEPS)
        .map(|step| {
            let l = loss(&model, step, &device, dtype);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            let (m, report) = optim.step(sched.lr_at(step), model.clone(), grads).unwrap();
            assert!(report.updated);
            model = m;
            values(l.inner())[0]
        })
        .collect()
}

struct CastAll(DType);
impl burn::module::ModuleMapper for CastAll {
    fn map_float<const N: usize>(
        &mut self,
        p: burn::module::Param<Tensor<N>>,
    ) -> burn::module::Param<Tensor<N>> {
        let (id, t, mapper) = p.consume();
        burn::module::Param::from_mapped_value(id, t.cast(self.0).detach().require_grad(), mapper)
    }
}

#[test]
fn bf16_with_fp32_master_weights_tracks_the_fp32_run() {
    let fp32 = run_dtype(DType::F32);
    let bf16 = run_dtype(DType::BF16);
    for (step, (a, b)) in fp32.iter().zip(&bf16).enumerate() {
        assert!(
            (a - b).abs() <= 0.02 * a.abs(),
            "step {step}: fp32 {a} vs bf16 {b}"
        );
    }
}

#[test]
fn f16_overflow_is_skipped_and_the_scale_backs_off_after_hysteresis() {
    let device = Device::flex().autodiff();
    let model = build(&solo(), &device).map(&mut CastAll(DType::F16));
    let scaler = DynamicGradScaler::new(1024.0, 1.0, 2.0, 0.5, 1000, 2).unwrap();
    let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, solo(), 0)
        .with_grad_scaler(scaler);
    // A clean step first, so the optimizer has state to protect.
    let l = loss(&model, 0, &device, DType::F16) * optim.loss_scale();
    let (mut model, r) = optim
        .step(
            1e-2,
            model.clone(),
            GradientsParams::from_grads(l.backward(), &model),
        )
        .unwrap();
    assert!(r.updated);
    let state = optim.inner().to_record().into_bytes().unwrap();
    let weights = values(model.fc1.weight.val());
    // Two overflowing steps: a loss multiplied past f16's range makes the gradients inf.
    for (i, expected_scale) in [(0, 1024.0), (1, 512.0)] {
        let l = loss(&model, 1, &device, DType::F16) * 1e30;
        let grads = GradientsParams::from_grads(l.backward(), &model);
        let (m, r) = optim.step(1e-2, model, grads).unwrap();
        model = m;
        assert!(!r.updated, "overflow {i} must skip the step");
        assert_eq!(r.grad_norm, None);
        assert_eq!(optim.loss_scale(), expected_scale, "after overflow {i}");
        assert_eq!(values(model.fc1.weight.val()), weights, "weights untouched");
        assert_eq!(
            optim.inner().to_record().into_bytes().unwrap(),
            state,
            "optimizer state untouched"
        );
    }
    assert_eq!(model.fc1.weight.val().dtype(), DType::F16);
}

#[test]
fn accumulating_micro_batches_then_one_reduction_equals_the_full_batch() {
    use burn::optim::GradientsAccumulator;
    // DP = 2, each rank's shard of 8 rows split into 2 micro-batches of 4 (losses scaled by
    // 1/2 so the accumulated gradient is the shard mean), one reduction per step.
    let out = threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let d = &ctx.device;
            let model = build(&ctx.groups.tp, d);
            let dp_rank = ctx.state.data_parallel_rank();
            let mut acc = GradientsAccumulator::new();
            for micro in 0..2 {
                let rows = dp_rank * 8 + micro * 4;
                let x = data([GLOBAL_BATCH, D], 0, 1, d).narrow(0, rows, 4);
                let y = data([GLOBAL_BATCH, D], 0, 2, d).narrow(0, rows, 4);
                let l = (model.fc2.forward(gelu(model.fc1.forward(x))) - y)
                    .powi_scalar(2)
                    .mean()
                    / 2.0;
                acc.accumulate(&model, GradientsParams::from_grads(l.backward(), &model));
            }
            let mut grads = acc.grads();
            let n = burn_megatron::data_parallel::all_reduce_gradients(
                &model,
                &mut grads,
                &ctx.groups.dp,
                &DataParallelConfig::default(),
            )?;
            assert_eq!(n, 1, "one collective for the whole step");
            Ok::<_, burn_megatron::comm::CommError>(values(
                grads.get::<2>(model.fc1.weight.id).unwrap(),
            ))
        },
    )
    .unwrap();
    let device = Device::flex().autodiff();
    let model = build(&solo(), &device);
    let x = data([GLOBAL_BATCH, D], 0, 1, &device);
    let y = data([GLOBAL_BATCH, D], 0, 2, &device);
    let l = (model.fc2.forward(gelu(model.fc1.forward(x))) - y)
        .powi_scalar(2)
        .mean();
    let grads = GradientsParams::from_grads(l.backward(), &model);
    let full = values(grads.get::<2>(model.fc1.weight.id).unwrap());
    for g in out {
        assert_close(&g, &full, 1e-6, "accumulated + reduced vs full batch");
    }
}
