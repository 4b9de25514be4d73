//! The distributed optimizer (ZeRO-1) at the library level: on synthetic gradients that differ
//! per data-parallel rank, reduce-scatter + sharded fused Adam + all-gather gives the weights
//! of all-reduce + fused Adam (up to the clipping norm's summation order), and each rank holds
//! exactly its shard of the state.

use crate::comm::{Comm, CommunicatorExt};
use crate::data_parallel::{
    DataParallelConfig,
    advanced::{OptimizerShards, ShardPlan, all_reduce_gradients, reduce_scatter_gradients},
};
use crate::launch::{self, LaunchOptions};
use crate::optimizer::{FusedAdamConfig, MegatronOptimizer, NormType, cast_params};
use crate::topology::ParallelConfig;
use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};

/// 5·3 + 3 + 3·7 + 7 = 46 elements: no bucket length divides by 4.
fn model(dtype: DType) -> Vec<Linear> {
    let device = Device::flex().autodiff();
    let m = vec![
        LinearConfig::new(5, 3).init(&device),
        LinearConfig::new(3, 7).init(&device),
    ];
    // Every rank starts from the same values (the init is random).
    let m = m
        .into_iter()
        .enumerate()
        .map(|(k, l)| {
            let set = |p: Param<Tensor<2>>| {
                p.map(|t| {
                    let n = t.shape().num_elements();
                    let v: Vec<f32> = (0..n)
                        .map(|i| ((i * 7 + k) % 13) as f32 * 0.1 - 0.6)
                        .collect();
                    Tensor::<1>::from_data(TensorData::new(v, [n]), &t.device())
                        .reshape(t.dims())
                        .require_grad()
                })
            };
            let bias = l.bias.map(|b| {
                b.map(|t| {
                    let n = t.dims()[0];
                    let v: Vec<f32> = (0..n).map(|i| (i + k) as f32 * 0.05).collect();
                    Tensor::<1>::from_data(TensorData::new(v, [n]), &t.device()).require_grad()
                })
            });
            Linear {
                weight: set(l.weight),
                bias,
            }
        })
        .collect();
    cast_params(m, dtype)
}

/// Rank `r`'s gradients at `step`: a function of both, so the data-parallel mean matters.
fn grads(model: &[Linear], r: usize, step: usize) -> GradientsParams {
    let mut g = GradientsParams::new();
    for (k, l) in model.iter().enumerate() {
        let w = l.weight.val();
        let n = w.shape().num_elements();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 3 + r * 5 + step * 11 + k) % 17) as f32 * 0.05 - 0.4)
            .collect();
        let t = Tensor::<1>::from_data(TensorData::new(v, [n]), &w.device()).reshape(w.dims());
        g.register(l.weight.id, t.cast(w.dtype()).inner());
        if let Some(b) = &l.bias {
            let ones = b.val().inner().ones_like();
            g.register(b.id, ones.mul_scalar(0.1 * (r + step) as f32));
        }
    }
    g
}

fn weights(model: &[Linear]) -> Vec<u32> {
    model
        .iter()
        .flat_map(|l| {
            let mut t = vec![l.weight.val().cast(DType::F32).reshape([-1])];
            t.extend(l.bias.as_ref().map(|b| b.val().cast(DType::F32)));
            t
        })
        .flat_map(|t: Tensor<1>| {
            t.into_data()
                .iter::<f32>()
                .map(f32::to_bits)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Five clipped AdamW steps on `dp` ranks, fused or burn-optim's; returns each rank's weights
/// and state elements (`0` for an unsharded burn-optim optimizer, which does not say).
fn train(dp: usize, distributed: bool, fused: bool, dtype: DType) -> Vec<(Vec<u32>, usize)> {
    let config = DataParallelConfig {
        bucket_size: Some(20),
        ..DataParallelConfig::default()
    };
    launch::threads(
        &ParallelConfig::new(dp, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let m = model(dtype);
            let dp_comm: Comm = ctx.groups.dp.clone();
            let (size, rank) = (dp_comm.group().size(), dp_comm.group().rank());
            let adam = FusedAdamConfig::new()
                .with_weight_decay(0.1)
                .init()
                .unwrap();
            let plan = ShardPlan::new(&m, size, rank, &config, false);
            let mp = ctx.groups.mp.clone();
            let shards = OptimizerShards::new(vec![plan.clone()], dp_comm.clone());
            let adamw = burn::optim::AdamWConfig::new()
                .with_weight_decay(0.0)
                .init();
            let mut optim = match (distributed, fused) {
                (true, true) => MegatronOptimizer::distributed(adam, &m, shards, mp, 0).unwrap(),
                (false, true) => MegatronOptimizer::new(adam, &m, mp, 0),
                (true, false) => MegatronOptimizer::distributed(adamw, &m, shards, mp, 0).unwrap(),
                (false, false) => MegatronOptimizer::new(adamw, &m, mp, 0),
            }
            .with_clip_grad(0.3, NormType::L2);
            if !fused {
                // The wrapper's decoupled decay (the fused Adam's is in its config).
                optim.set_weight_decay(0.1).unwrap();
            }
            let mut m = m;
            for step in 0..5 {
                let mut g = grads(&m, rank, step);
                if distributed {
                    reduce_scatter_gradients(&plan, &mut g, &dp_comm, &config).unwrap();
                } else {
                    all_reduce_gradients(&m, &mut g, &dp_comm, &config).unwrap();
                }
                let (next, report) = optim.step(1e-2, m, g).unwrap();
                assert!(report.clip_coeff < 1.0, "the test must clip");
                m = next;
            }
            Ok::<_, String>((weights(&m), optim.state_elements().unwrap_or(0)))
        },
    )
    .unwrap()
}

#[test]
fn zero1_gives_the_all_reduce_weights_and_shards_the_state_exactly() {
    for (dtype, fused) in [
        (DType::F32, true),
        (DType::BF16, true),
        (DType::F32, false),
        (DType::BF16, false),
    ] {
        for dp in [2, 3, 4] {
            let plain = train(dp, false, fused, dtype);
            let zero = train(dp, true, fused, dtype);
            for (r, ((w, _), (wz, _))) in plain.iter().zip(&zero).enumerate() {
                let at = format!("{dtype:?} fused {fused} dp {dp} rank {r}");
                assert_eq!(w.len(), wz.len(), "{at}");
                // The gradients, Adam and the all-gather agree bit for bit; the clipping norm
                // sums f32 partial sums per shard instead of per tensor, which can round
                // apart by an ulp (seen on an AVX2 machine: one step's norm 1 ulp apart, four
                // weights 8 ulps apart after five steps), so the weights are held to a few
                // roundings of their dtype at the weights' scale (a weight near zero is the
                // difference of two near 0.05): f32 1e-6, bf16 one ulp.
                let tol = if dtype == DType::F32 {
                    1e-6
                } else {
                    2f32.powi(-8)
                };
                let scale = w.iter().fold(0f32, |m, &a| m.max(f32::from_bits(a).abs()));
                for (i, (&a, &b)) in w.iter().zip(wz).enumerate() {
                    let (a, b) = (f32::from_bits(a), f32::from_bits(b));
                    assert!(
                        (a - b).abs() <= tol * scale,
                        "{at}: weight {i} {a:e} against {b:e} (scale {scale})"
                    );
                }
            }
            // State: master + 2 moments of exactly the owned elements, no element twice.
            let total = 46;
            let unsharded = if fused { 3 * total } else { 0 };
            assert!(plain.iter().all(|(_, s)| *s == unsharded));
            let held: Vec<usize> = zero.iter().map(|(_, s)| *s).collect();
            assert_eq!(
                held.iter().sum::<usize>(),
                3 * total,
                "{dtype:?} dp {dp}: {held:?}"
            );
            // Buckets close at 20+ elements, in reverse module order: [b1 (7), w1 (21)] = 28
            // and [b0 (3), w0 (15)] = 18, each padded to a multiple of dp; rank r owns
            // [r·L/dp, (r+1)·L/dp) of each, less the padding.
            let expected: Vec<usize> = (0..dp)
                .map(|r| {
                    [28usize, 18]
                        .iter()
                        .map(|&used| {
                            let part = used.div_ceil(dp);
                            (used.min((r + 1) * part)).saturating_sub(r * part)
                        })
                        .sum::<usize>()
                        * 3
                })
                .collect();
            assert_eq!(held, expected, "{dtype:?} dp {dp}");
            println!(
                "{dtype:?} fused {fused} dp {dp}: state per rank {held:?} elements = {:.2} bytes per parameter (12 without)",
                4.0 * held[0] as f64 / total as f64
            );
        }
    }
}

#[test]
fn a_plan_for_another_group_is_refused() {
    launch::threads(
        &ParallelConfig::new(2, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let m = model(DType::F32);
            let adam = FusedAdamConfig::new().init().unwrap();
            let wrong = ShardPlan::new(&m, 4, 0, &DataParallelConfig::default(), false);
            let e = MegatronOptimizer::distributed(
                adam,
                &m,
                OptimizerShards::new(vec![wrong.clone()], ctx.groups.dp.clone()),
                ctx.groups.mp.clone(),
                0,
            )
            .unwrap_err();
            assert!(e.to_string().contains("rank 0 of 4"), "{e}");
            let mut g = grads(&m, 0, 0);
            let e = reduce_scatter_gradients(
                &wrong,
                &mut g,
                &ctx.groups.dp,
                &DataParallelConfig::default(),
            )
            .unwrap_err();
            assert!(e.to_string().contains("plan is for rank 0 of 4"), "{e}");
            // Both ranks still agree afterwards (nothing was issued).
            let mut v = vec![1i64];
            ctx.groups
                .dp
                .all_reduce_vec(&mut v, crate::comm::ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            assert_eq!(v, vec![2]);
            Ok::<_, String>(())
        },
    )
    .unwrap();
}

#[test]
fn a_plan_owns_every_element_once() {
    let m = model(DType::F32);
    let config = DataParallelConfig {
        bucket_size: Some(20),
        ..DataParallelConfig::default()
    };
    for dp in 1..=5 {
        let mut owned = vec![0usize; 46];
        let offsets: std::collections::HashMap<_, _> = {
            let mut at = 0;
            let mut map = std::collections::HashMap::new();
            for (id, _) in crate::param_grads::float_params(&m) {
                map.insert(id, at);
                at += m
                    .iter()
                    .flat_map(|l| {
                        let mut v = vec![(l.weight.id, l.weight.val().shape().num_elements())];
                        v.extend(
                            l.bias
                                .as_ref()
                                .map(|b| (b.id, b.val().shape().num_elements())),
                        );
                        v
                    })
                    .find(|(i, _)| *i == id)
                    .unwrap()
                    .1;
            }
            map
        };
        for r in 0..dp {
            let plan = ShardPlan::new(&m, dp, r, &config, false);
            assert!(
                plan.buckets()
                    .iter()
                    .all(|b| b.len % dp == 0 && b.len >= b.used())
            );
            for p in plan.pieces() {
                for e in p.start..p.start + p.len {
                    owned[offsets[&p.id] + e] += 1;
                }
            }
        }
        assert!(owned.iter().all(|&c| c == 1), "dp {dp}: {owned:?}");
    }
}

/// An inf in one rank's gradient skips the step on every rank under the distributed
/// optimizer, fused or burn-optim's: the sharded pieces' one sum-of-squares read finds it on
/// the rank that owns it after the reduce-scatter, and the ranks agree. The optimizers stand
/// for tensor-parallel rank 1, where duplicated parameters do not count in the norm: only
/// the overflow check can see the inf.
#[test]
fn an_inf_gradient_on_one_rank_skips_the_sharded_step_everywhere() {
    let config = DataParallelConfig {
        bucket_size: Some(20),
        ..DataParallelConfig::default()
    };
    for fused in [false, true] {
        let out = launch::threads(
            &ParallelConfig::new(2, 1, 1),
            LaunchOptions::default(),
            |ctx| {
                let m = model(DType::F32);
                let dp: Comm = ctx.groups.dp.clone();
                let (size, rank) = (dp.group().size(), dp.group().rank());
                let plan = ShardPlan::new(&m, size, rank, &config, false);
                let shards = OptimizerShards::new(vec![plan.clone()], dp.clone());
                let mp = ctx.groups.mp.clone();
                let mut optim = if fused {
                    let adam = FusedAdamConfig::new().init().unwrap();
                    MegatronOptimizer::distributed(adam, &m, shards, mp, 1).unwrap()
                } else {
                    let adamw = burn::optim::AdamWConfig::new().init();
                    MegatronOptimizer::distributed(adamw, &m, shards, mp, 1).unwrap()
                };
                let before = weights(&m);
                let mut g = grads(&m, rank, 0);
                if rank == 1 {
                    // The last element of the second layer's weight gradient.
                    let id = m[1].weight.id;
                    let w: Tensor<2> = Tensor::from_inner(g.remove(id).unwrap());
                    let w = w.slice_fill([2..3, 6..7], f32::INFINITY);
                    g.register(id, w.inner());
                }
                reduce_scatter_gradients(&plan, &mut g, &dp, &config).unwrap();
                let (m, report) = optim.step(1e-2, m, g).unwrap();
                Ok::<_, String>((report.updated, weights(&m) == before))
            },
        )
        .unwrap();
        assert_eq!(out, vec![(false, true); 2], "fused {fused}");
    }
}
