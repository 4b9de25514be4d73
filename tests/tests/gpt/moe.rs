//! Mixture of experts with expert parallelism: a Llama-style GPT whose MLPs are 4 experts
//! (top-2, load-balancing and z losses on), trained 10 AdamW steps at EP ∈ {2, 4} with both
//! token dispatchers and at TP 2 × EP 2 with sequence parallelism, against the same layout
//! at EP 1 (each rank holding every expert): every step's loss, the first step's gradients
//! (dense ones gathered over TP, experts under their global index) and the final weights.

use super::Error;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_megatron::comm::ReduceOp;
use burn_megatron::comm::tensor::all_reduce;
use burn_megatron::data_parallel::{
    DataParallelConfig, finalize_expert_grads, finalize_model_grads,
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::GptConfig;
use burn_megatron::moe::{MoeConfig, TokenDispatcherType};
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_tests::gpt::{gathered, gpt_rows, llama, max_rel_diff};
use burn_megatron_tests::values;
use std::collections::BTreeMap;

const GLOBAL_BATCH: usize = 4;
const SEQ: usize = 8;
const STEPS: usize = 10;

type Tensors = BTreeMap<String, Vec<f32>>;

struct Trace {
    losses: Vec<f32>,
    grads: Tensors,
    weights: Tensors,
}

fn moe_llama(dispatcher: TokenDispatcherType) -> GptConfig {
    llama(2, SEQ).with_moe(Some(
        MoeConfig::new(4)
            .with_moe_router_topk(2)
            .with_moe_ffn_hidden_size(Some(24))
            .with_moe_aux_loss_coeff(1e-2)
            .with_moe_z_loss_coeff(Some(1e-3))
            .with_moe_token_dispatcher_type(dispatcher),
    ))
}

/// `moe.local_experts.{i}` of a rank whose first expert is `first` → `moe.experts.{first+i}`.
fn global_expert_names(tensors: Tensors, first: usize) -> Tensors {
    tensors
        .into_iter()
        .map(|(name, v)| match name.split_once("moe.local_experts.") {
            Some((head, tail)) => {
                let (i, rest) = tail.split_once('.').expect("an expert's parameter");
                let global = first + i.parse::<usize>().expect("a local expert index");
                (format!("{head}moe.experts.{global}.{rest}"), v)
            }
            None => (name, v),
        })
        .collect()
}

/// Every rank's tensors under global names, in one map (replicas agree; the first is kept).
fn merged(traces: &[(Trace, usize)], pick: impl Fn(&Trace) -> &Tensors) -> Tensors {
    let mut out = Tensors::new();
    for (t, first) in traces {
        for (k, v) in global_expert_names(pick(t).clone(), *first) {
            out.entry(k).or_insert(v);
        }
    }
    out
}

fn run(config: &GptConfig, world: usize, tp: usize, ep: usize, sp: bool) -> Vec<(Trace, usize)> {
    let layout = ParallelConfig::new(world, tp, 1)
        .with_expert_parallel(ep)
        .with_sequence_parallel(sp);
    let config = config.clone().with_sequence_parallel(sp);
    threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let whole = PipelinePosition::whole();
        let mut model = config.init_stage_with_experts(g, Some(&ctx.groups.ep), whole, d)?;
        let first = model.layers[0]
            .moe
            .as_ref()
            .expect("layer 0 is MoE")
            .first_expert();
        let mut optim = MegatronOptimizer::new(
            AdamWConfig::new().init(),
            &model,
            ctx.groups.mp.clone(),
            ctx.state.tensor_model_parallel_rank(),
        )
        .with_expert_model_parallel(ctx.groups.expert_mp.clone())
        .with_clip_grad(1.0, NormType::L2);
        let dp = ctx.state.data_parallel_size();
        let local = GLOBAL_BATCH / dp;
        let b = gpt_rows(ctx.state.data_parallel_rank() * local, local, SEQ, d);
        let mask = Tensor::ones(b.mask.dims(), d);
        let (mut losses, mut first_grads) = (Vec::new(), None);
        let ddp = DataParallelConfig::default();
        for _ in 0..STEPS {
            let logits = model.forward(b.ids.clone())?;
            let loss = model.loss(logits, b.labels.clone(), mask.clone())?;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            finalize_model_grads(&model, &mut grads, &ctx.groups.dp, g, None, &ddp)?;
            finalize_expert_grads(&model, &mut grads, &ctx.groups.expert_dp, dp, &ddp)?;
            if first_grads.is_none() {
                first_grads = Some(gathered(&model, Some(&grads), g));
            }
            model = optim.step(1e-3, model, grads)?.0;
            losses.push(values(all_reduce(&*ctx.groups.dp, loss.inner(), ReduceOp::Avg)?)[0]);
        }
        Ok::<_, Error>((
            Trace {
                losses,
                grads: first_grads.unwrap_or_default(),
                weights: gathered(&model, None, g),
            },
            first,
        ))
    })
    .unwrap()
}

fn check(what: &str, got: &[(Trace, usize)], want: &[(Trace, usize)]) {
    for (step, (a, b)) in got[0].0.losses.iter().zip(&want[0].0.losses).enumerate() {
        assert!((a - b).abs() <= 1e-5, "{what} step {step}: loss {a} vs {b}");
    }
    let (g, at) = max_rel_diff(
        &merged(got, |t| &t.grads),
        &merged(want, |t| &t.grads),
        1e-6,
    );
    assert!(
        g <= 1e-5,
        "{what}: gradient of {at} differs by {g} (relative)"
    );
    let (w, at) = max_rel_diff(
        &merged(got, |t| &t.weights),
        &merged(want, |t| &t.weights),
        1e-6,
    );
    assert!(
        w <= 1e-5,
        "{what}: weight {at} differs by {w} after {STEPS} steps"
    );
}

#[test]
fn expert_parallel_matches_ep1_for_both_dispatchers() {
    for dispatcher in [
        TokenDispatcherType::AllToAll,
        TokenDispatcherType::AllGather,
    ] {
        let config = moe_llama(dispatcher);
        for world in [2, 4] {
            let reference = run(&config, world, 1, 1, false);
            let losses = &reference[0].0.losses;
            assert!(
                losses[STEPS - 1] < losses[0] - 0.1,
                "the loss must fall: {losses:?}"
            );
            let got = run(&config, world, 1, world, false);
            check(&format!("{dispatcher:?} EP {world}"), &got, &reference);
        }
    }
}

#[test]
fn tensor_and_expert_parallel_match_one_rank() {
    let config = moe_llama(TokenDispatcherType::AllToAll);
    let one = run(&config, 1, 1, 1, false);
    let got = run(&config, 2, 2, 2, true);
    check("TP 2 × EP 2 + SP", &got, &one);
}
