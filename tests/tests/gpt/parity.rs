//! GPT at TP ∈ {1, 2, 4} × SP × DP ∈ {1, 2}, 10 AdamW steps with clipping, dropout off and a
//! fixed global batch, for a Llama-style and a GPT-2-style config: every step's loss, the
//! first step's gathered gradients (after `finalize_model_grads`) and the final gathered
//! weights against TP = 1, DP = 1.

use super::Error;
use burn::optim::{AdamWConfig, GradientsParams};
use burn_megatron::comm::ReduceOp;
use burn_megatron::comm::tensor::all_reduce;
use burn_megatron::data_parallel::DataParallelConfig;
use burn_megatron::data_parallel::advanced::{DpReduction, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::GptConfig;
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::gpt::{gathered, gpt_rows, gpt2, llama, max_rel_diff};
use burn_megatron_tests::values;
use std::collections::BTreeMap;

const GLOBAL_BATCH: usize = 4;
const SEQ: usize = 8;
const STEPS: usize = 10;

type Tensors = BTreeMap<String, Vec<f32>>;

/// Per rank: every step's loss, the first step's gradients, the last weights.
struct Trace {
    losses: Vec<f32>,
    grads: Tensors,
    weights: Tensors,
}

fn run(config: &GptConfig, tp: usize, dp: usize, sp: bool) -> Vec<Trace> {
    let layout = ParallelConfig::new(tp * dp, tp, 1);
    let config = (config.clone()).map_transformer(|t| t.with_sequence_parallel(sp));
    threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let mut model = config.init(g, d)?;
        let tp_rank = ctx.state.tensor_model_parallel_rank();
        let mut optim = MegatronOptimizer::new(
            AdamWConfig::new().init(),
            &model,
            ctx.groups.mp.clone(),
            tp_rank,
        )
        .with_clip_grad(1.0, NormType::L2);
        let local = GLOBAL_BATCH / dp;
        let b = gpt_rows(ctx.state.data_parallel_rank() * local, local, SEQ, d);
        let (mut losses, mut first_grads) = (Vec::new(), None);
        for _ in 0..STEPS {
            let logits = model.forward(b.ids.clone())?;
            let loss = model.loss(logits, b.labels.clone(), b.mask.clone())?;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            finalize_model_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.dp),
                g,
                None,
                &DataParallelConfig::default(),
            )?;
            if first_grads.is_none() {
                first_grads = Some(gathered(&model, Some(&grads), g));
            }
            model = optim.step(1e-3, model, grads)?.0;
            losses.push(values(all_reduce(&*ctx.groups.dp, loss.inner(), ReduceOp::Avg)?)[0]);
        }
        Ok::<_, Error>(Trace {
            losses,
            grads: first_grads.unwrap_or_default(),
            weights: gathered(&model, None, g),
        })
    })
    .unwrap()
}

fn check(name: &str, config: &GptConfig, layouts: &[(usize, usize, bool)]) {
    let one = run(config, 1, 1, false).remove(0);
    assert!(
        one.losses[STEPS - 1] < one.losses[0] - 0.1,
        "{name}: the loss must fall: {:?}",
        one.losses
    );
    for &(tp, dp, sp) in layouts {
        for (rank, t) in run(config, tp, dp, sp).into_iter().enumerate() {
            let what = format!("{name} tp {tp} dp {dp} sp {sp} rank {rank}");
            for (step, (a, b)) in t.losses.iter().zip(&one.losses).enumerate() {
                assert!((a - b).abs() <= 1e-5, "{what} step {step}: loss {a} vs {b}");
            }
            let (g, at) = max_rel_diff(&t.grads, &one.grads, 1e-6);
            assert!(
                g <= 1e-5,
                "{what}: gradient of {at} differs by {g} (relative)"
            );
            let (w, at) = max_rel_diff(&t.weights, &one.weights, 1e-6);
            assert!(
                w <= 1e-5,
                "{what}: weight {at} differs by {w} (relative) after {STEPS} steps"
            );
        }
    }
}

#[test]
fn llama_style_gpt_matches_one_rank_at_every_layout() {
    // 2 query groups: TP 2 at most.
    check(
        "llama",
        &llama(2, SEQ),
        &[(2, 1, false), (2, 1, true), (1, 2, false), (2, 2, true)],
    );
}

#[test]
fn gpt2_style_gpt_matches_one_rank_at_every_layout() {
    check(
        "gpt2",
        &gpt2(2, SEQ),
        &[(2, 1, false), (4, 1, true), (2, 2, false), (2, 2, true)],
    );
}
