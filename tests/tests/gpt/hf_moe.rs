//! Hugging Face Mixtral (`MixtralForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`, with a
//! gated shared expert), 4 experts, top-2, made by `transformers` (tests/fixtures/
//! hf_mixtral_tiny, hf_qwen2_moe_tiny) at EP 1, at EP 2 × DP 2 (each rank holding half the
//! experts and the whole batch), at TP 2 × EP 2 with sequence parallelism, and at TP 2 × EP 2
//! × expert TP 2 (each expert split over the TP ranks): the logits, the loss and every
//! parameter's gradient, the experts' compared with transformers' fused `gate_up_proj` /
//! `down_proj` gradients; and export from EP 2 and from TP 2 × EP 2 × expert TP 2 gives the
//! checkpoint back.

use super::Error;
use super::hf::{Fixture, check_against, forward_then};
use burn_megatron::data_parallel::{
    DataParallelConfig,
    advanced::{DpReduction, finalize_expert_grads, finalize_model_grads},
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{HfGptConfig, load_hf_gpt_weights, read_hf_tensors, save_hf_gpt};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_tests::fixture;
use burn_megatron_tests::read_safetensors;
use std::collections::BTreeMap;

const NAMES: [&str; 2] = ["hf_mixtral_tiny", "hf_qwen2_moe_tiny"];

/// Our per-expert gradients, under the checkpoint's names (Mixtral's
/// `…block_sparse_moe.experts.{e}.w1.weight`, Qwen2-MoE's `…mlp.experts.{e}.gate_proj.weight`),
/// as transformers' in-memory ones: `mlp.experts.gate_up_proj[e]` = the gate's rows then the
/// up projection's, `mlp.experts.down_proj[e]`, and the router as `mlp.gate.weight`.
fn fused(grads: Vec<(String, Vec<f64>)>) -> BTreeMap<String, Vec<f64>> {
    let mut out = BTreeMap::new();
    let mut experts: BTreeMap<(String, usize, usize), Vec<f64>> = BTreeMap::new();
    for (name, g) in grads {
        let name = name.replace(".block_sparse_moe.", ".mlp.");
        let Some((layer, rest)) = name.split_once(".mlp.experts.") else {
            out.insert(name, g);
            continue;
        };
        let (e, w) = rest.split_once('.').expect("experts.{e}.{linear}.weight");
        let role = match w.trim_end_matches(".weight") {
            "w1" | "gate_proj" => 0,
            "w3" | "up_proj" => 1,
            "w2" | "down_proj" => 2,
            other => panic!("an expert's {other}"),
        };
        experts.insert((layer.to_string(), e.parse().unwrap(), role), g);
    }
    let layers: std::collections::BTreeSet<String> = experts.keys().map(|k| k.0.clone()).collect();
    for layer in layers {
        let n = experts.keys().filter(|k| k.0 == layer).count() / 3;
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..n {
            let get = |role: usize| experts[&(layer.clone(), e, role)].clone();
            gate_up.extend(get(0));
            gate_up.extend(get(1));
            down.extend(get(2));
        }
        out.insert(format!("{layer}.mlp.experts.gate_up_proj"), gate_up);
        out.insert(format!("{layer}.mlp.experts.down_proj"), down);
    }
    out
}

#[test]
fn moe_logits_loss_and_gradients_are_reproduced_with_expert_parallelism() {
    for name in NAMES {
        reproduced(name);
    }
}

fn reproduced(name: &str) {
    let expected: Fixture = read_safetensors(&fixture(name).join("expected.safetensors"));
    let hf = HfGptConfig::from_file(&fixture(name).join("config.json")).unwrap();
    let tensors = read_hf_tensors(&fixture(name)).unwrap();
    // (world, TP, EP, expert TP, sequence parallel)
    let layouts = [
        (1, 1, 1, 1, false),
        (2, 1, 2, 1, false),
        (2, 2, 2, 1, true),
        (4, 2, 2, 2, true),
    ];
    for (world, tp, ep, etp, sp) in layouts {
        let layout = ParallelConfig::new(world, tp, 1)
            .with_expert_parallel(ep)
            .with_expert_tensor_parallel(etp);
        let config = (hf.to_gpt_config(tp)).map_transformer(|t| t.with_sequence_parallel(sp));
        let out = threads(&layout, LaunchOptions::default(), |ctx| {
            let device = ctx.device.clone().autodiff();
            let (g, whole) = (&ctx.groups.tp, PipelinePosition::whole());
            let model =
                config.init_stage_with_experts(g, Some(&ctx.groups.experts()), whole, &device)?;
            let model = load_hf_gpt_weights(model, &hf, &tensors)?;
            let dp = ctx.state.data_parallel_size();
            let ddp = DataParallelConfig::default();
            forward_then(&model, &hf, &expected, &device, |grads| {
                finalize_model_grads(
                    &model,
                    grads,
                    DpReduction::AllReduce(&ctx.groups.dp),
                    g,
                    None,
                    &ddp,
                )?;
                finalize_expert_grads(
                    &model,
                    grads,
                    DpReduction::AllReduce(&ctx.groups.expert_dp),
                    dp,
                    &ddp,
                )?;
                Ok(())
            })
        })
        .unwrap();
        for (rank, o) in out.into_iter().enumerate() {
            let what = format!("{name} TP {tp} EP {ep} ETP {etp} rank {rank}");
            let grads: Vec<(String, Vec<f64>)> = fused(o.grads.clone()).into_iter().collect();
            check_against(&what, &o, &grads, &expected);
        }
    }
}

#[test]
fn moe_checkpoints_export_back_from_expert_parallel_ranks() {
    for name in NAMES {
        // (world, TP, expert TP)
        for (world, tp, etp) in [(2, 1, 1), (4, 2, 2)] {
            exported(
                name,
                ParallelConfig::new(world, tp, 1).with_expert_tensor_parallel(etp),
            );
        }
    }
}

/// Export at `layout` with EP 2.
fn exported(name: &str, layout: ParallelConfig) {
    let dir = std::env::temp_dir().join(format!(
        "burn_megatron_{name}_export_{}_{}",
        layout.world_size,
        std::process::id()
    ));
    let hf = HfGptConfig::from_file(&fixture(name).join("config.json")).unwrap();
    let tensors = read_hf_tensors(&fixture(name)).unwrap();
    let tp = layout.tensor_model_parallel_size;
    let layout = layout.with_expert_parallel(2);
    threads(&layout, LaunchOptions::default(), |ctx| {
        let whole = PipelinePosition::whole();
        let model = hf.to_gpt_config(tp).init_stage_with_experts(
            &ctx.groups.tp,
            Some(&ctx.groups.experts()),
            whole,
            &ctx.device,
        )?;
        let model = load_hf_gpt_weights(model, &hf, &tensors)?;
        // Each EP rank writes the same gathered checkpoint; rank 0's is read back.
        let mine = dir.join(ctx.state.global_rank().to_string());
        save_hf_gpt(&model, &hf, &mine)?;
        Ok::<_, Error>(())
    })
    .unwrap();
    let exported = read_hf_tensors(&dir.join("0")).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut got: Vec<&String> = exported.keys().collect();
    got.sort();
    assert_eq!(got, names, "the same tensor names");
    for (n, t) in &tensors {
        assert_eq!(exported[n], *t, "{n} round-trips bit for bit");
    }
    let back = HfGptConfig::from_file(&dir.join("0").join("config.json")).unwrap();
    assert_eq!(back.experts, hf.experts);
    assert!(
        hf.experts
            .is_some_and(|e| e.num_experts == 4 && e.top_k == 2)
    );
    assert_eq!(
        back.to_gpt_config(1).to_string(),
        hf.to_gpt_config(1).to_string()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
