//! Mixture of experts with expert parallelism: a Llama-style GPT whose MLPs are 4 experts
//! (top-2, load-balancing and z losses on), trained 10 AdamW steps at EP ∈ {2, 4} with both
//! token dispatchers and at TP 2 × EP ∈ {1, 2} with and without sequence parallelism, against the same layout
//! at EP 1 (each rank holding every expert): every step's loss, the first step's gradients
//! (dense ones gathered over TP, experts under their global index) and the final weights.
//! The distributed optimizer sharding the experts over expert-DP (through `ParallelTraining`)
//! against EP 1 without it. And EP 2 × PP 2 × DP 2 through the pipeline executor against a
//! plain accumulation loop.

use super::Error;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_megatron::comm::tensor::all_reduce;
use burn_megatron::comm::{Comm, ReduceOp};
use burn_megatron::data_parallel::{
    DataParallelConfig,
    advanced::{DpReduction, finalize_expert_grads, finalize_model_grads},
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::GptConfig;
use burn_megatron::moe::{MoeConfig, TokenDispatcherType};
use burn_megatron::optimizer::InnerOptimizer;
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer, NormType};
use burn_megatron::tensor_parallel::parallel_attrs;
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron::training::ParallelTrainingConfig;
use burn_megatron_tests::gpt::{
    causal_lm_step, gathered, gpt_rows, llama, max_rel_diff, mean_reported_loss,
};
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::values;
use std::collections::BTreeMap;
use std::sync::Arc;

const GLOBAL_BATCH: usize = 4;
const SEQ: usize = 8;
const STEPS: usize = 10;

type Tensors = BTreeMap<String, Vec<f32>>;

struct Trace {
    losses: Vec<f32>,
    /// Each step's global gradient norm.
    norms: Vec<f64>,
    grads: Tensors,
    weights: Tensors,
}

fn moe_llama(dispatcher: TokenDispatcherType) -> GptConfig {
    let experts = MoeConfig::new(4)
        .with_moe_router_topk(2)
        .with_moe_ffn_hidden_size(Some(24))
        .with_moe_aux_loss_coeff(1e-2)
        .with_moe_z_loss_coeff(Some(1e-3))
        .with_moe_token_dispatcher_type(dispatcher);
    llama(2, SEQ).map_transformer(|t| t.with_moe(Some(experts)))
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

/// `fused`: the fused flat-buffer Adam instead of burn-optim's AdamW.
fn run(
    config: &GptConfig,
    layout: (usize, usize, usize, bool),
    fused: bool,
) -> Vec<(Trace, usize)> {
    run_split(config, layout, 1, fused)
}

/// [`run`] with each expert split over `etp` expert tensor-parallel ranks.
fn run_split(
    config: &GptConfig,
    (world, tp, ep, sp): (usize, usize, usize, bool),
    etp: usize,
    fused: bool,
) -> Vec<(Trace, usize)> {
    let layout = ParallelConfig::new(world, tp, 1)
        .with_expert_parallel(ep)
        .with_expert_tensor_parallel(etp);
    let config = (config.clone()).map_transformer(|t| t.with_sequence_parallel(sp));
    threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let whole = PipelinePosition::whole();
        let mut model = config.init_stage_with_experts(g, Some(&ctx.groups.experts()), whole, d)?;
        let first = model.layers[0]
            .moe
            .as_ref()
            .expect("layer 0 is MoE")
            .first_expert();
        let (mp, tp_rank) = (
            ctx.groups.mp.clone(),
            ctx.state.tensor_model_parallel_rank(),
        );
        let optim = if fused {
            MegatronOptimizer::new(FusedAdamConfig::new().init()?, &model, mp, tp_rank)
        } else {
            MegatronOptimizer::new(AdamWConfig::new().init(), &model, mp, tp_rank)
        };
        let mut optim = optim
            .with_expert_model_parallel(ctx.groups.expert_mp.clone())
            .with_clip_grad(1.0, NormType::L2);
        let dp = ctx.state.data_parallel_size();
        let local = GLOBAL_BATCH / dp;
        let b = gpt_rows(ctx.state.data_parallel_rank() * local, local, SEQ, d);
        let mask = Tensor::ones(b.mask.dims(), d);
        let (mut losses, mut norms, mut first_grads) = (Vec::new(), Vec::new(), None);
        let ddp = DataParallelConfig::default();
        for _ in 0..STEPS {
            let logits = model.forward(b.ids.clone())?;
            let loss = model.loss(logits, b.labels.clone(), mask.clone())?;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            finalize_model_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.dp),
                g,
                None,
                &ddp,
            )?;
            finalize_expert_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.expert_dp),
                dp,
                &ddp,
            )?;
            if first_grads.is_none() {
                first_grads = Some(gathered(&model, Some(&grads), g));
            }
            let report;
            (model, report) = optim.step(1e-3, model, grads)?;
            norms.extend(report.grad_norm);
            losses.push(values(all_reduce(&*ctx.groups.dp, loss.inner(), ReduceOp::Avg)?)[0]);
        }
        Ok::<_, Error>((
            Trace {
                losses,
                norms,
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
    // Every expert counted once: the norms (which clipping scales by) agree on every rank.
    assert_eq!(want[0].0.norms.len(), STEPS);
    for (rank, (t, _)) in got.iter().enumerate() {
        for (step, (a, b)) in t.norms.iter().zip(&want[0].0.norms).enumerate() {
            let rel = (a - b).abs() / b;
            assert!(
                rel <= 1e-5,
                "{what} rank {rank} step {step}: grad norm {a} vs {b}"
            );
        }
        assert_eq!(
            t.norms.len(),
            STEPS,
            "{what} rank {rank}: a step was skipped"
        );
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
            let reference = run(&config, (world, 1, 1, false), false);
            let losses = &reference[0].0.losses;
            assert!(
                losses[STEPS - 1] < losses[0] - 0.1,
                "the loss must fall: {losses:?}"
            );
            let got = run(&config, (world, 1, world, false), false);
            check(&format!("{dispatcher:?} EP {world}"), &got, &reference);
        }
    }
}

#[test]
fn tensor_and_expert_parallel_match_one_rank() {
    let config = moe_llama(TokenDispatcherType::AllToAll);
    let one = run(&config, (1, 1, 1, false), false);
    // Without sequence parallelism each TP rank routes its half of the sequence inside the
    // layer; at EP 1 the TP ranks hold the same experts (expert data parallelism over TP).
    for (tp, ep, sp) in [(2, 2, true), (2, 2, false), (2, 1, false)] {
        let got = run(&config, (2, tp, ep, sp), false);
        check(&format!("TP {tp} × EP {ep}, SP {sp}"), &got, &one);
    }
}

/// Expert tensor parallelism: each expert split over the TP ranks (its tokens gathered from
/// them, its partial outputs summed back), with both dispatchers, with and without sequence
/// parallelism, at EP 1 and 2, against the same data-parallel size on one rank per replica
/// (the load-balancing loss is per data-parallel rank, as Megatron's).
#[test]
fn expert_tensor_parallel_matches_one_rank_per_replica() {
    for dispatcher in [
        TokenDispatcherType::AllToAll,
        TokenDispatcherType::AllGather,
    ] {
        let config = moe_llama(dispatcher);
        let (one, dp2) = (
            run(&config, (1, 1, 1, false), false),
            run(&config, (2, 1, 1, false), false),
        );
        for (world, ep, sp) in [(2, 1, true), (4, 2, true), (4, 2, false)] {
            let got = run_split(&config, (world, 2, ep, sp), 2, false);
            let want = if world == 2 { &one } else { &dp2 };
            check(
                &format!("{dispatcher:?} TP 2 × ETP 2 × EP {ep} (world {world}), SP {sp}"),
                &got,
                want,
            );
        }
    }
    // The fused Adam step counts each expert slice once in the norm.
    let config = moe_llama(TokenDispatcherType::AllToAll);
    let reference = run(&config, (2, 1, 1, false), true);
    let got = run_split(&config, (4, 2, 2, true), 2, true);
    check("fused Adam TP 2 × ETP 2 × EP 2", &got, &reference);
}

/// Device-limited routing (Megatron's group-limited routing with one group per EP rank, each
/// token's two experts on one rank) trains at EP 2 as at EP 1.
#[test]
fn group_limited_routing_matches_ep1() {
    let config = moe_llama(TokenDispatcherType::AllToAll).map_transformer(|t| {
        let moe = t.moe.clone().map(|m| {
            m.with_moe_router_num_groups(Some(2))
                .with_moe_router_group_topk(Some(1))
        });
        t.with_moe(moe)
    });
    let reference = run(&config, (2, 1, 1, false), false);
    let got = run(&config, (2, 1, 2, false), false);
    check("group-limited EP 2", &got, &reference);
}

/// The fused Adam step counts the experts' gradient norm once over EP too.
#[test]
fn the_fused_adam_step_matches_ep1_with_experts() {
    let config = moe_llama(TokenDispatcherType::AllToAll);
    let reference = run(&config, (2, 1, 1, false), true);
    let got = run(&config, (2, 1, 2, false), true);
    check("fused Adam EP 2", &got, &reference);
}

/// EP 2 × PP 2 × DP 2 through `forward_backward_func` (2 micro-batches per rank), with and
/// without the distributed optimizer, both through `ParallelTraining`, against one
/// rank running the 4 samples as micro-batches in a plain accumulation loop, its auxiliary
/// losses scaled by 1/4 as the executor scales each micro-batch's (grad_scale / M): losses
/// and every weight under its global name after 6 clipped AdamW steps.
#[test]
fn expert_parallel_pipeline_matches_a_plain_accumulation_loop() {
    use burn::optim::GradientsAccumulator;
    use burn::tensor::DType;
    use burn_megatron::aux_loss::scale_aux_losses;
    use burn_megatron::comm::CommunicatorExt;
    use burn_megatron::models::Gpt;
    use burn_megatron::pipeline::{
        ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule, forward_backward_func,
    };
    const SAMPLES: usize = 4;
    const STEPS: usize = 6;
    let config = GptConfig {
        num_layers: 4,
        ..moe_llama(TokenDispatcherType::AllToAll)
    };
    let names = |chunks: &[Gpt], t: Tensors| -> Tensors {
        t.into_iter()
            .map(|(k, v)| (Gpt::global_param_name(chunks, &k), v))
            .collect()
    };
    let reference = tp_ranks(1, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let mut model = config.init(g, d)?;
        let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, g.clone(), 0)
            .with_clip_grad(1.0, NormType::L2);
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            let _scale = scale_aux_losses(1.0 / SAMPLES as f32);
            let (mut acc, mut sum) = (GradientsAccumulator::new(), 0.0);
            for s in 0..SAMPLES {
                let b = gpt_rows(s, 1, SEQ, d);
                let loss = model.loss(model.forward(b.ids)?, b.labels, b.mask)?;
                sum += values(loss.clone())[0];
                let grads = (loss / SAMPLES as f32).backward();
                acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
            }
            model = optim.step(1e-3, model, acc.grads())?.0;
            losses.push(sum / SAMPLES as f32);
        }
        let weights = names(std::slice::from_ref(&model), gathered(&model, None, g));
        Ok::<_, Error>((losses, weights))
    })
    .unwrap()
    .remove(0);
    let layout = ParallelConfig::new(4, 1, 2).with_expert_parallel(2);
    for distributed in [false, true] {
        let ranks = threads(&layout, LaunchOptions::default(), |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let position = PipelinePosition::of(&ctx.state, 0);
            let mut chunks = vec![config.init_stage_with_experts(
                g,
                Some(&ctx.groups.experts()),
                position,
                d,
            )?];
            let training = ParallelTrainingConfig::new()
                .with_use_distributed_optimizer(distributed)
                .init(&ctx, &chunks, Arc::new(|s: &str| s.to_string()))?;
            // AdamW's decay by the wrapper (the distributed optimizer's pieces are not the
            // model's parameters), AdamW's default as the reference's.
            let adamw = AdamWConfig::new().with_weight_decay(0.0).init();
            let mut optim = training
                .optimizer(InnerOptimizer::from(adamw), &chunks)?
                .with_clip_grad(1.0, NormType::L2);
            optim.set_weight_decay(1e-4)?;
            let p2p = ctx.p2p(P2pShapes::Fixed {
                dims: vec![SEQ, 1, 32],
                dtype: DType::F32,
            });
            let dp = ctx.state.data_parallel_size();
            let local = SAMPLES / dp;
            let first = ctx.state.data_parallel_rank() * local;
            let mut losses = Vec::new();
            for _ in 0..STEPS {
                let fb = ForwardBackwardConfig::new(PipelineSchedule::new(2, local));
                let out = forward_backward_func(
                    |s: ForwardStep<'_, Gpt, 3>| causal_lm_step(s, first, SEQ, d),
                    &chunks,
                    &p2p,
                    fb,
                )?;
                let mut grads = out.grads;
                training.finalize(&chunks, &mut grads)?;
                chunks = optim.step(1e-3, chunks, grads)?.0;
                if !out.losses.is_empty() {
                    let mut v = vec![mean_reported_loss(&out.losses, local)];
                    ctx.groups.dp.all_reduce_vec(&mut v, ReduceOp::Avg)?;
                    losses.push(v[0]);
                }
            }
            let weights = names(&chunks, gathered(&chunks, None, g));
            Ok::<_, Error>((losses, weights))
        })
        .unwrap();
        let (want_losses, want_weights) = &reference;
        let mut held = Tensors::new();
        for (rank, (losses, weights)) in ranks.into_iter().enumerate() {
            for (step, (a, b)) in losses.iter().zip(want_losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "distributed {distributed} rank {rank} step {step}: loss {a} vs {b}"
                );
            }
            held.extend(weights);
        }
        let (w, at) = max_rel_diff(&held, want_weights, 1e-6);
        assert!(
            w <= 1e-5,
            "distributed {distributed}: weight {at} differs by {w} after {STEPS} steps"
        );
    }
}

/// The gradients of a distributed optimizer's reduction made whole again: each rank holds
/// the reduced values of the elements it owns and zeros elsewhere, so the sum over the
/// data-parallel group (the expert data-parallel group for experts) is the whole gradient.
fn unsharded<M: Module>(
    model: &M,
    grads: &GradientsParams,
    dp: &Comm,
    edp: &Comm,
) -> GradientsParams {
    struct Sum<'a>(&'a GradientsParams, GradientsParams, &'a Comm, &'a Comm);
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                let group = if parallel_attrs(p.id).expert {
                    self.3
                } else {
                    self.2
                };
                let whole = all_reduce(&**group, g, ReduceOp::Sum).expect("sum over the shards");
                self.1.register(p.id, whole);
            }
        }
    }
    let mut sum = Sum(grads, GradientsParams::new(), dp, edp);
    model.visit(&mut sum);
    sum.1
}

/// `run` with the distributed optimizer, through `ParallelTraining` (which plans the experts'
/// shards over expert-DP, reduce-scatters their gradients and shards their state).
fn run_distributed(
    config: &GptConfig,
    (world, tp, ep): (usize, usize, usize),
    fused: bool,
) -> Vec<(Trace, usize)> {
    let layout = ParallelConfig::new(world, tp, 1).with_expert_parallel(ep);
    threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let whole = PipelinePosition::whole();
        let chunks =
            vec![config.init_stage_with_experts(g, Some(&ctx.groups.experts()), whole, d)?];
        let first = chunks[0].layers[0]
            .moe
            .as_ref()
            .expect("layer 0 is MoE")
            .first_expert();
        let training = ParallelTrainingConfig::new()
            .with_use_distributed_optimizer(true)
            .init(&ctx, &chunks, Arc::new(|s: &str| s.to_string()))?;
        let inner = match fused {
            true => InnerOptimizer::from(FusedAdamConfig::new().init()?),
            // AdamW's decay by the wrapper, on the master pieces.
            false => InnerOptimizer::from(AdamWConfig::new().with_weight_decay(0.0).init()),
        };
        let mut optim = training
            .optimizer(inner, &chunks)?
            .with_clip_grad(1.0, NormType::L2);
        if !fused {
            optim.set_weight_decay(1e-4)?; // AdamW's default, as the reference's
        }
        // This rank's master weights (and each moment): 1/DP of its dense elements and
        // 1/EDP of its experts', give or take each bucket's padding.
        let held = optim.state_elements().expect("a distributed optimizer") / 3;
        let (dense, experts) = local_elements(&chunks);
        let (dp, edp) = (
            ctx.groups.dp.group().size(),
            ctx.groups.expert_dp.group().size(),
        );
        let share = dense / dp + experts / edp;
        assert!(
            edp == 2 && held.abs_diff(share) <= 2 * dp,
            "{held} elements held, {share} expected"
        );
        let dp = ctx.state.data_parallel_size();
        let local = GLOBAL_BATCH / dp;
        let b = gpt_rows(ctx.state.data_parallel_rank() * local, local, SEQ, d);
        let mask = Tensor::ones(b.mask.dims(), d);
        let (mut chunks, mut losses, mut norms, mut first_grads) =
            (chunks, Vec::new(), Vec::new(), None);
        for _ in 0..STEPS {
            let logits = chunks[0].forward(b.ids.clone())?;
            let loss = chunks[0].loss(logits, b.labels.clone(), mask.clone())?;
            let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
            training.finalize(&chunks, &mut grads)?;
            if first_grads.is_none() {
                let whole = unsharded(&chunks, &grads, &ctx.groups.dp, &ctx.groups.expert_dp);
                first_grads = Some(gathered(&chunks[0], Some(&whole), g));
            }
            let report;
            (chunks, report) = optim.step(1e-3, chunks, grads)?;
            norms.extend(report.grad_norm);
            losses.push(values(all_reduce(&*ctx.groups.dp, loss.inner(), ReduceOp::Avg)?)[0]);
        }
        Ok::<_, Error>((
            Trace {
                losses,
                norms,
                grads: first_grads.unwrap_or_default(),
                weights: gathered(&chunks[0], None, g),
            },
            first,
        ))
    })
    .unwrap()
}

/// The trained elements of `model`: dense, experts'.
fn local_elements<M: Module>(model: &M) -> (usize, usize) {
    struct Count(usize, usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let n = p.val().shape().num_elements();
            match parallel_attrs(p.id).expert {
                true => self.1 += n,
                false => self.0 += n,
            }
        }
    }
    let mut c = Count(0, 0);
    model.visit(&mut c);
    (c.0, c.1)
}

/// The distributed optimizer shards the experts over their replicas (expert-DP 2 at EP 2 on
/// 4 ranks, and at TP 2 × EP 2): the same losses, gradients and weights as EP 1 without it.
#[test]
fn the_distributed_optimizer_shards_experts_over_expert_data_parallel() {
    let config = moe_llama(TokenDispatcherType::AllToAll);
    let reference = run(&config, (4, 1, 1, false), false);
    for fused in [false, true] {
        let got = run_distributed(&config, (4, 1, 2), fused);
        check(
            &format!("distributed (fused {fused}) EP 2 × EDP 2"),
            &got,
            &reference,
        );
    }
    // DP 2 as the reference's: the load-balancing loss is each replica's own.
    let dp2 = run(&config, (2, 1, 1, false), false);
    let got = run_distributed(&config, (4, 2, 2), true);
    check("distributed fused TP 2 × EP 2 × EDP 2", &got, &dp2);
}

/// Shards without the experts' plans would leave the experts unstepped: refused up front.
#[test]
fn a_distributed_optimizer_without_expert_plans_is_refused() {
    use burn_megatron::data_parallel::advanced::{OptimizerShards, ShardPlan};
    let config = moe_llama(TokenDispatcherType::AllToAll);
    let layout = ParallelConfig::new(2, 1, 1).with_expert_parallel(2);
    threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let whole = PipelinePosition::whole();
        let model = config.init_stage_with_experts(g, Some(&ctx.groups.experts()), whole, d)?;
        let dp = ctx.groups.dp.clone();
        let (size, rank) = (dp.group().size(), dp.group().rank());
        let plan = ShardPlan::new(&model, size, rank, &DataParallelConfig::default(), false);
        let (mp, adam) = (ctx.groups.mp.clone(), FusedAdamConfig::new().init()?);
        let shards = OptimizerShards::new(vec![plan], dp);
        let e = MegatronOptimizer::distributed(adam, &model, shards, mp, 0)
            .expect_err("no expert plans");
        assert!(e.to_string().contains("expert parameters"), "{e}");
        assert!(e.to_string().contains("with_experts"), "{e}");
        Ok::<_, Error>(())
    })
    .unwrap();
}
