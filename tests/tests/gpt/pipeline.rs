//! GPT across pipeline stages (1F1B and interleaved, with TP, SP, DP and the overlapped
//! reducer; even and uneven splits of the layers), tied and untied, 6 AdamW steps against
//! one rank running the same microbatches through a plain accumulation loop: losses and grad
//! norms per step, every weight a rank holds at the end under its global name, and the
//! layers each chunk holds.

use super::Error;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::DType;
use burn_megatron::comm::{Comm, CommunicatorExt, LocalWorld, ReduceOp};
use burn_megatron::data_parallel::{
    DataParallelConfig,
    advanced::{DpReduction, OverlapReducer, finalize_model_grads},
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{Gpt, GptConfig};
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::pipeline::{
    ForwardBackwardConfig, ForwardStep, GradSync, P2pShapes, PipelineSchedule,
    forward_backward_func,
};
use burn_megatron::topology::{LayerSplit, ParallelConfig, PipelineLayout, PipelinePosition};
use burn_megatron_tests::gpt::{
    causal_lm_step, gathered, gpt_rows, gpt2, llama, max_rel_diff, mean_reported_loss,
};
use burn_megatron_tests::values;
use std::collections::BTreeMap;
use std::sync::Arc;

const SAMPLES: usize = 4;
const SEQ: usize = 8;
const LAYERS: usize = 4;
const STEPS: usize = 6;

type Tensors = BTreeMap<String, Vec<f32>>;

/// (loss, grad norm) per step, and the final weights by global name.
struct Trace {
    steps: Vec<(f32, f32)>,
    weights: Tensors,
}

fn reference(config: &GptConfig) -> Trace {
    let device = burn::tensor::Device::flex().autodiff();
    let world = LocalWorld::new(1);
    let solo: Comm = Arc::new(world.communicator("solo", vec![0], 0).unwrap());
    let mut model = config.init(&solo, &device).unwrap();
    let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, solo.clone(), 0)
        .with_clip_grad(1.0, NormType::L2);
    let mut steps = Vec::new();
    for _ in 0..STEPS {
        let mut acc = GradientsAccumulator::new();
        let mut sum = 0.0;
        for g in 0..SAMPLES {
            let b = gpt_rows(g, 1, SEQ, &device);
            let loss = model
                .loss(model.forward(b.ids).unwrap(), b.labels, b.mask)
                .unwrap();
            sum += values(loss.clone())[0];
            let grads = (loss / SAMPLES as f32).backward();
            acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        let (m, report) = optim.step(1e-3, model, acc.grads()).unwrap();
        model = m;
        steps.push((sum / SAMPLES as f32, report.grad_norm.unwrap() as f32));
    }
    let weights = gathered(&model, None, &solo)
        .into_iter()
        .map(|(k, v)| (Gpt::global_param_name_at(&[0], &k), v))
        .collect();
    Trace { steps, weights }
}

#[derive(Debug, Clone, Copy)]
struct Layout {
    tp: usize,
    pp: usize,
    vp: usize,
    dp: usize,
    sp: bool,
    overlap: bool,
    split: LayerSplit,
    /// The layers each virtual stage (`chunk·pp + stage`) must hold.
    expect: &'static [usize],
}

/// A rank's losses (on last stages only), grad norms, weights and (first layer, layers) of
/// each chunk.
type RankTrace = (Option<Vec<f32>>, Vec<f32>, Tensors, Vec<(usize, usize)>);

/// Each rank's trace.
fn pipelined(config: &GptConfig, l: Layout) -> Vec<RankTrace> {
    let parallel = ParallelConfig::new(l.tp * l.pp * l.dp, l.tp, l.pp)
        .with_virtual_pipeline((l.vp > 1).then_some(l.vp))
        .with_layer_split(l.split);
    let config = (config.clone()).map_transformer(|t| t.with_sequence_parallel(l.sp));
    threads(&parallel, LaunchOptions::default(), |ctx| {
        let (tp, device) = (&ctx.groups.tp, &ctx.device);
        let mut chunks: Vec<Gpt> = (0..l.vp)
            .map(|c| config.init_stage(tp, PipelinePosition::of(&ctx.state, c), device))
            .collect::<Result<_, _>>()?;
        let tp_rank = ctx.state.tensor_model_parallel_rank();
        let mut optim = MegatronOptimizer::new(
            AdamWConfig::new().init(),
            &chunks,
            ctx.groups.mp.clone(),
            tp_rank,
        )
        .with_clip_grad(1.0, NormType::L2);
        let dp_config = DataParallelConfig::default();
        let reducers: Vec<OverlapReducer> = if l.overlap {
            ctx.chunk_data_parallel_groups(l.vp)?
                .iter()
                .zip(&chunks)
                .map(|(dp, chunk)| OverlapReducer::new(chunk, dp, &dp_config))
                .collect()
        } else {
            Vec::new()
        };
        let hooks: Vec<&dyn GradSync> = reducers.iter().map(|r| r as &dyn GradSync).collect();
        let p2p = ctx.p2p(P2pShapes::Fixed {
            dims: vec![SEQ / if l.sp { l.tp } else { 1 }, 1, 32],
            dtype: DType::F32,
        });
        let local = SAMPLES / l.dp;
        let first = ctx.state.data_parallel_rank() * local;
        let mut fb =
            ForwardBackwardConfig::new(PipelineSchedule::new(l.pp, local).with_model_chunks(l.vp));
        if l.overlap {
            fb.grad_sync = Some(&hooks);
        }
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for _ in 0..STEPS {
            let out = forward_backward_func(
                |s: ForwardStep<'_, Gpt, 3>| causal_lm_step(s, first, SEQ, device),
                &chunks,
                &p2p,
                fb,
            )?;
            let mut grads = out.grads;
            let (dp, emb) = (&ctx.groups.dp, ctx.groups.embedding.as_ref());
            if l.overlap {
                finalize_model_grads(
                    &chunks,
                    &mut grads,
                    DpReduction::Overlapped(&reducers),
                    tp,
                    emb,
                    &dp_config,
                )?;
            } else {
                finalize_model_grads(
                    &chunks,
                    &mut grads,
                    DpReduction::AllReduce(dp),
                    tp,
                    emb,
                    &dp_config,
                )?;
            }
            let (c, report) = optim.step(1e-3, chunks, grads)?;
            chunks = c;
            norms.push(report.grad_norm.unwrap() as f32);
            if !out.losses.is_empty() {
                let mut v = vec![mean_reported_loss(&out.losses, local)];
                dp.all_reduce_vec(&mut v, ReduceOp::Avg)?;
                losses.push(v[0]);
            }
        }
        let weights = gathered(&chunks, None, tp)
            .into_iter()
            .map(|(k, v)| (Gpt::global_param_name(&chunks, &k), v))
            .collect();
        let last = ctx.state.is_pipeline_last_stage();
        let held = chunks
            .iter()
            .map(|c| (c.first_layer(), c.layers.len()))
            .collect();
        Ok::<_, Error>((last.then_some(losses), norms, weights, held))
    })
    .unwrap()
}

fn check(name: &str, config: &GptConfig, layouts: &[Layout]) {
    let reference = reference(config);
    let r = &reference.steps;
    assert!(
        r[STEPS - 1].0 < r[0].0 - 0.05,
        "{name}: the loss must fall: {r:?}"
    );
    for &l in layouts {
        let mut reporters = 0;
        for (rank, (losses, norms, weights, held)) in pipelined(config, l).into_iter().enumerate() {
            let what = format!("{name} {l:?} rank {rank}");
            let stage = stage_of(rank, l);
            let expected: Vec<(usize, usize)> = (0..l.vp)
                .map(|c| {
                    let vs = c * l.pp + stage;
                    (l.expect[..vs].iter().sum(), l.expect[vs])
                })
                .collect();
            assert_eq!(
                held, expected,
                "{what}: (first layer, layers) of each chunk"
            );
            for (step, (n, r)) in norms.iter().zip(r).enumerate() {
                assert!(
                    (n - r.1).abs() <= 1e-4 * r.1,
                    "{what} step {step}: norm {n} vs {}",
                    r.1
                );
            }
            if let Some(losses) = losses {
                reporters += 1;
                for (step, (a, r)) in losses.iter().zip(r).enumerate() {
                    assert!(
                        (a - r.0).abs() <= 1e-5,
                        "{what} step {step}: loss {a} vs {}",
                        r.0
                    );
                }
            }
            let held: Tensors = reference
                .weights
                .iter()
                .filter(|(k, _)| weights.contains_key(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(
                held.len(),
                weights.len(),
                "{what}: every weight has a global name"
            );
            let (d, at) = max_rel_diff(&weights, &held, 1e-6);
            assert!(d <= 1e-5, "{what}: weight {at} differs by {d} (relative)");
        }
        assert_eq!(
            reporters,
            l.tp * l.dp,
            "{name} {l:?}: every last-stage rank reports"
        );
    }
}

/// The pipeline stage of global rank `rank` (the default order puts pp last).
fn stage_of(rank: usize, l: Layout) -> usize {
    rank / (l.tp * l.dp)
}

#[test]
fn gpt_pipelines_match_one_rank() {
    let layout = |tp, pp, vp, dp, sp, overlap| Layout {
        tp,
        pp,
        vp,
        dp,
        sp,
        overlap,
        split: LayerSplit::default(),
        expect: if pp * vp == 2 { &[2, 2] } else { &[1, 1, 1, 1] },
    };
    // Untied: no embedding-group reduction; tied: the last stage's copy is summed with the
    // first stage's.
    check(
        "llama",
        &llama(LAYERS, SEQ),
        &[
            layout(2, 2, 1, 1, true, false),
            layout(1, 2, 2, 2, false, true),
        ],
    );
    check(
        "gpt2",
        &gpt2(LAYERS, SEQ),
        &[
            layout(1, 2, 1, 2, false, true),
            layout(2, 2, 2, 1, false, false),
        ],
    );
}

/// Megatron's uneven splits: the first or last stage's layers set, or the embedding and the
/// loss counted as layers (chunks may then hold none).
#[test]
fn gpt_uneven_pipelines_match_one_rank() {
    let split = LayerSplit::default();
    let counted = split.with_embedding_counted(true).with_loss_counted(true);
    let layout = |tp, pp, vp, split, expect| Layout {
        tp,
        pp,
        vp,
        dp: 1,
        sp: tp > 1,
        overlap: false,
        split,
        expect,
    };
    check(
        "llama",
        &llama(LAYERS, SEQ),
        &[
            // 1 + 3.
            layout(2, 2, 1, split.with_first_stage(1), &[1, 3]),
            // 4 + 2 counted over 3 stages: 2 each, one fewer at either end.
            layout(1, 3, 1, counted, &[1, 2, 1]),
        ],
    );
    // Interleaved: the first rank's 2 layers and the last's 4 split over their 2 chunks.
    // (Megatron-Core 0.16.1 builds these layers but its offset function divides by the zero
    // middle stages.)
    check(
        "gpt2",
        &gpt2(6, SEQ),
        &[layout(
            1,
            2,
            2,
            split.with_first_stage(2).with_last_stage(4),
            &[1, 2, 1, 2],
        )],
    );
    // 2 layers + 2 counted over 4 stages: the first stage only embeds, the last only
    // computes the loss.
    check(
        "llama",
        &llama(2, SEQ),
        &[layout(1, 4, 1, counted, &[0, 1, 1, 0])],
    );
    // Megatron-Core's --pipeline-model-parallel-layout, every virtual stage written out: at
    // PP 2 × VP 2 the first chunk only embeds; at PP 4 the third stage holds nothing at all
    // (no layer, no embedding, no head: a chunk without parameters, which Megatron accepts).
    let written = |text| split.with_layout(PipelineLayout::parse(text).expect("a layout"));
    check(
        "llama",
        &llama(LAYERS, SEQ),
        &[
            layout(1, 2, 2, written("E|tt|t|tL"), &[0, 2, 1, 1]),
            layout(1, 4, 1, written("Et|t||ttL"), &[1, 1, 0, 2]),
            // The empty chunk's data-parallel reducer has nothing to reduce.
            Layout {
                dp: 2,
                overlap: true,
                ..layout(1, 4, 1, written("Et|t||ttL"), &[1, 1, 0, 2])
            },
        ],
    );
}
