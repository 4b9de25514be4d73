//! A Burn model split into pipeline stages with a `PpPlan`: built per stage (its embedding
//! on the first, its head on the last, its share of the layers), loaded from the record the
//! whole model saved, and trained through `forward_backward_func` and `ParallelTraining`.
//! At PP 2, PP 2 × VP 2, PP 4, TP 2 × PP 2 and DP 2 × PP 2 (distributed optimizer) its
//! losses, grad norms, first gradients and final weights (gathered by the whole model's
//! names) are one rank's; a checkpoint saved at DP 2 × PP 2 resumes at PP 1 and at PP 2 × VP
//! 2; the plain record written back from the stages loads into Burn's whole model. The same
//! holds with the output tied to the embedding (a copy on the last stage), whose checkpoint
//! restores the copy from the first stage's tensor. A stage that
//! holds the wrong modules is refused, naming them (`errors`).

use super::Error;
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::dropin::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn_megatron::dropin::nn::{
    Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn_megatron::dropin::{
    LoadOptions, PpPlan, PpStage, RecordSource, TpPlan, apply_lora, load_sharded,
    save_gathered_stages,
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::optimizer::InnerOptimizer;
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule,
    forward_backward_func, read_losses,
};
use burn_megatron::tensor_parallel::mappings::copy_to_tensor_model_parallel_region;
use burn_megatron::tensor_parallel::vocab_parallel_cross_entropy;
use burn_megatron::topology::{LayerSplit, ParallelConfig, PipelineLayout, PipelinePosition};
use burn_megatron::training::{ParallelTraining, ParallelTrainingConfig};
use burn_megatron_tests::gpt::{gathered, max_rel_diff};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

mod errors;

const VOCAB: usize = 32;
const D: usize = 16;
const LAYERS: usize = 4;
const S: usize = 6;
/// Samples a step, one a microbatch: 8 microbatches on one replica, 4 on each of two.
const GLOBAL_BATCH: usize = 8;

/// A decoder-only LM written as a Burn user writes one, built per pipeline stage.
#[derive(Module, Debug)]
struct Lm {
    wte: Option<Embedding>,
    layers: Vec<TransformerEncoderLayer>,
    norm: Option<LayerNorm>,
    lm_head: Option<Linear>,
}

fn plan() -> PpPlan {
    PpPlan::new("layers", LAYERS)
        .first(&["wte"])
        .last(&["norm", "lm_head"])
}

/// The model whose output reads the word embedding (GPT-2's tie): the last stage holds a
/// copy of it.
fn tied_plan() -> PpPlan {
    PpPlan::new("layers", LAYERS).tied(&["wte"]).last(&["norm"])
}

impl Lm {
    fn new(stage: &PpStage, device: &Device) -> Self {
        let layer = TransformerEncoderConfig::new(D, 2 * D, 4, LAYERS)
            .with_dropout(0.0)
            .with_norm_first(true);
        Self {
            wte: stage
                .is_first()
                .then(|| EmbeddingConfig::new(VOCAB, D).init(device)),
            layers: (stage.layers())
                .map(|_| TransformerEncoderLayer::new(&layer, device))
                .collect(),
            norm: stage
                .is_last()
                .then(|| LayerNormConfig::new(D).init(device)),
            lm_head: stage
                .is_last()
                .then(|| LinearConfig::new(D, VOCAB).init(device)),
        }
    }

    /// The model with its output tied to the embedding: `wte` on the first and the last stage,
    /// no `lm_head`.
    fn new_tied(stage: &PpStage, device: &Device) -> Self {
        let both = stage.is_first() || stage.is_last();
        let wte = both.then(|| EmbeddingConfig::new(VOCAB, D).init(device));
        Self {
            wte,
            lm_head: None,
            ..Self::new(stage, device)
        }
    }

    /// Megatron's forward step for sample `sample`: token ids where the chunk embeds, the
    /// previous stage's hidden states elsewhere; the loss where it has the head.
    fn step(
        &self,
        sample: usize,
        input: Option<Tensor<3>>,
        device: &Device,
    ) -> Result<ChunkOutput<3>, Error> {
        let ids: Vec<i64> = (sample * (S + 1)..(sample + 1) * (S + 1))
            .map(|i| ((i * 7 + i / 3) % VOCAB) as i64)
            .collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, S + 1]), device);
        let mut x = match (input, &self.wte) {
            (Some(x), _) => x,
            (None, Some(wte)) => wte.forward(ids.clone().narrow(1, 0, S)),
            (None, None) => return Err("a chunk without the embedding needs hidden states".into()),
        };
        for layer in &self.layers {
            x = layer.forward(x, None, None);
        }
        let Some(norm) = &self.norm else {
            return Ok(ChunkOutput::Activation(x));
        };
        let x = norm.forward(x);
        let (logits, group) = match (&self.lm_head, &self.wte) {
            (Some(head), _) => (head.forward(x), head.group()),
            // Tied: this rank's rows of the table give its slice of the logits.
            (None, Some(wte)) => {
                let group = wte.group();
                let x = copy_to_tensor_model_parallel_region(x, &group);
                (x.matmul(wte.weight.val().transpose().unsqueeze()), group)
            }
            (None, None) => return Err("the last stage has no output layer".into()),
        };
        let logits = logits.clone().reshape([S, logits.dims()[2]]);
        let labels = ids.narrow(1, 1, S).reshape([S]);
        let loss = vocab_parallel_cross_entropy(logits, labels, 0.0, &group)?;
        Ok(ChunkOutput::Loss {
            loss: loss.mean(),
            report: vec![],
        })
    }
}

/// The whole model, drawn by Burn on this thread and saved: what every layout loads.
fn record(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("lm.bpk");
    let device = Device::flex();
    device.seed(11);
    let whole = plan().stage(PipelinePosition::whole()).unwrap();
    Lm::new(&whole, &device).save_file(&path).unwrap();
    path
}

/// The LoRA every LoRA run applies.
fn lora() -> burn::module::Lora {
    burn::module::Lora::new(2, 4.0)
}

/// The whole model with Burn's LoRA on it, saved after one AdamW step (so that every `b`, zeros
/// as Burn draws it, holds values): what every LoRA layout loads.
fn lora_record(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("lm-lora.bpk");
    let device = Device::flex().autodiff();
    device.seed(13);
    let whole = plan().stage(PipelinePosition::whole()).unwrap();
    let lm = Lm::new(&whole, &device).apply_lora(lora());
    let Ok(ChunkOutput::Loss { loss, .. }) = lm.step(0, None, &device) else {
        panic!("the whole model ends in its loss")
    };
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &lm);
    let lm = AdamWConfig::new().init().step(5e-2, lm, grads);
    lm.save_file(&path).unwrap();
    path
}

/// The tied model's record: `wte`, the layers and the norm.
fn tied_record(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tied.bpk");
    let device = Device::flex();
    device.seed(12);
    let whole = tied_plan().stage(PipelinePosition::whole()).unwrap();
    Lm::new_tied(&whole, &device).save_file(&path).unwrap();
    path
}

#[derive(Clone, Copy)]
struct Run<'a> {
    tp: usize,
    pp: usize,
    vp: usize,
    dp: usize,
    steps: usize,
    record: &'a Path,
    resume: Option<&'a Path>,
    save: Option<&'a Path>,
    /// Write the whole plain model's record here after training.
    plain: Option<&'a Path>,
    /// The output tied to the embedding.
    tied: bool,
    /// How the layers split over the stages.
    split: LayerSplit,
    /// Burn's LoRA on every stage, by `dropin::apply_lora` after the plan (the record holds
    /// the adapters).
    lora: bool,
}

fn run<'a>(tp: usize, pp: usize, vp: usize, dp: usize, record: &'a Path) -> Run<'a> {
    Run {
        tp,
        pp,
        vp,
        dp,
        steps: 3,
        record,
        resume: None,
        save: None,
        plain: None,
        tied: false,
        split: LayerSplit::default(),
        lora: false,
    }
}

/// What a run gives: each step's loss and grad norm, the first step's gradients and the
/// final weights, by the whole model's names.
#[derive(Default)]
struct Trace {
    steps: Vec<(f32, f64)>,
    /// None where a replica holds only a part of them.
    grads: Option<BTreeMap<String, Vec<f32>>>,
    weights: BTreeMap<String, Vec<f32>>,
    /// The layers of each virtual stage.
    layers: BTreeMap<usize, Range<usize>>,
}

fn train(run: Run<'_>) -> Result<Trace, Error> {
    let config = ParallelConfig::new(run.tp * run.pp * run.dp, run.tp, run.pp)
        .with_virtual_pipeline((run.vp > 1).then_some(run.vp))
        .with_layer_split(run.split);
    let ranks = threads(&config, LaunchOptions::default(), |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let plan = if run.tied { tied_plan() } else { plan() };
        let stages = plan.stages(&ctx.state)?;
        let tp_plan = TpPlan::new().encoder(&["layers.*"])?;
        let tp_plan = match run.tied {
            true => tp_plan.vocab(&["wte"])?,
            false => tp_plan.vocab(&["wte", "lm_head"])?,
        };
        let build = |stage: &PpStage| match run.tied {
            true => Lm::new_tied(stage, d),
            false => Lm::new(stage, d),
        };
        let source = RecordSource::from_path(run.record);
        let chunks = stages
            .iter()
            .map(|stage| {
                let chunk = stage.tp_plan(tp_plan.clone()).apply(build(stage), tp)?;
                let chunk = match run.lora {
                    true => apply_lora(chunk, lora(), tp)?,
                    false => chunk,
                };
                let options = stage.load_options(LoadOptions::default());
                Ok(load_sharded(chunk, &source, tp, &options)?.0)
            })
            .collect::<Result<Vec<Lm>, Error>>()?;
        let names = plan.global_names(&stages);
        let mut training = ParallelTrainingConfig::new()
            .with_use_distributed_optimizer(run.dp > 1)
            .init(&ctx, &chunks, names.clone())?;
        let adamw = || InnerOptimizer::from(AdamWConfig::new().with_weight_decay(0.01).init());
        let (mut chunks, mut optimizer) = match run.resume {
            Some(root) => {
                let make = |t: &ParallelTraining, m: &Vec<Lm>| t.optimizer(adamw(), m);
                let restored = training.load(root, Some(2), chunks, make, true)?;
                (restored.model, restored.optimizer)
            }
            None => {
                let optimizer = training.optimizer(adamw(), &chunks)?;
                (chunks, optimizer)
            }
        };
        let p2p = ctx.p2p(P2pShapes::Variable);
        let m = GLOBAL_BATCH / run.dp;
        let first = ctx.state.data_parallel_rank() * m;
        let schedule = PipelineSchedule::new(run.pp, m).with_model_chunks(run.vp);
        let by_name = |values: BTreeMap<String, Vec<f32>>| -> BTreeMap<String, Vec<f32>> {
            values.into_iter().map(|(k, v)| (names(&k), v)).collect()
        };
        let mut trace = Trace::default();
        for stage in &stages {
            trace
                .layers
                .insert(stage.position().virtual_stage(), stage.layers());
        }
        for step in 0..run.steps {
            let out = forward_backward_func(
                |s: ForwardStep<'_, Lm, 3>| s.model.step(first + s.microbatch, s.input, d),
                &chunks,
                &p2p,
                ForwardBackwardConfig::new(schedule),
            )?;
            let losses = read_losses(&out.losses);
            let mut grads = out.grads;
            training.finalize(&chunks, &mut grads)?;
            // Reduce-scattered for the distributed optimizer: each replica holds a part.
            if step == 0 && run.dp == 1 {
                trace.grads = Some(by_name(gathered(&chunks, Some(&grads), tp)));
            }
            let (stepped, report) = optimizer.step(3e-3, chunks, grads)?;
            chunks = stepped;
            // The last stage's loss, averaged over the replicas.
            let mut loss = vec![losses.iter().map(|l| l.loss as f32).sum::<f32>() / m as f32];
            if !losses.is_empty() {
                ctx.groups.dp.all_reduce_vec(&mut loss, ReduceOp::Avg)?;
            }
            trace
                .steps
                .push((loss[0], report.grad_norm.unwrap_or(f64::NAN)));
        }
        trace.weights = by_name(gathered(&chunks, None, tp));
        if let Some(plain) = run.plain.filter(|_| ctx.state.data_parallel_rank() == 0) {
            let pp = &ctx.groups.pp;
            save_gathered_stages(&chunks, &stages, plain, tp, pp)?;
        }
        if let Some(root) = run.save {
            training.save(root, 2, &chunks, &optimizer, serde_json::json!({}))?;
        }
        let last = stages.iter().any(PpStage::is_last);
        Ok::<_, Error>((last && ctx.state.data_parallel_rank() == 0, trace))
    })?;
    // The losses from the last stage; gradients and weights from every stage of replica 0.
    let mut whole = Trace::default();
    for (last, trace) in ranks {
        if last {
            whole.steps = trace.steps.clone();
        }
        if let Some(grads) = trace.grads {
            whole.grads.get_or_insert_default().extend(grads);
        }
        whole.weights.extend(trace.weights);
        whole.layers.extend(trace.layers);
    }
    Ok(whole)
}

fn assert_same(what: &str, got: &Trace, want: &Trace) {
    assert_eq!(got.steps.len(), want.steps.len(), "{what}: steps");
    for (i, (a, b)) in got.steps.iter().zip(&want.steps).enumerate() {
        assert!(
            (a.0 - b.0).abs() < 1e-5 && (a.1 - b.1).abs() <= 1e-5 * b.1,
            "{what}, step {i}: loss and grad norm {a:?}, one rank {b:?}"
        );
    }
    let grads = match (&got.grads, &want.grads) {
        (Some(a), Some(b)) => Some(("gradient", a, b, 1e-5)),
        _ => None,
    };
    // Adam divides each gradient by its own magnitude, so after three steps a weight whose
    // gradient is near rounding (a norm's beta) moves by rounding ÷ itself: 1e-4 there.
    let weights = ("weight", &got.weights, &want.weights, 1e-4);
    for (kind, a, b, tolerance) in grads.into_iter().chain([weights]) {
        let (worst, name) = max_rel_diff(a, b, 1e-2);
        assert!(worst <= tolerance, "{what}: {kind} {name} off by {worst:e}");
    }
}

#[test]
fn a_burn_model_trains_across_pipeline_stages_as_on_one_rank() -> Result<(), Error> {
    let dir = super::load::scratch("pipeline");
    let record = record(&dir);
    let one = train(run(1, 1, 1, 1, &record))?;
    assert!(one.grads.is_some());
    assert_eq!(
        one.weights.len(),
        5 + LAYERS * 16,
        "every parameter, by its whole name"
    );
    for (tp, pp, vp, dp) in [
        (1, 2, 1, 1),
        (1, 2, 2, 1),
        (1, 4, 1, 1),
        (2, 2, 1, 1),
        (1, 2, 1, 2),
    ] {
        let what = format!("TP {tp} × PP {pp} × VP {vp} × DP {dp}");
        assert_same(&what, &train(run(tp, pp, vp, dp, &record))?, &one);
    }
    // Saved at DP 2 × PP 2 after two steps, resumed for one at PP 1 and at PP 2 × VP 2.
    let root = dir.join("checkpoints");
    let saved = Run {
        steps: 2,
        save: Some(&root),
        ..run(1, 2, 1, 2, &record)
    };
    train(saved)?;
    let rest = Trace {
        steps: one.steps[2..].to_vec(),
        grads: None,
        weights: one.weights.clone(),
        ..Trace::default()
    };
    for (pp, vp) in [(1, 1), (2, 2)] {
        let resumed = Run {
            steps: 1,
            resume: Some(&root),
            ..run(1, pp, vp, 1, &record)
        };
        let got = train(resumed)?;
        assert_same(&format!("resumed at PP {pp} × VP {vp}"), &got, &rest);
    }
    // Megatron's uneven splits, from the state's layout: 1 + 3 layers, the embedding and the
    // loss counted as layers over 3 stages (4 + 2 = 2 each, one fewer at the ends), and every
    // stage written out (--pipeline-model-parallel-layout: 3 + 0 + 1, a stage of no layer);
    // and the even checkpoint resumed under the second.
    let split = LayerSplit::default();
    let counted = split.with_embedding_counted(true).with_loss_counted(true);
    let written = split.with_layout(PipelineLayout::parse("Ettt||tL")?);
    for (pp, split, layers) in [
        (2, split.with_first_stage(1), vec![0..1, 1..4]),
        (3, counted, vec![0..1, 1..3, 3..4]),
        (3, written, vec![0..3, 3..3, 3..4]),
        // 4 layers + 2 counted over 6 stages: the first only embeds, the last only computes
        // the loss.
        (6, counted, vec![0..0, 0..1, 1..2, 2..3, 3..4, 4..4]),
    ] {
        let what = format!("PP {pp} split {split:?}");
        let got = train(Run {
            split,
            ..run(1, pp, 1, 1, &record)
        })?;
        assert_eq!(
            got.layers.values().cloned().collect::<Vec<_>>(),
            layers,
            "{what}"
        );
        assert_same(&what, &got, &one);
    }
    let resumed = Run {
        steps: 1,
        resume: Some(&root),
        split: counted,
        ..run(1, 3, 1, 1, &record)
    };
    assert_same("resumed at PP 3, ends counted", &train(resumed)?, &rest);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Burn's LoRA on a model split into pipeline stages (`dropin::apply_lora` on each stage's
/// chunk, the adapters loaded from the whole LoRA model's record) trains as that model on
/// one rank: losses, grad norms, the adapters' gradients and every weight.
#[test]
fn lora_on_pipeline_stages_trains_as_on_one_rank() -> Result<(), Error> {
    let dir = super::load::scratch("pipeline-lora");
    let record = lora_record(&dir);
    let lora_run = |tp, pp, vp, dp| Run {
        lora: true,
        ..run(tp, pp, vp, dp, &record)
    };
    let one = train(lora_run(1, 1, 1, 1))?;
    let trained = one.grads.as_ref().map_or(0, BTreeMap::len);
    assert_eq!(trained, 2 * (2 + LAYERS * 6), "only the adapters train");
    for (tp, pp, vp, dp) in [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2)] {
        let what = format!("LoRA, TP {tp} × PP {pp} × VP {vp} × DP {dp}");
        assert_same(&what, &train(lora_run(tp, pp, vp, dp))?, &one);
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn a_fresh_stage_draws_the_whole_models_layers() -> Result<(), Error> {
    // Split layers drawn by the plan (no record): every stage draws the layers it holds as
    // one rank draws them, only through `PpStage::tp_plan`.
    let draw = |pp: usize, through_stage: bool| -> Result<BTreeMap<String, Vec<f32>>, Error> {
        let config = ParallelConfig::new(2 * pp, 2, pp);
        let ranks = threads(&config, LaunchOptions::default(), |ctx| {
            let plan = plan();
            let stages = plan.stages(&ctx.state)?;
            let stage = &stages[0];
            let tp_plan = TpPlan::new().encoder(&["layers.*"])?.with_seed(5);
            let tp_plan = match through_stage {
                true => stage.tp_plan(tp_plan),
                false => tp_plan,
            };
            let chunk = tp_plan.apply(Lm::new(stage, &ctx.device), &ctx.groups.tp)?;
            let values = gathered(&chunk, None, &ctx.groups.tp);
            let names = plan.global_names(&stages);
            Ok::<_, Error>(
                values
                    .into_iter()
                    .map(|(k, v)| (names(&k), v))
                    .collect::<Vec<_>>(),
            )
        })?;
        Ok(ranks
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.contains("layers"))
            .collect())
    };
    let one = draw(1, true)?;
    assert_eq!(one.len(), LAYERS * 16);
    assert!(
        draw(2, true)? == one,
        "stages draw the whole model's layers"
    );
    let unstaged = draw(2, false)?;
    assert!(
        unstaged != one,
        "without the stage, stage 1 draws layers 0 and 1 again"
    );
    Ok(())
}

#[test]
fn a_model_trained_in_stages_saves_the_plain_models_record() -> Result<(), Error> {
    let dir = super::load::scratch("pipeline-save");
    let record = record(&dir);
    let whole = plan().stage(PipelinePosition::whole())?;
    for (tp, pp, vp, dp) in [(2, 2, 1, 1), (1, 2, 2, 2)] {
        let plain = dir.join(format!("plain-{tp}-{pp}-{vp}-{dp}.bpk"));
        let run = Run {
            steps: 2,
            plain: Some(&plain),
            ..run(tp, pp, vp, dp, &record)
        };
        let trained = train(run)?;
        // Burn's own loader, into the whole model the plain code builds.
        let loaded = Lm::new(&whole, &Device::flex()).load_file(&plain);
        let loaded = gathered(&loaded, None, &super::solo());
        let (worst, name) = max_rel_diff(&loaded, &trained.weights, 1e-2);
        assert!(
            worst == 0.0,
            "TP {tp} × PP {pp} × VP {vp} × DP {dp}: {name} off by {worst:e}"
        );
    }
    // A file that cannot be written (under a file, not a directory) is an error on every
    // rank, the other stages' included, not a hang.
    let unwritable = record.join("plain.bpk");
    let failed = train(Run {
        steps: 1,
        plain: Some(&unwritable),
        ..run(1, 2, 1, 1, &record)
    });
    let e = failed.err().expect("an error").to_string();
    assert!(e.contains("plain.bpk"), "{e}");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn an_output_tied_to_the_embedding_trains_across_stages_as_on_one_rank() -> Result<(), Error> {
    let dir = super::load::scratch("pipeline-tied");
    let record = tied_record(&dir);
    let tied = |tp, pp, vp, dp| Run {
        tied: true,
        ..run(tp, pp, vp, dp, &record)
    };
    let one = train(tied(1, 1, 1, 1))?;
    assert_eq!(one.weights.len(), 3 + LAYERS * 16);
    // The last stage's copy takes the first's gradient through the embedding group, so
    // both stay the one rank's weight.
    for (tp, pp, vp, dp) in [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 2)] {
        let plain = dir.join(format!("plain-{tp}-{pp}-{vp}-{dp}.bpk"));
        let run = Run {
            plain: Some(&plain),
            ..tied(tp, pp, vp, dp)
        };
        let got = train(run)?;
        let what = format!("tied, TP {tp} × PP {pp} × VP {vp} × DP {dp}");
        assert!(got.grads.is_some() || dp > 1, "{what}");
        assert_same(&what, &got, &one);
        // The record holds the weight once, and Burn's whole tied model loads it.
        let whole = tied_plan().stage(PipelinePosition::whole())?;
        let loaded = Lm::new_tied(&whole, &Device::flex()).load_file(&plain);
        let loaded = gathered(&loaded, None, &super::solo());
        let (worst, name) = max_rel_diff(&loaded, &got.weights, 1e-2);
        assert!(worst == 0.0, "{what}: saved {name} off by {worst:e}");
    }
    // Saved at DP 2 × PP 2 (the copy left out), resumed at PP 1 and PP 2: the last stage's
    // copy is restored from the first stage's tensor.
    let root = dir.join("checkpoints");
    train(Run {
        steps: 2,
        save: Some(&root),
        ..tied(1, 2, 1, 2)
    })?;
    let rest = Trace {
        steps: one.steps[2..].to_vec(),
        grads: None,
        weights: one.weights.clone(),
        ..Trace::default()
    };
    for pp in [1, 2] {
        let resumed = Run {
            steps: 1,
            resume: Some(&root),
            ..tied(1, pp, 1, 1)
        };
        assert_same(
            &format!("tied, resumed at PP {pp}"),
            &train(resumed)?,
            &rest,
        );
    }
    // The last stage's copy, built but neither loaded nor split by the stage's plan, is not
    // marked tied: `check` says so; loaded, it is.
    let last = tied_plan().stage(PipelinePosition::new(2, 1, 1, 0))?;
    let chunk = Lm::new_tied(&last, &Device::flex());
    let e = last.check(&chunk).unwrap_err().to_string();
    assert!(
        e.contains("wte.weight is tied between the first and the last stage"),
        "{e}"
    );
    let options = last.load_options(LoadOptions::default());
    let source = RecordSource::from_path(&record);
    let (chunk, _) = load_sharded(chunk, &source, &super::solo(), &options)?;
    last.check(&chunk)?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn a_drawn_tied_copy_takes_the_first_stages_values() -> Result<(), Error> {
    // Drawn by Burn on each rank (no record, no split): the copies differ until synced.
    // Each rank gives (first stage, its draw, after the sync, checked after it).
    type Copy = (bool, Vec<f32>, Vec<f32>, bool);
    let config = ParallelConfig::new(2, 1, 2);
    let ranks: Vec<Copy> = threads(&config, LaunchOptions::default(), |ctx| {
        let stage = tied_plan().stage(PipelinePosition::of(&ctx.state, 0))?;
        let chunk = Lm::new_tied(&stage, &ctx.device);
        let wte = |c: &Lm| gathered(c, None, &ctx.groups.tp).remove("wte.weight");
        let drawn = wte(&chunk).unwrap_or_default();
        let unmarked = stage.check(&chunk).is_err();
        let chunk = stage.sync_tied(chunk, ctx.groups.embedding.as_ref())?;
        let checked = unmarked && stage.check(&chunk).is_ok();
        Ok::<_, Error>((
            stage.is_first(),
            drawn,
            wte(&chunk).unwrap_or_default(),
            checked,
        ))
    })?;
    let (first, last) = match ranks[0].0 {
        true => (&ranks[0], &ranks[1]),
        false => (&ranks[1], &ranks[0]),
    };
    assert!(first.1 != last.1, "Burn's draws differ by rank");
    assert!(
        !first.1.is_empty() && first.2 == first.1,
        "the first stage keeps its draw"
    );
    assert!(last.2 == first.1, "the last stage's copy takes it");
    assert!(first.3 && last.3, "refused by check before, marked after");
    Ok(())
}
