//! `gradient_accumulation_fusion` in the parallel linear layers: the same training at every
//! TP × DP layout (f32), and f32 weight gradients for a bf16 model, accumulated over
//! micro-batches far more accurately than bf16 gradients.

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Device};
use burn_megatron_tests::mlp::*;
use burn_megatron_tests::*;

#[test]
fn fused_layers_train_like_plain_ones_at_every_layout() {
    let plain = run_layout(1, 1, Kind::Burn).remove(0);
    for (tp, dp) in [(1, 1), (2, 1), (2, 2), (4, 2)] {
        for (rank, (trace, _)) in run_layout_with(tp, dp, Kind::Burn, true).iter().enumerate() {
            assert_eq!(trace.len(), plain.0.len(), "{tp}×{dp}: step count");
            for (step, ((l, n), (pl, pn))) in trace.iter().zip(&plain.0).enumerate() {
                let at = format!("{tp}×{dp} rank {rank} step {step}");
                assert!((l - pl).abs() <= 1e-5, "{at}: loss {l} vs plain TP1 {pl}");
                assert!(
                    (n - pn).abs() <= 1e-5 * pn,
                    "{at}: norm {n} vs plain TP1 {pn}"
                );
            }
        }
    }
}

/// fc1's and fc2's weight gradients summed over `micro` micro-batches, as f32 values, and
/// the dtype the layers handed back.
fn accumulated(dtype: DType, fusion: bool, micro: usize) -> (Vec<f32>, Vec<f32>, DType) {
    let device = Device::flex().autodiff();
    let mut model = build_with(&solo(), &device, fusion);
    if dtype != DType::F32 {
        model = burn::module::Module::map(model, &mut CastAll(dtype));
    }
    let mut acc = GradientsAccumulator::new();
    for step in 0..micro {
        let l = loss(&model, step, &device, dtype) / micro as f64;
        acc.accumulate(&model, GradientsParams::from_grads(l.backward(), &model));
    }
    let grads = acc.grads();
    let g1 = grads.get::<2>(model.fc1.weight.id).unwrap();
    let g2 = grads.get::<2>(model.fc2.weight.id).unwrap();
    let dt = g1.dtype();
    (values(g1), values(g2), dt)
}

#[test]
fn bf16_weight_gradients_are_formed_and_accumulated_in_f32() {
    let micro = 8;
    let (t1, t2, _) = accumulated(DType::F32, false, micro);
    let (p1, p2, plain_dtype) = accumulated(DType::BF16, false, micro);
    let (f1, f2, fused_dtype) = accumulated(DType::BF16, true, micro);
    assert_eq!(plain_dtype, DType::BF16);
    assert_eq!(
        fused_dtype,
        DType::F32,
        "fused layers return f32 weight gradients"
    );
    // The bf16 model sees bf16 weights and activations either way; only the gradient's
    // precision differs, so both are compared with the f32 model's gradients.
    let err = |a: &[f32], b: &[f32]| {
        let scale = b.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
            / scale
    };
    let (plain, fused) = (
        err(&p1, &t1).max(err(&p2, &t2)),
        err(&f1, &t1).max(err(&f2, &t2)),
    );
    // What is left in the fused gradient is the bf16 forward (weights, activations).
    assert!(
        fused < 0.05,
        "fused bf16 gradient off by {fused} of its scale"
    );
    assert!(
        fused < 0.75 * plain,
        "f32 gradients ({fused}) must beat bf16 ones ({plain}) against the f32 model"
    );
}

/// An input of another dtype than the fused layer's weight stops with a message naming both
/// (the forward's signature has no room for an error), not deep inside a kernel.
#[test]
fn a_dtype_mismatch_in_the_fused_layer_names_both_dtypes() {
    use burn::tensor::Tensor;
    use burn_megatron::tensor_parallel::ColumnParallelLinearConfig;
    let device = Device::flex().autodiff();
    let layer = ColumnParallelLinearConfig::new(4, 4)
        .with_gradient_accumulation_fusion(true)
        .init(&solo(), &device)
        .unwrap();
    let layer = burn::module::Module::map(layer, &mut CastAll(DType::BF16));
    let x = Tensor::<2>::ones([2, 4], &device);
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| layer.forward(x)))
        .expect_err("an f32 input to a bf16 fused layer must not run");
    let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("F32") && msg.contains("BF16"), "{msg}");
}
