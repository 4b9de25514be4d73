//! Checkpoint round trips: bit-identical resumption for both optimizers, and the errors.

use super::*;
use crate::comm::{Comm, LocalWorld};
use crate::optimizer::{FusedAdamConfig, cast_params, megatron_param_groups};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device};
use std::sync::Arc;

fn step(model: Linear, optim: &mut MegatronOptimizer<Linear>, k: usize) -> Linear {
    let device = model.weight.val().device();
    let x = Tensor::<2>::from_data(
        TensorData::new(
            (0..6)
                .map(|i| (i * (k + 1)) as f32 * 0.1)
                .collect::<Vec<_>>(),
            [2, 3],
        ),
        &device,
    )
    .cast(model.weight.val().dtype());
    let loss = model.forward(x).powi_scalar(2).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(1e-2, model, grads).unwrap().0
}

fn optimizer_for(fused: bool) -> impl Fn(&Linear) -> MegatronOptimizer<Linear> {
    move |model| {
        let comm: Comm = Arc::new(LocalWorld::new(1).communicator("mp", vec![0], 0).unwrap());
        if fused {
            // Weight and bias land in two flat groups (decay 0.5 and none).
            let adam = FusedAdamConfig::new().with_weight_decay(0.5);
            return MegatronOptimizer::fused_adam(adam.init().unwrap(), model, comm, 0);
        }
        // Biases without weight decay: an id-based group, which must match after loading.
        let adamw = AdamWConfig::new().with_weight_decay(0.5);
        let groups = megatron_param_groups(
            model,
            adamw.build(),
            adamw.with_weight_decay(0.0).build(),
            None,
        );
        MegatronOptimizer::new(groups, model, comm, 0)
    }
}

fn fresh(seed: u64, dtype: DType, fused: bool) -> (Linear, MegatronOptimizer<Linear>) {
    let device = Device::flex().autodiff();
    Device::seed(&device, seed);
    let model = cast_params(LinearConfig::new(3, 2).init(&device), dtype);
    let optim = optimizer_for(fused)(&model);
    (model, optim)
}

#[test]
fn a_loaded_run_continues_bit_identically() {
    for (dtype, fused) in [
        (DType::F32, false),
        (DType::BF16, false),
        (DType::F32, true),
        (DType::BF16, true),
    ] {
        let dir =
            std::env::temp_dir().join(format!("bm-ckpt-{}-{dtype:?}-{fused}", std::process::id()));
        let (mut model, mut optim) = fresh(1, dtype, fused);
        for k in 0..3 {
            model = step(model, &mut optim, k);
        }
        save_checkpoint(&dir, 3, &model, &optim, serde_json::json!({"note": 7})).unwrap();
        let mut cont = model;
        for k in 3..5 {
            cont = step(cont, &mut optim, k);
        }
        let (other, _) = fresh(2, dtype, fused);
        let r = load_checkpoint(&dir, other, |m| Ok(optimizer_for(fused)(m))).unwrap();
        assert_eq!((r.iteration, r.extra["note"].as_u64()), (3, Some(7)));
        let (mut resumed, mut optim) = (r.model, r.optimizer);
        for k in 3..5 {
            resumed = step(resumed, &mut optim, k);
        }
        let values = |m: &Linear| m.weight.val().into_data().iter::<f32>().collect::<Vec<_>>();
        let bias = |m: &Linear| {
            m.bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .iter::<f32>()
                .collect::<Vec<_>>()
        };
        assert_eq!(values(&resumed), values(&cont), "{dtype:?} fused {fused}");
        assert_eq!(bias(&resumed), bias(&cont), "{dtype:?} fused {fused}");
        assert_ne!(
            values(&resumed),
            values(&fresh(2, dtype, fused).0),
            "it trained"
        );
        assert_eq!(resumed.weight.id, cont.weight.id);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn another_architecture_is_a_mismatch() {
    let dir = std::env::temp_dir().join(format!("bm-ckpt-mismatch-{}", std::process::id()));
    let (model, optim) = fresh(1, DType::F32, false);
    save_checkpoint(&dir, 1, &model, &optim, serde_json::Value::Null).unwrap();
    let device = Device::flex().autodiff();
    let wider = LinearConfig::new(3, 4).init(&device);
    let Err(e) = load_checkpoint(&dir, wider, |m| Ok(optimizer_for(false)(m))) else {
        panic!("a wider layer must not load")
    };
    assert!(
        e.to_string()
            .contains("weight: saved shape [3, 2], model shape [3, 4]"),
        "{e}"
    );
    write_latest(&dir, 1).unwrap();
    assert_eq!(read_latest(&dir).unwrap(), Some(1));
    assert_eq!(
        rank_dir(&dir, 5, 1, None),
        dir.join("iter_0000005/mp_rank_01")
    );
    assert_eq!(
        rank_dir(&dir, 5, 1, Some(3)),
        dir.join("iter_0000005/mp_rank_01_003")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_loads_only_into_the_optimizer_kind_that_saved_it() {
    for fused in [false, true] {
        let dir = std::env::temp_dir().join(format!("bm-ckpt-kind-{}-{fused}", std::process::id()));
        let (model, optim) = fresh(1, DType::F32, fused);
        save_checkpoint(&dir, 1, &model, &optim, serde_json::Value::Null).unwrap();
        let Err(e) = load_checkpoint(&dir, fresh(2, DType::F32, fused).0, |m| {
            Ok(optimizer_for(!fused)(m))
        }) else {
            panic!("fused {fused}: the other optimizer kind must not load")
        };
        let expected = if fused {
            "saved by the fused Adam, loading into a burn-optim optimizer"
        } else {
            "saved by a burn-optim optimizer, loading into the fused Adam"
        };
        assert!(e.to_string().contains(expected), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
