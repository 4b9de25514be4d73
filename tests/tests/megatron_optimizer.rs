//! `MegatronOptimizer` with `finalize_model_grads`: TP × DP parity with AdamW + scheduler +
//! clipping (global batch fixed), bf16 master weights (also where they are what keeps
//! updates that bf16 rounds away), and an f16 overflow that is skipped.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::activation::gelu;
use burn::tensor::{DType, Device};
use burn_megatron::data_parallel::DataParallelConfig;
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::optimizer::*;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::mlp::*;
use burn_megatron_tests::*;

#[test]
fn tp_by_dp_training_matches_single_rank_with_clipping() {
    let one = run_layout(1, 1, Kind::Burn).remove(0).0;
    assert!(
        one[STEPS - 1].0 < 0.8 * one[0].0,
        "the loss must fall: {one:?}"
    );
    for (tp, dp) in [(2, 1), (4, 1), (1, 2), (2, 2), (4, 2)] {
        for (trace, _) in run_layout(tp, dp, Kind::Burn) {
            assert_eq!(trace.len(), one.len(), "{tp}×{dp}: step count");
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

#[test]
fn bf16_with_fp32_master_weights_tracks_the_fp32_run() {
    let fp32 = run_dtype(DType::F32, Kind::Burn).0;
    let bf16 = run_dtype(DType::BF16, Kind::Burn).0;
    assert_eq!(fp32.len(), bf16.len(), "step count");
    for (step, (a, b)) in fp32.iter().zip(&bf16).enumerate() {
        assert!(
            (a - b).abs() <= 0.02 * a.abs(),
            "step {step}: fp32 {a} vs bf16 {b}"
        );
    }
}

/// Every checkpoint file but `index.json` (which holds the loss scale and the files'
/// checksums): the weights and the whole optimizer state, whichever optimizer kind wrote
/// them, safetensors files by their tensors.
fn snapshot(model: &TpMlp, optim: &MegatronOptimizer<TpMlp>, tag: &str) -> Vec<(String, Vec<u8>)> {
    use burn_megatron::checkpoint::advanced::*;
    use burn_megatron::checkpoint::*;
    let root = std::env::temp_dir().join(format!("bm-snapshot-{}-{tag}", std::process::id()));
    let rank = CheckpointRank {
        layout: SavedLayout {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: 1,
            data_parallel_size: 1,
            distributed_optimizer: false,
            expert_model_parallel_size: 1,
        },
        tensor_model_parallel_rank: 0,
        pipeline_model_parallel_rank: 0,
        expert_model_parallel_rank: 0,
        share: burn_megatron::checkpoint::SaveShare::ALL,
        names: &|p: &str| p.to_string(),
    };
    begin_checkpoint(&root, 0).unwrap();
    save_checkpoint(&root, 0, &rank, model, optim, serde_json::Value::Null).unwrap();
    commit_checkpoint(&root, 0).unwrap();
    let dir = iteration_dir(&root, 0).join("mp_rank_00");
    let mut files = Vec::new();
    for path in std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()) {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let bytes = std::fs::read(&path).unwrap();
        if name.ends_with(".safetensors") {
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut tensors = file.tensors();
            tensors.sort_by(|a, b| a.0.cmp(&b.0));
            for (t, view) in tensors {
                files.push((format!("{name}:{t}"), view.data().to_vec()));
            }
        } else if name != "index.json" {
            files.push((name, bytes));
        }
    }
    files.sort();
    std::fs::remove_dir_all(&root).unwrap();
    files
}

#[test]
fn f16_overflow_is_skipped_and_the_scale_backs_off_after_hysteresis() {
    for kind in [Kind::Burn, Kind::Fused] {
        let device = Device::flex().autodiff();
        let model = build(&solo(), &device).map(&mut CastAll(DType::F16));
        let scaler = DynamicGradScaler::new(1024.0, 1.0, 2.0, 0.5, 1000, 2).unwrap();
        let mut optim = optimizer(kind, &model, solo(), 0).with_grad_scaler(scaler);
        // A clean step first, so the optimizer has state to protect.
        let l = loss(&model, 0, &device, DType::F16) * optim.loss_scale();
        let grads = GradientsParams::from_grads(l.backward(), &model);
        let (mut model, r) = optim.step(1e-2, model.clone(), grads).unwrap();
        assert!(r.updated);
        let before = snapshot(&model, &optim, "before");
        // 4 parameters: model + master + AdamW's two moments, or model + the 3 flat buffers.
        assert_eq!(before.len(), 16);
        // Two overflowing steps: a loss multiplied past f16's range makes the gradients inf.
        for (i, expected_scale) in [(0, 1024.0), (1, 512.0)] {
            let l = loss(&model, 1, &device, DType::F16) * 1e30;
            let grads = GradientsParams::from_grads(l.backward(), &model);
            let (m, r) = optim.step(1e-2, model, grads).unwrap();
            model = m;
            assert!(!r.updated, "{kind:?}: overflow {i} must skip the step");
            assert_eq!(r.grad_norm, None);
            assert_eq!(
                optim.loss_scale(),
                expected_scale,
                "{kind:?} after overflow {i}"
            );
            let after = snapshot(&model, &optim, "after");
            assert_eq!(after.len(), before.len(), "{kind:?}: snapshot sizes");
            for ((name, a), (_, b)) in after.iter().zip(&before) {
                assert!(
                    a == b,
                    "{kind:?}: {name} changed (weights and optimizer state must not)"
                );
            }
        }
        assert_eq!(model.fc1.weight.val().dtype(), DType::F16);
    }
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
            let n = burn_megatron::data_parallel::advanced::all_reduce_gradients(
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

/// Updates below half of bf16's spacing at the weight (2^-8 at 1.0): Adam moves each weight by
/// about lr = 1e-3 per step. A bf16 weight stepped directly rounds every update away and never
/// moves; with FP32 master weights both optimizer kinds accumulate them exactly as an fp32 run
/// does, and the bf16 model is that run's weights rounded.
#[test]
fn master_weights_keep_updates_that_bf16_rounds_away() {
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::optim::AdamWConfig;
    use burn::tensor::Tensor;
    let device = Device::flex().autodiff();
    let linear = |dtype: DType| Linear {
        weight: Param::from_tensor(Tensor::<2>::ones([4, 4], &device).cast(dtype)),
        bias: None,
    };
    // d(sum(x·W))/dW = 1 everywhere, exact in bf16.
    let grads = |model: &Linear, dtype: DType| {
        let x = Tensor::<2>::ones([1, 4], &device).cast(dtype);
        GradientsParams::from_grads(model.forward(x).sum().backward(), model)
    };
    let weights = |model: &Linear| values(model.weight.val());
    let adamw = || AdamWConfig::new().with_weight_decay(0.0);
    let (mut fp32, mut direct) = (linear(DType::F32), linear(DType::BF16));
    let (mut opt32, mut opt_direct) = (adamw().init(), adamw().init());
    for _ in 0..20 {
        let g = grads(&fp32, DType::F32);
        fp32 = opt32.step(1e-3, fp32, g);
        let g = grads(&direct, DType::BF16);
        direct = opt_direct.step(1e-3, direct, g);
    }
    let moved = weights(&fp32);
    assert!(moved.iter().all(|&w| (w - 0.98).abs() < 1e-4), "{moved:?}");
    assert!(
        weights(&direct).iter().all(|&w| w == 1.0),
        "without master weights bf16 rounds each update away: {:?}",
        weights(&direct)
    );
    let rounded: Vec<f32> = moved
        .iter()
        .map(|&w| half::bf16::from_f32(w).to_f32())
        .collect();
    for kind in [Kind::Burn, Kind::Fused] {
        let mut model = linear(DType::BF16);
        let mut optim = match kind {
            Kind::Burn => MegatronOptimizer::new(adamw().init(), &model, solo(), 0),
            Kind::Fused => {
                let adam = FusedAdamConfig::new()
                    .with_weight_decay(0.0)
                    .init()
                    .unwrap();
                MegatronOptimizer::new(adam, &model, solo(), 0)
            }
        };
        for _ in 0..20 {
            let g = grads(&model, DType::BF16);
            model = optim.step(1e-3, model, g).unwrap().0;
        }
        assert_eq!(model.weight.val().dtype(), DType::BF16);
        assert_eq!(
            weights(&model),
            rounded,
            "{kind:?}: the fp32 run, rounded once"
        );
    }
}

/// Megatron's weight-decay increment applied per step on both optimizer kinds: with zero
/// gradients Adam's update is 0, so each step multiplies every weight by exactly
/// `1 − lr·wd_at(step)`, and the bias (1-D, Megatron's no-decay group) stays put.
#[test]
fn the_weight_decay_schedule_is_applied_every_step() {
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::optim::AdamWConfig;
    use burn::tensor::Tensor;
    let device = Device::flex().autodiff();
    let scheduler = OptimizerParamScheduler::new(OptimizerParamSchedulerConfig {
        init_lr: 0.1,
        max_lr: 0.1,
        min_lr: 0.1,
        lr_warmup_steps: 0,
        lr_decay_steps: 10,
        lr_decay_style: LrDecayStyle::Constant,
        wsd_decay_steps: None,
        lr_wsd_decay_style: None,
        start_wd: 0.0,
        end_wd: 0.5,
        wd_incr_steps: 4,
        wd_incr_style: WdIncrStyle::Linear,
    })
    .unwrap();
    for kind in [Kind::Burn, Kind::Fused] {
        let mut model = Linear {
            weight: Param::from_tensor(Tensor::<2>::ones([3, 2], &device)),
            bias: Some(Param::from_tensor(Tensor::<1>::ones([2], &device))),
        };
        let mut optim = match kind {
            Kind::Burn => {
                let adamw = AdamWConfig::new().with_weight_decay(0.0);
                MegatronOptimizer::new(adamw.init(), &model, solo(), 0)
            }
            Kind::Fused => {
                let adam = FusedAdamConfig::new().init().unwrap();
                MegatronOptimizer::new(adam, &model, solo(), 0)
            }
        };
        let mut expected = 1.0f32;
        for step in 0..6 {
            let (lr, wd) = (scheduler.lr_at(step), scheduler.wd_at(step));
            optim.set_weight_decay(wd).unwrap();
            let x = Tensor::<2>::zeros([1, 3], &device);
            let zero = (model.forward(x) * 0.0).sum().backward();
            let grads = GradientsParams::from_grads(zero, &model);
            model = optim.step(lr, model, grads).unwrap().0;
            expected *= (1.0 - lr * wd) as f32;
            let w = values(model.weight.val());
            for v in &w {
                assert!(
                    (v - expected).abs() <= 1e-6 * expected,
                    "{kind:?} step {step} (wd {wd}): {v} vs {expected}"
                );
            }
            assert_eq!(values(model.bias.as_ref().unwrap().val()), vec![1.0, 1.0]);
        }
        assert!(expected < 0.85, "the schedule decayed: {expected}");
        let e = optim.set_weight_decay(f64::NAN).unwrap_err().to_string();
        assert!(e.contains("NaN"), "{e}");
    }
}
