//! BERT across pipeline stages: PP ∈ {2, 4} × VP ∈ {1, 2} × TP ∈ {1, 2} × DP ∈ {1, 2}
//! (world ≤ 8), 10 AdamW steps with clipping and dropout off, against one rank running the
//! same microbatches through a plain gradient-accumulation loop (no pipeline code): the lm
//! and sop losses within 1e-4 and the global grad norm within 1e-4 relative on every rank
//! that reports them.

use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use burn_megatron::comm::{Comm, CommunicatorExt, ReduceOp};
use burn_megatron::data_parallel::{
    DataParallelConfig,
    advanced::{DpReduction, OverlapReducer, finalize_model_grads},
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{Bert, BertConfig, BertStageOutput};
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, GradSync, P2pShapes, PipelineSchedule,
    forward_backward_func, read_losses,
};
use burn_megatron::tensor_parallel::parallel_attrs;
use burn_megatron::topology::{LayerSplit, ParallelConfig, PipelinePosition};
use burn_megatron_tests::bert::{BertRows, bert_sample};
use burn_megatron_tests::{no_dropout, reload_as_another_process, values};
use std::sync::Arc;

// Eight samples: at DP 2 each replica has 4 microbatches, as many as interleaving over 4
// stages needs (M ≥ P).
const SAMPLES: usize = 8;
const SEQ: usize = 8;
const VOCAB: usize = 64;
const LAYERS: usize = 8;
const STEPS: usize = 10;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn bert(sp: bool) -> BertConfig {
    burn_megatron_tests::bert::bert(LAYERS, (16, 4, 32), SEQ, VOCAB)
        .map_transformer(|t| no_dropout(t).with_sequence_parallel(sp))
}

fn seq_len(g: usize, variable: bool) -> usize {
    if variable { SEQ - 2 * (g % 2) } else { SEQ }
}

/// Sample `g` of the fixed global batch, of `SEQ` tokens or fewer when `variable`.
fn sample(g: usize, variable: bool, device: &Device) -> BertRows {
    bert_sample(g, seq_len(g, variable), device)
}

/// Per step: (lm loss, sop loss, grad norm).
type Trace = Vec<(f64, f64, f64)>;

fn scalar(t: Tensor<1>) -> f64 {
    f64::from(t.into_data().iter::<f32>().next().expect("one value"))
}

/// One rank, all samples as microbatches of one, a plain accumulation loop.
fn reference(variable: bool) -> Trace {
    let device = Device::flex().autodiff();
    let world = burn_megatron::comm::LocalWorld::new(1);
    let solo: Comm = Arc::new(world.communicator("solo", vec![0], 0).unwrap());
    let mut model = bert(false).init(&solo, &device).unwrap();
    let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, solo.clone(), 0)
        .with_clip_grad(1.0, NormType::L2);
    let mut trace = Vec::new();
    for _ in 0..STEPS {
        let mut acc = GradientsAccumulator::new();
        let (mut lm_sum, mut sop_sum) = (0.0, 0.0);
        for g in 0..SAMPLES {
            let b = sample(g, variable, &device);
            let out = model.forward(b.ids, b.types, b.padding, None);
            let (lm, sop) = model.loss(out, b.labels, b.mask, b.sop).unwrap();
            lm_sum += scalar(lm.clone());
            sop_sum += scalar(sop.clone());
            let grads = ((lm + sop) / SAMPLES as f32).backward();
            acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
        }
        let (m, report) = optim.step(1e-3, model, acc.grads()).unwrap();
        model = m;
        let n = SAMPLES as f64;
        trace.push((lm_sum / n, sop_sum / n, report.grad_norm.unwrap()));
    }
    trace
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
}

/// One rank's (lm, sop) losses per step if it is a last stage, its grad norms, and the
/// layers of each of its chunks.
type RankTrace = (Option<Vec<(f64, f64)>>, Vec<f64>, Vec<usize>);

fn pipelined(l: Layout, variable: bool) -> Vec<RankTrace> {
    let world = l.tp * l.pp * l.dp;
    let config = ParallelConfig::new(world, l.tp, l.pp)
        .with_virtual_pipeline((l.vp > 1).then_some(l.vp))
        .with_layer_split(l.split);
    threads(&config, LaunchOptions::default(), |ctx| {
        let (tp, device) = (&ctx.groups.tp, &ctx.device);
        let mut chunks: Vec<Bert> = (0..l.vp)
            .map(|c| bert(l.sp).init_stage(tp, PipelinePosition::of(&ctx.state, c), device))
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
        // One reducer per chunk, each on its own data-parallel channel.
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
        let p2p = ctx.p2p(P2pShapes::Variable);
        let local = SAMPLES / l.dp;
        let first_sample = ctx.state.data_parallel_rank() * local;
        let schedule = PipelineSchedule::new(l.pp, local).with_model_chunks(l.vp);
        let mut fb = ForwardBackwardConfig::new(schedule);
        if l.overlap {
            fb.grad_sync = Some(&hooks);
        }
        let mut losses = Vec::new();
        let mut norms = Vec::new();
        for _ in 0..STEPS {
            let out = forward_backward_func(
                |s: ForwardStep<'_, Bert, 3>| -> Result<ChunkOutput<3>, Error> {
                    let b = sample(first_sample + s.microbatch, variable, device);
                    let tokens = s.input.is_none().then_some((b.ids, b.types));
                    match s.model.forward_stage(tokens, s.input, b.padding, None)? {
                        BertStageOutput::Hidden(h) => Ok(ChunkOutput::Activation(h)),
                        BertStageOutput::Output(o) => {
                            let (lm, sop) = s.model.loss(o, b.labels, b.mask, b.sop)?;
                            let report = vec![lm.clone(), sop.clone()];
                            Ok(ChunkOutput::Loss {
                                loss: lm + sop,
                                report,
                            })
                        }
                    }
                },
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
            norms.push(report.grad_norm.unwrap());
            if !out.losses.is_empty() {
                let n = out.losses.len() as f32;
                let mut v = vec![0.0f32; 2];
                for m in &read_losses(&out.losses) {
                    v[0] += m.report[0] as f32 / n;
                    v[1] += m.report[1] as f32 / n;
                }
                dp.all_reduce_vec(&mut v, ReduceOp::Avg)?;
                losses.push((f64::from(v[0]), f64::from(v[1])));
            }
        }
        let last = ctx.state.is_pipeline_last_stage();
        let held = chunks.iter().map(|c| c.layers.len()).collect();
        Ok::<_, Error>((last.then_some(losses), norms, held))
    })
    .unwrap()
}

/// Checks every rank's losses and grad norms; returns the layers of each rank's chunks.
fn check(l: Layout, variable: bool, reference: &Trace) -> Vec<Vec<usize>> {
    let ranks = pipelined(l, variable);
    let mut reporters = 0;
    for (rank, (losses, norms, _)) in ranks.iter().enumerate() {
        let what = format!("{l:?} variable {variable} rank {rank}");
        assert_eq!(norms.len(), STEPS, "{what}");
        for (step, (n, r)) in norms.iter().zip(reference).enumerate() {
            assert!(
                (n - r.2).abs() <= 1e-4 * r.2,
                "{what} step {step}: norm {n} vs {}",
                r.2
            );
        }
        if let Some(losses) = losses {
            reporters += 1;
            assert_eq!(losses.len(), STEPS, "{what}");
            for (step, ((lm, sop), r)) in losses.iter().zip(reference).enumerate() {
                assert!(
                    (lm - r.0).abs() <= 1e-4,
                    "{what} step {step}: lm {lm} vs {}",
                    r.0
                );
                assert!(
                    (sop - r.1).abs() <= 1e-4,
                    "{what} step {step}: sop {sop} vs {}",
                    r.1
                );
            }
        }
    }
    assert_eq!(
        reporters,
        l.tp * l.dp,
        "{l:?}: every last-stage rank reports"
    );
    ranks.into_iter().map(|r| r.2).collect()
}

#[test]
fn bert_pipelines_match_one_rank() {
    let reference = reference(false);
    assert!(
        reference[STEPS - 1].0 < reference[0].0,
        "the MLM loss must fall"
    );
    for pp in [2, 4] {
        for vp in [1, 2] {
            for tp in [1, 2] {
                for dp in [1, 2] {
                    if tp * pp * dp > 8 {
                        continue;
                    }
                    // Sequence parallelism on the TP 2 layouts without DP, overlap on DP 2.
                    let l = Layout {
                        tp,
                        pp,
                        vp,
                        dp,
                        sp: tp == 2 && dp == 1,
                        overlap: dp == 2,
                        split: LayerSplit::default(),
                    };
                    check(l, false, &reference);
                }
            }
        }
    }
    // Megatron's uneven split, interleaved: the first rank's 2 layers over its 2 chunks, the
    // other 6 over the last rank's; ranks hold chunks [1, 1] and [3, 3].
    let uneven = Layout {
        tp: 2,
        pp: 2,
        vp: 2,
        dp: 1,
        sp: true,
        overlap: false,
        split: LayerSplit::default().with_first_stage(2),
    };
    let held = check(uneven, false, &reference);
    assert_eq!(held, [[1, 1], [1, 1], [3, 3], [3, 3]], "{uneven:?}");
}

#[test]
fn bert_pipeline_with_variable_sequence_lengths_matches_one_rank() {
    let reference = reference(true);
    for l in [
        Layout {
            tp: 1,
            pp: 2,
            vp: 2,
            dp: 1,
            sp: false,
            overlap: false,
            split: LayerSplit::default(),
        },
        Layout {
            tp: 2,
            pp: 2,
            vp: 1,
            dp: 1,
            sp: true,
            overlap: false,
            split: LayerSplit::default(),
        },
    ] {
        check(l, true, &reference);
    }
}

/// The last stage's copy of the word embeddings starts equal to the first stage's (and to the
/// whole model's); both are marked for the embedding-group reduction, only the copy is left
/// out of the grad norm; the embeddings and heads sit on the first and last stage only.
#[test]
fn the_tied_word_embedding_starts_equal_and_counts_once() {
    let device = Device::flex().autodiff();
    let world = burn_megatron::comm::LocalWorld::new(1);
    let solo: Comm = Arc::new(world.communicator("solo", vec![0], 0).unwrap());
    let stage = |rank| {
        bert(false)
            .init_stage(&solo, PipelinePosition::new(2, rank, 1, 0), &device)
            .unwrap()
    };
    let (first, last, whole) = (
        stage(0),
        stage(1),
        bert(false).init(&solo, &device).unwrap(),
    );
    let emb = first.embeddings.as_ref().unwrap();
    let head = last.head.as_ref().unwrap();
    let copy = head.word_embeddings.as_ref().unwrap();
    let whole_emb = &whole.embeddings.as_ref().unwrap().word_embeddings;
    assert!(first.head.is_none() && last.embeddings.is_none());
    assert!(whole.head.as_ref().unwrap().word_embeddings.is_none());
    assert_eq!(
        (first.layers.len(), last.layers.len()),
        (LAYERS / 2, LAYERS / 2)
    );
    let w = |t: Tensor<2>| values(t);
    assert_eq!(w(emb.word_embeddings.weight.val()), w(copy.weight.val()));
    assert_eq!(
        w(emb.word_embeddings.weight.val()),
        w(whole_emb.weight.val())
    );
    let (a, b, c) = (
        parallel_attrs(emb.word_embeddings.weight.id),
        parallel_attrs(copy.weight.id),
        parallel_attrs(whole_emb.weight.id),
    );
    assert!(a.shared_embedding && !a.shared && a.counts_in_grad_norm(0));
    assert!(b.shared_embedding && b.shared && !b.counts_in_grad_norm(0));
    assert!(!c.shared_embedding && c.counts_in_grad_norm(0));
    // Stage 1's first layer is the whole model's layer L/2.
    let layer_w = |l: &burn_megatron::models::TransformerLayer| {
        values(l.attention.query_key_value.weight.val())
    };
    assert_eq!(layer_w(&last.layers[0]), layer_w(&whole.layers[LAYERS / 2]));
    // Reloaded through Burn's records under ids this process never registered, both copies
    // are described again, tie included, by their first forward.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let first = reload_as_another_process(first, stage(0), &dir.join("tied-first.bpk"));
    let last = reload_as_another_process(last, stage(1), &dir.join("tied-last.bpk"));
    let rows = sample(0, false, &device);
    first
        .forward_stage(
            Some((rows.ids, rows.types)),
            None,
            rows.padding.clone(),
            None,
        )
        .unwrap();
    let hidden = Tensor::<3>::zeros([SEQ, 1, 16], &device);
    last.forward_stage(None, Some(hidden), rows.padding, None)
        .unwrap();
    let emb = &first.embeddings.as_ref().unwrap().word_embeddings;
    let copy = last
        .head
        .as_ref()
        .unwrap()
        .word_embeddings
        .as_ref()
        .unwrap();
    assert_eq!(parallel_attrs(emb.weight.id), a);
    assert_eq!(parallel_attrs(copy.weight.id), b);
}
