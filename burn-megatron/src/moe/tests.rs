//! The router against megatron-core 0.16.1's `TopKRouter` on the fixtures that
//! `tests/fixtures/moe_router/make_router_fixtures.py` made: routing map, routing
//! probabilities, load-balancing counts, aux and z losses, and the logits' gradient, with
//! and without group-limited routing.

use super::*;
use crate::comm::LocalWorld;
use burn::tensor::TensorData;
use serde_json::Value;

fn fixtures() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/moe_router/router.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn ints(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

fn solo() -> Comm {
    Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap())
}

fn config_of(case: &Value) -> MoeConfig {
    let f = |k: &str| case[k].as_f64();
    MoeConfig::new(case["num_experts"].as_u64().unwrap() as usize)
        .with_moe_router_topk(case["topk"].as_u64().unwrap() as usize)
        .with_moe_router_score_function(match case["score_function"].as_str().unwrap() {
            "softmax" => ScoreFunction::Softmax,
            _ => ScoreFunction::Sigmoid,
        })
        .with_moe_router_pre_softmax(case["use_pre_softmax"].as_bool().unwrap())
        .with_moe_router_topk_scaling_factor(f("scaling_factor"))
        .with_moe_expert_capacity_factor(f("capacity_factor"))
        .with_moe_token_drop_policy(match case["drop_policy"].as_str().unwrap() {
            "probs" => DropPolicy::Probs,
            _ => DropPolicy::Position,
        })
        .with_moe_pad_expert_input_to_capacity(case["pad_to_capacity"].as_bool().unwrap())
        .with_moe_aux_loss_coeff(f("aux_loss_coeff").unwrap())
        .with_moe_z_loss_coeff(f("z_loss_coeff"))
        .with_moe_router_num_groups(case["num_groups"].as_u64().map(|g| g as usize))
        .with_moe_router_group_topk(case["group_topk"].as_u64().map(|g| g as usize))
}

fn assert_close(name: &str, what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: {what} length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{name}: {what}[{i}] = {g}, megatron-core {w}"
        );
    }
}

#[test]
fn router_matches_megatron_core() {
    let data = fixtures();
    let device = Device::flex().autodiff();
    let cases = data["cases"].as_array().unwrap();
    assert!(cases.len() >= 18);
    let grouped = cases.iter().filter(|c| c["group_topk"].is_u64()).count();
    assert_eq!(grouped, 4, "group-limited cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let config = config_of(case);
        config.validate(1).unwrap();
        let (t, e) = (
            case["num_tokens"].as_u64().unwrap() as usize,
            config.num_experts,
        );
        if let Some(cf) = config.moe_expert_capacity_factor {
            let want = case["capacity"].as_u64().unwrap() as usize;
            assert_eq!(
                expert_capacity(t, config.moe_router_topk, e, cf),
                want,
                "{name}"
            );
        }
        let logits =
            Tensor::<2>::from_data(TensorData::new(floats(&case["logits"]), [t, e]), &device)
                .require_grad();
        let out = route(&config, logits.clone(), &solo()).unwrap();
        let routing = &out.routing;
        let map: Vec<usize> = routing.routing_map().iter().map(|&m| m as usize).collect();
        assert_eq!(map, ints(&case["routing_map"]), "{name}: routing map");
        // The routed top-k's counts (the load-balancing loss's are those of the unlimited
        // top-k, which group-limited routing may not route).
        let before_drop = ints(&case["routing_map_before_drop"]);
        let routed: Vec<usize> = (0..e)
            .map(|x| (0..t).map(|token| before_drop[token * e + x]).sum())
            .collect();
        assert_eq!(
            routing.tokens_per_expert, routed,
            "{name}: tokens per expert"
        );
        let kept: Vec<usize> = routing.assignments.iter().map(Vec::len).collect();
        assert_eq!(kept, ints(&case["tokens_per_expert_after_drop"]), "{name}");
        let dense = routing.dense_probs();
        let got: Vec<f32> = dense.clone().into_data().try_to_vec::<f32>().unwrap();
        assert_close(
            name,
            "routing probs",
            &got,
            &floats(&case["routing_probs"]),
            1e-6,
        );

        let aux = out
            .aux_loss
            .clone()
            .expect("every case has an aux coefficient");
        let aux_value: f32 = aux.clone().into_scalar();
        assert_close(
            name,
            "aux loss",
            &[aux_value],
            &[case["aux_loss"].as_f64().unwrap() as f32],
            1e-6,
        );
        let z = out.z_loss.clone().expect("every case has a z coefficient");
        let z_value: f32 = z.clone().into_scalar();
        assert_close(
            name,
            "z loss",
            &[z_value],
            &[case["z_loss"].as_f64().unwrap() as f32],
            1e-6,
        );

        let w = Tensor::<2>::from_data(
            TensorData::new(floats(&case["grad_weights"]), [t, e]),
            &device,
        );
        let total = (dense * w).sum() + aux + z;
        let grads = total.backward();
        let grad: Vec<f32> = logits
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert_close(
            name,
            "logits gradient",
            &grad,
            &floats(&case["logits_grad"]),
            1e-5,
        );
    }
}

#[test]
fn bad_settings_are_refused_naming_the_numbers() {
    let msg = |c: MoeConfig, ep: usize| c.validate(ep).unwrap_err().to_string();
    assert!(msg(MoeConfig::new(6), 4).contains("6 experts over 4 expert-parallel ranks"));
    assert!(
        msg(MoeConfig::new(4).with_moe_router_topk(5), 1)
            .contains("--moe-router-topk 5 is greater than --num-experts 4")
    );
    assert!(
        msg(
            MoeConfig::new(4).with_moe_expert_capacity_factor(Some(0.0)),
            1
        )
        .contains("--moe-expert-capacity-factor must be positive, got 0")
    );
    assert!(
        msg(
            MoeConfig::new(4).with_moe_expert_capacity_factor(Some(-1.5)),
            1
        )
        .contains("got -1.5")
    );
}

/// A rank may get no row for its experts while its peers get some: with the sequence split
/// over TP 2 (and EP 2, DP 2 on 4 ranks), the router sends the first half's tokens to experts
/// 0–1 and the second half's to experts 2–3, so ranks 1 and 2 receive no row (and, with
/// expert TP 2, each has an expert-TP peer that does). Every exchange must still run in
/// forward and backward on every rank (a skipped one fails at the deadline), and the outputs
/// and the input gradients equal the layer on one rank, for both dispatchers.
#[test]
fn ranks_without_rows_take_part_in_every_exchange() {
    use crate::launch::{LaunchOptions, threads};
    use crate::topology::ParallelConfig;
    let (s, h) = (4, 4);
    // A token's sign picks its experts: positions 0–1 positive, 2–3 negative.
    let x: Vec<f32> = (0..s * h)
        .map(|i| (if i < 2 * h { 1.0 } else { -1.0 }) * (0.5 + (i % 5) as f32 / 8.0))
        .collect();
    let router: Vec<f32> = [1.0, 0.8, -1.0, -0.8]
        .iter()
        .flat_map(|&r| (0..h).map(move |j| r * (1.0 + j as f32 / 10.0)))
        .collect();
    let w: Vec<f32> = (0..s * h)
        .map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.4)
        .collect();
    let shape = MoeLayerShape {
        hidden_size: h,
        ffn_hidden_size: 8,
        gated_linear_unit: true,
        activation: ActivationFunc::Silu,
        initializer: MasterInit::Normal {
            mean: 0.0,
            std: 0.5,
        },
        output_initializer: MasterInit::Normal {
            mean: 0.0,
            std: 0.5,
        },
        sequence_parallel: true,
        seed: 7,
    };
    // (outputs, input gradient) of this rank's positions `from..from + len`.
    let run =
        |config: &MoeConfig, tp: &Comm, experts: &ExpertGroups, rank: (&Device, usize, usize)| {
            let (device, from, len) = rank;
            let mut layer = config.init(shape, tp, experts, device).unwrap();
            let data = |v: &[f32], dims: [usize; 3]| {
                Tensor::<3>::from_data(TensorData::new(v.to_vec(), dims), device)
            };
            let r = Tensor::<2>::from_data(TensorData::new(router.clone(), [4, h]), device);
            layer.router = layer.router.map(|_| r.require_grad());
            let mine = |v: &[f32]| v[from * h..(from + len) * h].to_vec();
            let input = data(&mine(&x), [len, 1, h]).require_grad();
            let out = layer.forward(input.clone()).unwrap();
            let loss = (out.clone() * data(&mine(&w), [len, 1, h])).sum();
            let grads = loss.backward();
            let values = |t: Tensor<3>| t.into_data().iter::<f32>().collect::<Vec<f32>>();
            (values(out.detach()), values(input.grad(&grads).unwrap()))
        };
    for dispatcher in [
        TokenDispatcherType::AllToAll,
        TokenDispatcherType::AllGather,
    ] {
        let config = MoeConfig::new(4).with_moe_token_dispatcher_type(dispatcher);
        let device = Device::flex().autodiff();
        let one = run(&config, &solo(), &ExpertGroups::solo(), (&device, 0, s));
        for etp in [1, 2] {
            let layout = ParallelConfig::new(4, 2, 1)
                .with_expert_parallel(2)
                .with_expert_tensor_parallel(etp);
            let options = LaunchOptions {
                timeout: std::time::Duration::from_secs(20),
                ..LaunchOptions::default()
            };
            let split = threads(&layout, options, |ctx| {
                let from = ctx.state.tensor_model_parallel_rank() * s / 2;
                let experts = ctx.groups.experts();
                let rank = (&ctx.device, from, s / 2);
                Ok::<_, String>((from, run(&config, &ctx.groups.tp, &experts, rank)))
            })
            .unwrap();
            for (rank, (from, (out, grad))) in split.into_iter().enumerate() {
                let (want_out, want_grad) = (&one.0[from * h..], &one.1[from * h..]);
                for (what, got, want) in
                    [("output", out, want_out), ("input grad", grad, want_grad)]
                {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{dispatcher:?} expert TP {etp} rank {rank}: {what}[{i}] = {g}, one rank {w}"
                        );
                    }
                }
            }
        }
    }
}
