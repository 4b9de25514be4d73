//! BERT at TP ∈ {1, 2, 4} (with and without sequence parallelism) × DP ∈ {1, 2}, 10 AdamW
//! steps with dropout off and a fixed global batch: losses within 1e-4 of TP = 1, DP = 1.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor};
use burn_megatron::comm::ReduceOp;
use burn_megatron::comm::tensor::all_reduce;
use burn_megatron::data_parallel::DataParallelConfig;
use burn_megatron::data_parallel::advanced::{DpReduction, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{AttnBackend, AttnMaskType, Bert, BertStageOutput, MaskedPositions};
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer, NormType};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::bert::{BertRows, bert, bert_rows};
use burn_megatron_tests::*;

const GLOBAL_BATCH: usize = 4;
const SEQ: usize = 8;
const VOCAB: usize = 64;
const STEPS: usize = 10;

fn run(tp: usize, dp: usize, sp: bool) -> Vec<Vec<(f32, f32)>> {
    run_on(
        tp,
        dp,
        sp,
        false,
        AttnBackend::Unfused,
        LaunchOptions::default(),
    )
}

/// `fused`: `MegatronOptimizer` around the fused Adam (flat buffers, fused kernels) instead of
/// burn-optim's `AdamW`, same hyper-parameters.
fn run_on(
    tp: usize,
    dp: usize,
    sp: bool,
    fused: bool,
    attention: AttnBackend,
    options: LaunchOptions,
) -> Vec<Vec<(f32, f32)>> {
    let config = ParallelConfig::new(tp * dp, tp, 1);
    threads(&config, options, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let mut model = bert(2, (16, 4, 32), SEQ, VOCAB)
            .map_transformer(no_dropout)
            .map_transformer(|mut t| {
                t.attention.attention_backend = attention;
                t.with_sequence_parallel(sp)
            })
            .init(g, d)?;
        let tp_rank = ctx.state.tensor_model_parallel_rank();
        let mp = ctx.groups.mp.clone();
        let mut optim = if fused {
            let adam = FusedAdamConfig::new().with_no_weight_decay_on_1d(false);
            MegatronOptimizer::new(adam.init()?, &model, mp, tp_rank)
        } else {
            MegatronOptimizer::new(AdamWConfig::new().init(), &model, mp, tp_rank)
        }
        .with_clip_grad(1.0, NormType::L2);
        let local = GLOBAL_BATCH / dp;
        let b = bert_rows(ctx.state.data_parallel_rank() * local, local, SEQ, d);
        let mut out = Vec::new();
        for _ in 0..STEPS {
            let output = model.forward(b.ids.clone(), b.types.clone(), b.padding.clone(), None);
            let (lm, sop) = model.loss(output, b.labels.clone(), b.mask.clone(), b.sop.clone())?;
            let grads = (lm.clone() + sop.clone()).backward();
            let mut grads = GradientsParams::from_grads(grads, &model);
            finalize_model_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.dp),
                g,
                None,
                &DataParallelConfig::default(),
            )?;
            let (m, _) = optim.step(1e-3, model, grads)?;
            model = m;
            let lm = values(all_reduce(&*ctx.groups.dp, lm.inner(), ReduceOp::Avg)?)[0];
            let sop = values(all_reduce(&*ctx.groups.dp, sop.inner(), ReduceOp::Avg)?)[0];
            out.push((lm, sop));
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(out)
    })
    .unwrap()
}

#[test]
fn bert_matches_tp1_dp1_at_every_layout() {
    let one = run(1, 1, false).remove(0);
    assert!(
        one[STEPS - 1].0 < one[0].0,
        "the MLM loss must fall: {one:?}"
    );
    for (tp, dp, sp) in [
        (2, 1, false),
        (4, 1, false),
        (2, 1, true),
        (4, 1, true),
        (1, 2, false),
        (2, 2, false),
        (2, 2, true),
    ] {
        for (rank, trace) in run(tp, dp, sp).into_iter().enumerate() {
            for (step, ((lm, sop), (rlm, rsop))) in trace.iter().zip(&one).enumerate() {
                let what = format!("tp {tp} dp {dp} sp {sp} rank {rank} step {step}");
                assert!((lm - rlm).abs() <= 1e-4, "{what}: lm {lm} vs {rlm}");
                assert!((sop - rsop).abs() <= 1e-4, "{what}: sop {sop} vs {rsop}");
            }
        }
    }
}

/// The same training on the wgpu device (lavapipe on a CPU machine): the fused kernels, the
/// Cube implementations of the mappings and the cross-entropy, and at TP 2 the flash
/// attention kernels, against Flex at TP 1 with the unfused attention. Without
/// the `wgpu` feature the runner lists it as ignored; with it, a missing adapter fails it.
#[test]
#[cfg_attr(
    not(feature = "wgpu"),
    ignore = "needs --features wgpu and a Vulkan driver (Mesa's lavapipe)"
)]
fn bert_on_wgpu_matches_flex() {
    let device = match burn_megatron_kernels::device::wgpu_cpu_device() {
        Ok(device) => device.autodiff(),
        Err(e) => panic!("no wgpu device: {e}; install mesa-vulkan-drivers"),
    };
    let one = run(1, 1, false).remove(0);
    // The fused optimizer's kernels (sums of squares, Adam) run on lavapipe in two layouts.
    for (tp, dp, sp, fused, attention) in [
        (1, 1, false, true, AttnBackend::Unfused),
        (2, 1, true, false, AttnBackend::Flash),
        (2, 2, false, true, AttnBackend::Unfused),
    ] {
        let device = device.clone();
        let options = LaunchOptions::default().with_device(move |_| device.clone());
        let traces = run_on(tp, dp, sp, fused, attention, options);
        for (rank, trace) in traces.into_iter().enumerate() {
            for (step, ((lm, sop), (rlm, rsop))) in trace.iter().zip(&one).enumerate() {
                let what = format!(
                    "wgpu tp {tp} dp {dp} sp {sp} fused {fused} {attention:?} rank {rank} step {step}"
                );
                // Two backends' f32 arithmetic (reduction orders, erf and exp fits) through
                // 10 AdamW steps.
                assert!((lm - rlm).abs() <= 2e-4, "{what}: lm {lm} vs {rlm}");
                assert!((sop - rsop).abs() <= 2e-4, "{what}: sop {sop} vs {rsop}");
            }
        }
    }
}

/// A token id beyond the vocabulary, a token type beyond `num_tokentypes` and a sequence
/// longer than `max_position_embeddings` are refused with the same message at TP 1 and TP 2
/// (a vocabulary-parallel lookup would otherwise embed an unknown id as zeros).
#[test]
fn inputs_outside_the_embeddings_are_refused_alike_at_every_tp_size() {
    let messages = |tp: usize| {
        let config = ParallelConfig::new(tp, tp, 1);
        threads(&config, LaunchOptions::default(), |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = bert(2, (16, 4, 32), SEQ, VOCAB).init(g, d)?;
            let try_with = |edit: &dyn Fn(&mut BertRows)| {
                let mut b = bert_rows(0, 2, SEQ, d);
                edit(&mut b);
                let tokens = Some((b.ids, b.types));
                model
                    .forward_stage(tokens, None, b.padding, None)
                    .err()
                    .map(|e| e.to_string())
            };
            let set = |t: &Tensor<2, Int>, v: i64| t.clone().slice_fill([1..2, 3..4], v);
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(vec![
                try_with(&|_| ()),
                try_with(&|b| b.ids = set(&b.ids, VOCAB as i64)),
                try_with(&|b| b.ids = set(&b.ids, -1)),
                try_with(&|b| b.types = set(&b.types, 2)),
                try_with(&|b| *b = bert_rows(0, 2, SEQ + 1, d)),
            ])
        })
        .unwrap()
        .remove(0)
    };
    let one = messages(1);
    assert_eq!(one[0], None, "in-range inputs pass");
    let expect = [
        "token id 64 is outside [0, 64)",
        "token id -1 is outside [0, 64)",
        "token type 2 is outside [0, 2)",
        "sequence length 9 exceeds max_position_embeddings 8",
    ];
    for (got, want) in one[1..].iter().zip(expect) {
        let got = got.as_deref().unwrap_or("no error");
        assert!(got.contains(want), "{got:?} should contain {want:?}");
    }
    assert_eq!(
        messages(2),
        one,
        "TP 2 refuses the same inputs with the same messages"
    );
}

/// A normal of negative or NaN std and an inverted uniform range are refused at `init`,
/// naming the distribution, instead of panicking while drawing.
#[test]
fn impossible_initialisers_are_refused_at_init() {
    use burn_megatron::tensor_parallel::{ColumnParallelLinearConfig, MasterInit};
    let world = burn_megatron::comm::LocalWorld::new(1);
    let tp: burn_megatron::comm::Comm =
        std::sync::Arc::new(world.communicator("tp", vec![0], 0).unwrap());
    let d = burn::tensor::Device::flex();
    for std in [-0.02, f64::NAN] {
        let e = bert(2, (16, 4, 32), SEQ, VOCAB)
            .map_transformer(|t| t.with_initializer(MasterInit::Normal { mean: 0.0, std }))
            .init(&tp, &d)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("std: {std}")), "{e}");
    }
    // A causal mask in BERT's bidirectional encoder.
    let mut causal = bert(2, (16, 4, 32), SEQ, VOCAB);
    causal.transformer.attention.attn_mask_type = AttnMaskType::Causal;
    let e = causal.init(&tp, &d).unwrap_err().to_string();
    assert!(e.contains("bidirectional"), "{e}");
    // A norm epsilon the norms cannot use: an error naming it, not a panic in forward.
    for eps in [-1e-5, 0.0, f64::INFINITY] {
        let e = bert(2, (16, 4, 32), SEQ, VOCAB)
            .map_transformer(|t| t.with_layernorm_epsilon(eps))
            .init(&tp, &d)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "layernorm_epsilon must be finite and positive, got {eps}"
            )),
            "{e}"
        );
    }
    let e = ColumnParallelLinearConfig::new(4, 4)
        .with_initializer(MasterInit::Uniform {
            low: 1.0,
            high: 0.5,
        })
        .init(&tp, &d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("low: 1.0, high: 0.5"), "{e}");
}

/// Burn's record loading (`save_file` / `load_file`) gives every parameter the id it was
/// saved with; saved by another process, those ids mean nothing to this one's attribute
/// table. The layers state their layout again at forward, so a TP 2 model with sequence
/// parallelism, reloaded that way, still has TP 1's gradient norm: its shards count as
/// shards and its LayerNorm gradients are all-reduced.
#[test]
fn a_model_reloaded_through_burn_records_keeps_its_parallel_attributes() {
    use burn_megatron::optimizer::global_grad_norm;
    use burn_megatron::tensor_parallel::{ParallelAttrs, parallel_attrs};
    let norm = |tp: usize| {
        let config = ParallelConfig::new(tp, tp, 1);
        threads(&config, LaunchOptions::default(), |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let bert = bert(2, (16, 4, 32), SEQ, VOCAB)
                .map_transformer(no_dropout)
                .map_transformer(|t| t.with_sequence_parallel(tp > 1));
            let tp_rank = ctx.state.tensor_model_parallel_rank();
            // Another seed for the model loaded into: the values must come from the file.
            let model = reload_as_another_process(
                bert.init(g, d)?,
                (bert.clone())
                    .map_transformer(|t| t.with_seed(99))
                    .init(g, d)?,
                &std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                    .join(format!("reload-tp{tp}-rank{tp_rank}.bpk")),
            );
            let qkv = model.layers[0].attention.query_key_value.weight.id;
            assert_eq!(
                parallel_attrs(qkv),
                ParallelAttrs::default(),
                "nothing known of the loaded ids before a forward"
            );
            let b = bert_rows(0, GLOBAL_BATCH, SEQ, d);
            let output = model.forward(b.ids, b.types, b.padding, None);
            let (lm, sop) = model.loss(output, b.labels, b.mask, b.sop)?;
            let mut grads = GradientsParams::from_grads((lm + sop).backward(), &model);
            assert_eq!(parallel_attrs(qkv), ParallelAttrs::sharded(1));
            finalize_model_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.dp),
                g,
                None,
                &DataParallelConfig::default(),
            )?;
            let norm = global_grad_norm(&model, &grads, tp_rank, &ctx.groups.mp, NormType::L2)?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(norm)
        })
        .unwrap()
    };
    let one = norm(1)[0];
    for (rank, two) in norm(2).into_iter().enumerate() {
        let rel = (two - one).abs() / one;
        assert!(rel <= 1e-5, "rank {rank}: TP 2 norm {two} vs TP 1 {one}");
    }
}

/// Every parameter's gradient, in visiting order (`None` where the parameter got none).
fn gradients(model: &Bert, grads: &GradientsParams) -> Vec<Option<Vec<f32>>> {
    struct Grads<'a>(&'a GradientsParams, Vec<Option<Vec<f32>>>);
    impl burn::module::ModuleVisitor for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.1.push(self.0.get::<D>(param.id).map(values));
        }
    }
    let mut g = Grads(grads, Vec::new());
    model.visit(&mut g);
    g.1
}

/// The MLM head on the masked positions only (what `bert_pretrain` trains with) gives the
/// all-position MLM loss and every parameter's gradient within 1e-6: at TP 1, at TP 2 with
/// sequence parallelism, and for a batch whose loss mask is empty (loss 0).
#[test]
fn the_masked_position_head_gives_the_all_position_loss_and_gradients() {
    for (tp, sp) in [(1, false), (2, true)] {
        let config = ParallelConfig::new(tp, tp, 1);
        let per_rank = threads(&config, LaunchOptions::default(), |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = bert(2, (16, 4, 32), SEQ, VOCAB)
                .map_transformer(no_dropout)
                .map_transformer(|t| t.with_sequence_parallel(sp))
                .init(g, d)?;
            let b = bert_rows(0, GLOBAL_BATCH, SEQ, d);
            let run = |mask: &Tensor<2>, positions: Option<&MaskedPositions>| {
                let tokens = Some((b.ids.clone(), b.types.clone()));
                let out = match model.forward_stage_with_positions(
                    tokens,
                    None,
                    b.padding.clone(),
                    None,
                    positions,
                )? {
                    BertStageOutput::Output(out) => out,
                    BertStageOutput::Hidden(_) => unreachable!("the whole model"),
                };
                let (lm, sop) = model.loss(out, b.labels.clone(), mask.clone(), b.sop.clone())?;
                let grads = GradientsParams::from_grads((lm.clone() + sop).backward(), &model);
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
                    values(lm)[0],
                    gradients(&model, &grads),
                ))
            };
            let mut out = Vec::new();
            for mask in [b.mask.clone(), b.mask.zeros_like()] {
                let positions = MaskedPositions::from_loss_mask(&mask)?;
                out.push((run(&mask, None)?, run(&mask, Some(&positions))?));
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(out)
        })
        .unwrap();
        for (rank, cases) in per_rank.into_iter().enumerate() {
            for (case, ((lm_all, g_all), (lm_masked, g_masked))) in cases.into_iter().enumerate() {
                let what = format!("tp {tp} rank {rank} mask {case}");
                assert_eq!(lm_all == 0.0, case == 1, "{what}: lm {lm_all}");
                assert!(
                    (lm_all - lm_masked).abs() <= 1e-6,
                    "{what}: all-position lm {lm_all} vs masked {lm_masked}"
                );
                assert_eq!(g_all.len(), g_masked.len());
                let word_embeddings = g_all[0].as_ref().expect("a word-embedding gradient");
                assert!(word_embeddings.iter().any(|v| *v != 0.0), "{what}");
                for (i, (a, m)) in g_all.iter().zip(&g_masked).enumerate() {
                    match (a, m) {
                        (Some(a), Some(m)) => assert_close(a, m, 1e-6, &format!("{what} grad {i}")),
                        (a, m) => assert_eq!(a.is_some(), m.is_some(), "{what} grad {i}"),
                    }
                }
            }
        }
    }
}

/// BERT under context parallelism (CP 2 and 4, TP 2 × CP 2 with SP; `all_gather`, `p2p`
/// and `a2a`): each rank holds chunks r and 2·CP−1−r of every sequence, attention is
/// bidirectional over the padded keys of the whole sequence, the MLM head runs on the
/// rank's masked positions, the MLM loss counts the whole sequences' masked tokens and the
/// binary (SOP) head counts CP rank 0's [CLS] only. With the loss × CP and gradients
/// averaged over DP × CP, as Megatron, 10 AdamW steps' losses, the first step's gathered
/// gradients and the final weights equal the unsplit model's within 1e-5.
#[test]
fn bert_with_context_parallelism_matches_one_rank() {
    use burn_megatron::context_parallel::{ContextParallel, CpCommType};
    use burn_megatron_tests::gpt::{gathered, max_rel_diff};
    use std::collections::BTreeMap;
    const CP_SEQ: usize = 16;
    type Tensors = BTreeMap<String, Vec<f32>>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    let run = |tp: usize, cp: usize, sp: bool, comm_type: CpCommType| {
        let layout = ParallelConfig::new(tp * cp, tp, 1).with_context_parallel(cp);
        threads(&layout, LaunchOptions::default(), |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let mut model = bert(2, (16, 4, 32), CP_SEQ, VOCAB)
                .map_transformer(no_dropout)
                .map_transformer(|t| t.with_sequence_parallel(sp))
                .init(g, d)?;
            let tp_rank = ctx.state.tensor_model_parallel_rank();
            let mp = ctx.groups.mp.clone();
            let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, mp, tp_rank)
                .with_clip_grad(1.0, NormType::L2);
            let split =
                ContextParallel::new(ctx.groups.cp.clone(), CP_SEQ)?.with_comm_type(comm_type);
            let mut b = bert_rows(0, 2, CP_SEQ, d);
            // Sample 1's last 6 keys padded (not only bert_rows' 2), so that padding in the
            // wrong order shows at once; none of them is predicted.
            let padded = Tensor::<1, Int>::arange(0..CP_SEQ as i64, d)
                .greater_equal_elem(CP_SEQ as i64 - 6)
                .unsqueeze::<2>()
                .bool_and(Tensor::<2, Int>::from_data([[0], [1]], d).equal_elem(1));
            b.padding = b.padding.bool_or(padded.clone());
            b.mask = b.mask.mask_fill(padded, 0.0);
            let (ids, types) = (
                split.split_tensor(b.ids, 1)?,
                split.split_tensor(b.types, 1)?,
            );
            let (labels, mask) = (
                split.split_tensor(b.labels, 1)?,
                split.split_tensor(b.mask, 1)?,
            );
            let positions = MaskedPositions::from_loss_mask(&mask)?;
            let (mut losses, mut first_grads) = (Vec::new(), None);
            for _ in 0..STEPS {
                // The reference is the model's own unsplit path (every position's head).
                let (lm, sop) = if cp == 1 {
                    let out = model.forward(ids.clone(), types.clone(), b.padding.clone(), None);
                    model.loss(out, labels.clone(), mask.clone(), b.sop.clone())?
                } else {
                    let tokens = Some((ids.clone(), types.clone()));
                    let pad = b.padding.clone();
                    let out = match model.forward_stage_cp(
                        tokens,
                        None,
                        pad,
                        None,
                        Some(&positions),
                        &split,
                    )? {
                        BertStageOutput::Output(out) => out,
                        BertStageOutput::Hidden(_) => unreachable!("the whole model"),
                    };
                    model.loss_cp(out, labels.clone(), mask.clone(), b.sop.clone(), &split)?
                };
                let reported = (
                    split.sum(values(lm.clone())[0])?,
                    split.sum(values(sop.clone())[0])?,
                );
                let loss = (lm + sop) * cp as f32;
                let mut grads = GradientsParams::from_grads(loss.backward(), &model);
                let dp_cp = &ctx.groups.dp_cp;
                finalize_model_grads(
                    &model,
                    &mut grads,
                    DpReduction::AllReduce(dp_cp),
                    g,
                    None,
                    &DataParallelConfig::default(),
                )?;
                if first_grads.is_none() {
                    first_grads = Some(gathered(&model, Some(&grads), g));
                }
                model = optim.step(1e-3, model, grads)?.0;
                losses.push(reported);
            }
            let weights = gathered(&model, None, g);
            Ok::<(Vec<(f32, f32)>, Tensors, Tensors), Error>((
                losses,
                first_grads.unwrap_or_default(),
                weights,
            ))
        })
        .unwrap()
    };
    let (one, one_grads, one_weights) = run(1, 1, false, CpCommType::AllGather).remove(0);
    assert!(
        one[STEPS - 1].0 < one[0].0 - 0.1,
        "the MLM loss must fall: {one:?}"
    );
    let comm_types = [CpCommType::AllGather, CpCommType::P2p, CpCommType::A2a];
    for ((tp, cp, sp), comm) in [(1, 2, false), (1, 4, false), (2, 2, true)]
        .into_iter()
        .flat_map(|l| comm_types.map(|c| (l, c)))
    {
        for (rank, (losses, grads, weights)) in run(tp, cp, sp, comm).into_iter().enumerate() {
            let what = format!("tp {tp} cp {cp} sp {sp} {comm:?} rank {rank}");
            let (g, at) = max_rel_diff(&grads, &one_grads, 1e-6);
            assert!(
                g <= 1e-5,
                "{what}: gradient of {at} differs by {g} (relative)"
            );
            for (step, ((lm, sop), (rlm, rsop))) in losses.iter().zip(&one).enumerate() {
                assert!(
                    (lm - rlm).abs() <= 1e-5,
                    "{what} step {step}: lm {lm} vs {rlm}"
                );
                assert!(
                    (sop - rsop).abs() <= 1e-5,
                    "{what} step {step}: sop {sop} vs {rsop}"
                );
            }
            let (w, at) = max_rel_diff(&weights, &one_weights, 1e-6);
            assert!(
                w <= 1e-5,
                "{what}: weight {at} differs by {w} after {STEPS} steps"
            );
        }
    }
}

/// Under context parallelism, token ids that are not this rank's share, a padding mask that
/// is not the whole sequences', and `a2a` with heads that do not split over CP are errors
/// naming the numbers, before any collective (every rank returns).
#[test]
fn context_parallel_inputs_are_refused_before_any_collective() {
    use burn::tensor::Bool;
    use burn_megatron::context_parallel::{ContextParallel, CpCommType};
    let layout = ParallelConfig::new(2, 1, 1).with_context_parallel(2);
    let errors = threads(&layout, LaunchOptions::default(), |ctx| {
        let d = &ctx.device;
        let config = bert(1, (12, 3, 24), 16, VOCAB);
        let model = config.init(&ctx.groups.tp, d)?;
        let cp = ContextParallel::new(ctx.groups.cp.clone(), 16)?;
        let tokens =
            |s: usize| Some((Tensor::<2, Int>::zeros([2, s], d), Tensor::zeros([2, s], d)));
        let pad = |s: usize| Tensor::<2, Bool>::empty([2, s], d).equal_elem(true);
        let err = |r: Result<BertStageOutput, _>| {
            r.err()
                .map(|e: burn_megatron::tensor_parallel::TpError| e.to_string())
                .unwrap_or_default()
        };
        let a2a = cp.clone().with_comm_type(CpCommType::A2a);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>([
            err(model.forward_stage_cp(tokens(16), None, pad(16), None, None, &cp)),
            err(model.forward_stage_cp(tokens(8), None, pad(8), None, None, &cp)),
            err(model.forward_stage_cp(tokens(8), None, pad(16), None, None, &a2a)),
        ])
    })
    .unwrap();
    for [ids, padding, heads] in errors {
        assert!(ids.contains("[2, 16]") && ids.contains("8 of 16"), "{ids}");
        assert!(
            padding.contains("[2, 8]") && padding.contains("of 16"),
            "{padding}"
        );
        assert!(
            heads.contains("the 3 heads") && heads.contains("--context-parallel-size 2"),
            "{heads}"
        );
    }
}
