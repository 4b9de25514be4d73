//! Activation recomputation against the same layout without it, dropout on: 10 AdamW
//! steps of a Llama-style and a GPT-2-style model per granularity and method, at TP 2 × PP 2
//! (1F1B, sequence parallel), TP 2 × PP 2 interleaved, and DP 2 with the overlapped
//! reducer and the distributed optimizer. Losses, grad norms and every weight a rank holds
//! must agree; the run also shows where they agree bit for bit. BERT runs one case.
//!
//! The chunked attention (`--attention-backend chunked`, which recomputes each query
//! block's probabilities in backward) is held to the same standard against the unfused one:
//! bit for bit in one block, within f32 summation error in several.

use super::Error;
use burn::optim::AdamWConfig;
use burn::tensor::DType;
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{Gpt, GptConfig, GptStageOutput};
use burn_megatron::optimizer::InnerOptimizer;
use burn_megatron::optimizer::NormType;
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule,
    forward_backward_func,
};
use burn_megatron::recompute::{
    RecomputeConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule,
};
use burn_megatron::tensor_parallel::RngTracker;
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron::training::ParallelTrainingConfig;
use burn_megatron_tests::gpt::{gathered, gpt_rows, gpt2, llama, max_rel_diff, mean_reported_loss};
use std::collections::BTreeMap;
use std::sync::Arc;

const SAMPLES: usize = 4;
const SEQ: usize = 8;
const LAYERS: usize = 4;
const STEPS: usize = 10;

/// Per rank: losses (last stages), grad norms, final weights by global name.
type Trace = Vec<(Option<Vec<f32>>, Vec<f32>, BTreeMap<String, Vec<f32>>)>;

#[derive(Debug, Clone, Copy)]
struct Layout {
    tp: usize,
    pp: usize,
    vp: usize,
    dp: usize,
    sp: bool,
    /// Overlapped reduction and the distributed optimizer.
    zero: bool,
}

fn train(config: &GptConfig, l: Layout) -> Trace {
    let parallel = ParallelConfig::new(l.tp * l.pp * l.dp, l.tp, l.pp)
        .with_virtual_pipeline((l.vp > 1).then_some(l.vp));
    let config = (config.clone()).map_transformer(|t| t.with_sequence_parallel(l.sp));
    threads(&parallel, LaunchOptions::default(), |ctx| {
        let (tp, device) = (&ctx.groups.tp, &ctx.device);
        let mut chunks: Vec<Gpt> = (0..l.vp)
            .map(|c| config.init_stage(tp, PipelinePosition::of(&ctx.state, c), device))
            .collect::<Result<_, _>>()?;
        let firsts: Vec<usize> = chunks.iter().map(Gpt::first_layer).collect();
        let training = ParallelTrainingConfig::new()
            .with_overlap_grad_reduce(l.zero)
            .with_use_distributed_optimizer(l.zero)
            .init(
                &ctx,
                &chunks,
                Arc::new(move |p: &str| Gpt::global_param_name_at(&firsts, p)),
            )?;
        let mut optim = training
            .optimizer(InnerOptimizer::from(AdamWConfig::new().init()), &chunks)?
            .with_clip_grad(1.0, NormType::L2);
        // Megatron's seeds: one per pipeline stage, the model-parallel stream per TP rank.
        let pp_rank = ctx.state.pipeline_model_parallel_rank();
        let rng = RngTracker::new(
            77 + 100 * pp_rank as u64,
            ctx.state.tensor_model_parallel_rank(),
        );
        let p2p = ctx.p2p(P2pShapes::Fixed {
            dims: vec![SEQ / if l.sp { l.tp } else { 1 }, 1, 32],
            dtype: DType::F32,
        });
        let local = SAMPLES / l.dp;
        let first = ctx.state.data_parallel_rank() * local;
        let hooks = training.grad_sync();
        let mut fb =
            ForwardBackwardConfig::new(PipelineSchedule::new(l.pp, local).with_model_chunks(l.vp));
        fb.grad_sync = hooks.as_deref();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for _ in 0..STEPS {
            let out = forward_backward_func(
                |s: ForwardStep<'_, Gpt, 3>| -> Result<ChunkOutput<3>, Error> {
                    let b = gpt_rows(first + s.microbatch, 1, SEQ, device);
                    let ids = s.input.is_none().then_some(b.ids);
                    let model = s.model;
                    Ok(match model.forward_stage(ids, s.input, Some(&rng))? {
                        GptStageOutput::Hidden(h) => ChunkOutput::Activation(h),
                        GptStageOutput::Logits(logits) => {
                            let loss = model.loss(logits, b.labels, b.mask)?;
                            let report = vec![loss.clone()];
                            ChunkOutput::Loss { loss, report }
                        }
                    })
                },
                &chunks,
                &p2p,
                fb,
            )?;
            let mut grads = out.grads;
            training.finalize(&chunks, &mut grads)?;
            let (c, report) = optim.step(1e-3, chunks, grads)?;
            chunks = c;
            norms.push(report.grad_norm.unwrap() as f32);
            if !out.losses.is_empty() {
                let mut v = vec![mean_reported_loss(&out.losses, local)];
                ctx.groups.dp.all_reduce_vec(&mut v, ReduceOp::Avg)?;
                losses.push(v[0]);
            }
        }
        let weights = gathered(&chunks, None, tp)
            .into_iter()
            .map(|(k, v)| (Gpt::global_param_name(&chunks, &k), v))
            .collect();
        let last = ctx.state.is_pipeline_last_stage();
        Ok::<_, Error>((last.then_some(losses), norms, weights))
    })
    .unwrap()
}

/// The largest difference between two runs' losses, grad norms and weights (relative to
/// the larger magnitude, floored at 1e-6), and where it is.
fn max_difference(base: &Trace, run: &Trace) -> (f32, String) {
    let mut worst = (0.0f32, String::from("nowhere"));
    let mut see = |d: f32, at: String| {
        if d > worst.0 {
            worst = (d, at);
        }
    };
    let rel = |a: f32, b: f32| (a - b).abs() / a.abs().max(b.abs()).max(1e-6);
    for (rank, (b, r)) in base.iter().zip(run).enumerate() {
        for (step, (x, y)) in b.0.iter().flatten().zip(r.0.iter().flatten()).enumerate() {
            see(rel(*x, *y), format!("rank {rank} loss of step {step}"));
        }
        assert_eq!(b.0.as_ref().map(Vec::len), r.0.as_ref().map(Vec::len));
        for (step, (x, y)) in b.1.iter().zip(&r.1).enumerate() {
            see(rel(*x, *y), format!("rank {rank} grad norm of step {step}"));
        }
        assert_eq!(
            b.2.keys().collect::<Vec<_>>(),
            r.2.keys().collect::<Vec<_>>()
        );
        let (d, at) = max_rel_diff(&r.2, &b.2, 1e-6);
        see(d, format!("rank {rank} weight {at}"));
    }
    worst
}

fn cases() -> Vec<(&'static str, RecomputeConfig)> {
    let full = |method, n| {
        RecomputeConfig::new()
            .with_granularity(Some(RecomputeGranularity::Full))
            .with_method(Some(method))
            .with_num_layers(Some(n))
    };
    let selective = |modules| {
        RecomputeConfig::new()
            .with_granularity(Some(RecomputeGranularity::Selective))
            .with_modules(modules)
    };
    vec![
        ("full uniform 1", full(RecomputeMethod::Uniform, 1)),
        ("full uniform 2", full(RecomputeMethod::Uniform, 2)),
        ("full block 1", full(RecomputeMethod::Block, 1)),
        (
            "selective core_attn",
            selective(vec![RecomputeModule::CoreAttn]),
        ),
        (
            "selective core_attn,mlp",
            selective(vec![RecomputeModule::CoreAttn, RecomputeModule::Mlp]),
        ),
        (
            "selective core_attn,layernorm",
            selective(vec![RecomputeModule::CoreAttn, RecomputeModule::Layernorm]),
        ),
        (
            "selective mlp_act",
            selective(vec![RecomputeModule::MlpAct]),
        ),
        (
            "selective layernorm,mlp_act",
            selective(vec![RecomputeModule::Layernorm, RecomputeModule::MlpAct]),
        ),
    ]
}

#[test]
fn recomputation_changes_nothing_but_memory() {
    let layout = |tp, pp, vp, dp, sp, zero| Layout {
        tp,
        pp,
        vp,
        dp,
        sp,
        zero,
    };
    let layouts = [
        layout(2, 2, 1, 1, true, false),
        layout(2, 2, 2, 1, false, false),
        layout(1, 2, 1, 2, false, true),
    ];
    let with_dropout = |c: GptConfig| {
        c.map_transformer(|mut t| {
            t.attention.attention_dropout = 0.1;
            t.with_hidden_dropout(0.1)
        })
    };
    for (model, config) in [
        ("llama", with_dropout(llama(LAYERS, SEQ))),
        ("gpt2", with_dropout(gpt2(LAYERS, SEQ))),
    ] {
        for l in layouts {
            let base = train(&config, l);
            for (case, recompute) in cases() {
                let run = train(
                    &(config.clone()).map_transformer(|t| t.with_recompute(recompute.clone())),
                    l,
                );
                let (d, at) = max_difference(&base, &run);
                println!("{model} {case} {l:?}: max relative difference {d:e} ({at})");
                // Bit for bit where the run says 0. LayerNorm and RMSNorm are fused ops, so a
                // replayed norm hands its input the same one gradient tensor as a kept one.
                let bound = 1e-6;
                assert!(
                    d <= bound,
                    "{model} {case} {l:?}: {at} differs by {d:e} (relative)"
                );
            }
        }
    }
}

/// The GPT family's attention in query blocks (grouped queries, causal, dropout) at TP 2 ×
/// PP 2 with sequence parallelism and DP 2 with the distributed optimizer, against the
/// unfused attention: one block of all `SEQ` rows gives the same bits over 10 steps; blocks
/// of 3 rows (the last shorter, and the causal blocks multiplying 3, 6 and 8 keys) sum in
/// another order, within 5e-6.
#[test]
fn chunked_attention_changes_nothing_but_memory() {
    use burn_megatron::models::AttnBackend;
    let layouts = [
        Layout {
            tp: 2,
            pp: 2,
            vp: 1,
            dp: 1,
            sp: true,
            zero: false,
        },
        Layout {
            tp: 1,
            pp: 1,
            vp: 1,
            dp: 2,
            sp: false,
            zero: true,
        },
    ];
    let chunked = |c: &GptConfig, rows: usize| {
        (c.clone()).map_transformer(|mut t| {
            t.attention.attention_backend = AttnBackend::Chunked;
            t.attention.attention_query_chunk = rows;
            t
        })
    };
    for (model, config) in [("llama", llama(2, SEQ)), ("gpt2", gpt2(2, SEQ))] {
        let config = config.map_transformer(|mut t| {
            t.attention.attention_dropout = 0.1;
            t.with_hidden_dropout(0.1)
        });
        for l in layouts {
            let base = train(&config, l);
            for (rows, bound) in [(SEQ, 0.0), (3, 5e-6)] {
                let (d, at) = max_difference(&base, &train(&chunked(&config, rows), l));
                println!("{model} chunked by {rows} {l:?}: max relative difference {d:e} ({at})");
                assert!(
                    d <= bound,
                    "{model} chunked by {rows} {l:?}: {at} differs by {d:e} (relative)"
                );
            }
        }
    }
}

/// BERT (post-LayerNorm, padding mask) at TP 2 with sequence parallelism and dropout:
/// gathered gradients of three steps' models, each recomputation against none, and the
/// chunked attention against the unfused.
#[test]
fn bert_recomputes_too() {
    use burn_megatron::models::AttnBackend;
    use burn_megatron_tests::bert::{bert, bert_rows};
    let config = bert(2, (32, 4, 64), 16, 128).map_transformer(|t| t.with_sequence_parallel(true));
    let run = |recompute: RecomputeConfig, query_chunk: Option<usize>| {
        let parallel = ParallelConfig::new(2, 2, 1);
        let config = (config.clone()).map_transformer(|mut t| {
            if let Some(rows) = query_chunk {
                t.attention.attention_backend = AttnBackend::Chunked;
                t.attention.attention_query_chunk = rows;
            }
            t.with_recompute(recompute)
        });
        threads(&parallel, LaunchOptions::default(), |ctx| {
            let (tp, device) = (&ctx.groups.tp, &ctx.device);
            let mut model = config.init(tp, device)?;
            let rng = RngTracker::new(5, ctx.state.tensor_model_parallel_rank());
            let mut optim = burn_megatron::optimizer::MegatronOptimizer::new(
                AdamWConfig::new().init(),
                &model,
                ctx.groups.mp.clone(),
                ctx.state.tensor_model_parallel_rank(),
            );
            let mut out = BTreeMap::new();
            for step in 0..3 {
                let b = bert_rows(2 * step, 2, 16, device);
                let output = model.forward(b.ids, b.types, b.padding, Some(&rng));
                let (lm, sop) = model.loss(output, b.labels, b.mask, b.sop)?;
                let grads = burn::optim::GradientsParams::from_grads((lm + sop).backward(), &model);
                for (k, v) in gathered(&model, Some(&grads), tp) {
                    out.insert(format!("step {step} {k}"), v);
                }
                model = optim.step(1e-3, model, grads)?.0;
            }
            Ok::<_, Error>(out)
        })
        .unwrap()
    };
    let base = run(RecomputeConfig::new(), None);
    // BERT's layers are post-norm: `layernorm` is refused (below).
    let post_norm = cases()
        .into_iter()
        .filter(|(_, r)| !r.selects(RecomputeModule::Layernorm))
        .map(|(case, r)| (case, r, None, 1e-6));
    let chunked = [(16, 0.0), (5, 5e-6)].map(|(rows, bound)| {
        (
            "chunked attention",
            RecomputeConfig::new(),
            Some(rows),
            bound,
        )
    });
    for (case, recompute, query_chunk, bound) in post_norm.chain(chunked) {
        for (rank, (a, b)) in run(recompute, query_chunk).iter().zip(&base).enumerate() {
            let (d, at) = max_rel_diff(a, b, 1e-6);
            assert!(
                d <= bound,
                "bert {case} ({query_chunk:?} rows) rank {rank}: gradient {at} differs by {d:e}"
            );
        }
    }
}

/// `layernorm` recomputation rebuilds a pre-norm layer's norm output; a post-norm layer
/// (BERT) is refused at init, naming the module.
#[test]
fn layernorm_recomputation_needs_pre_norm_layers() {
    use burn_megatron::comm::{Comm, LocalWorld};
    use burn_megatron_tests::bert::bert;

    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
    let recompute = RecomputeConfig::new()
        .with_granularity(Some(RecomputeGranularity::Selective))
        .with_modules(vec![RecomputeModule::Layernorm]);
    let e = bert(1, (32, 4, 64), 16, 128)
        .map_transformer(|t| t.with_recompute(recompute))
        .init(&tp, &burn::tensor::Device::flex().autodiff())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--recompute-modules layernorm needs pre-norm layers"),
        "{e}"
    );
}
