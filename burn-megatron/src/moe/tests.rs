//! The router against megatron-core 0.16.1's `TopKRouter` on the fixtures that
//! `tests/fixtures/moe_router/make_router_fixtures.py` made: routing map, routing
//! probabilities, load-balancing counts, aux and z losses, and the logits' gradient.

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
    assert!(cases.len() >= 14);
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
        assert_eq!(
            routing.tokens_per_expert,
            ints(&case["tokens_per_expert"]),
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
