//! Context parallelism (`all_gather`, `p2p` and `a2a`): a sequence split over CP ∈ {2, 4}
//! (with TP 2 and SP too) trains as the unsplit sequence does. Each rank holds chunks r and
//! 2·CP−1−r; K and V are all-gathered over CP, passed around the ring, or traded for heads
//! (Ulysses, with query groups repeated per head where they do not split over CP); the loss counts the whole sequence's tokens, and gradients are
//! reduced as Megatron reduces them (loss × CP, averaged over DP × CP): 10 AdamW steps'
//! losses, the first step's gathered gradients and the final weights equal one rank's
//! within 1e-5, for a Llama-style (rotary) and a GPT-2-style (learned positions) model.

use super::Error;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::context_parallel::{ContextParallel, CpCommType};
use burn_megatron::data_parallel::DataParallelConfig;
use burn_megatron::data_parallel::advanced::{DpReduction, finalize_model_grads};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{GptConfig, GptStageOutput};
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::bert::layer;
use burn_megatron_tests::gpt::{gathered, gpt_rows, gpt2, llama, max_rel_diff};
use burn_megatron_tests::{no_dropout, values};
use std::collections::BTreeMap;

const BATCH: usize = 2;
const SEQ: usize = 16;
const STEPS: usize = 10;

type Tensors = BTreeMap<String, Vec<f32>>;

struct Trace {
    losses: Vec<f32>,
    grads: Tensors,
    weights: Tensors,
}

/// Each of the `b` rows of `values` (`[b, SEQ]`, row-major) split to this rank's tokens.
fn split<T: Clone>(values: &[T], cp: &ContextParallel) -> Vec<T> {
    values
        .chunks(SEQ)
        .flat_map(|row| cp.split(row).unwrap())
        .collect()
}

/// `n` host values, a pattern of period 101 set by `k`.
fn host(n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * k + 7) % 101) as f32 / 101.0 - 0.5)
        .collect()
}

/// The rows (dim 0, `row` values each) of `v` at `positions`.
fn rows_at(v: &[f32], positions: &[usize], row: usize) -> Vec<f32> {
    positions
        .iter()
        .flat_map(|&p| v[p * row..(p + 1) * row].to_vec())
        .collect()
}

const COMM_TYPES: [CpCommType; 3] = [CpCommType::AllGather, CpCommType::P2p, CpCommType::A2a];

fn run(config: &GptConfig, tp: usize, cp: usize, sp: bool, comm_type: CpCommType) -> Vec<Trace> {
    let layout = ParallelConfig::new(tp * cp, tp, 1).with_context_parallel(cp);
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
        let split_cp = ContextParallel::new(ctx.groups.cp.clone(), SEQ)?.with_comm_type(comm_type);
        let rows = gpt_rows(0, BATCH, SEQ, d);
        let local = SEQ / cp;
        let ints = |t: &Tensor<2, Int>| {
            let v: Vec<i64> = t.clone().into_data().convert::<i64>().try_to_vec().unwrap();
            Tensor::<2, Int>::from_data(TensorData::new(split(&v, &split_cp), [BATCH, local]), d)
        };
        let (ids, labels) = (ints(&rows.ids), ints(&rows.labels));
        let mask: Vec<f32> = rows.mask.clone().into_data().try_to_vec().unwrap();
        let mask =
            Tensor::<2>::from_data(TensorData::new(split(&mask, &split_cp), [BATCH, local]), d);
        let (mut losses, mut first_grads) = (Vec::new(), None);
        for _ in 0..STEPS {
            // The reference is the model's own causal path (the fused kernel's causal mode),
            // not the CP path at CP 1.
            let loss = if cp == 1 {
                let logits = model.forward(ids.clone())?;
                model.loss(logits, labels.clone(), mask.clone())?
            } else {
                let GptStageOutput::Logits(logits) =
                    model.forward_stage_cp(Some(ids.clone()), None, None, &split_cp)?
                else {
                    unreachable!("one stage ends in logits")
                };
                model.loss_cp(logits, labels.clone(), mask.clone(), &split_cp)?
            };
            let reported = split_cp.sum(values(loss.clone().inner())[0])?;
            let mut grads = GradientsParams::from_grads((loss * cp as f32).backward(), &model);
            finalize_model_grads(
                &model,
                &mut grads,
                DpReduction::AllReduce(&ctx.groups.dp_cp),
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
        Ok::<_, Error>(Trace {
            losses,
            grads: first_grads.unwrap_or_default(),
            weights: gathered(&model, None, g),
        })
    })
    .unwrap()
}

fn check(name: &str, config: &GptConfig, layouts: &[(usize, usize, bool)]) {
    check_against(name, config, config, layouts)
}

/// `config` at each layout and comm type against `reference` on one rank.
fn check_against(
    name: &str,
    reference: &GptConfig,
    config: &GptConfig,
    layouts: &[(usize, usize, bool)],
) {
    let one = run(reference, 1, 1, false, CpCommType::AllGather).remove(0);
    assert!(
        one.losses[STEPS - 1] < one.losses[0] - 0.1,
        "{name}: {:?}",
        one.losses
    );
    for (&(tp, cp, sp), comm) in layouts.iter().flat_map(|l| COMM_TYPES.map(|c| (l, c))) {
        for (rank, t) in run(config, tp, cp, sp, comm).into_iter().enumerate() {
            let what = format!("{name} tp {tp} cp {cp} sp {sp} {comm:?} rank {rank}");
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
                "{what}: weight {at} differs by {w} after {STEPS} steps"
            );
        }
    }
}

#[test]
fn llama_style_gpt_with_context_parallelism_matches_one_rank() {
    check(
        "llama",
        &llama(2, SEQ),
        &[(1, 2, false), (1, 4, false), (2, 2, true)],
    );
}

/// The chunked attention (blocks of 3 rows) in CP's all-gather and Ulysses paths (the ring
/// attends its blocks with Burn ops under it), against one rank's unfused attention.
#[test]
fn chunked_attention_under_context_parallelism_matches_one_unfused_rank() {
    let unfused = llama(2, SEQ);
    let chunked = (unfused.clone()).map_transformer(|mut t| {
        t.attention.attention_backend = burn_megatron::models::AttnBackend::Chunked;
        t.attention.attention_query_chunk = 3;
        t
    });
    check_against("llama chunked", &unfused, &chunked, &[(1, 2, false)]);
}

/// The flash attention in every CP path (the ring attends each block with the flash op and
/// merges them by their log-sum-exps; its backward replays each block from the merged
/// statistics), against one rank's unfused attention, at CP 2 and at CP 4 (more steps of
/// the ring, blocks off the diagonal).
#[test]
fn flash_attention_under_context_parallelism_matches_one_unfused_rank() {
    let unfused = llama(2, SEQ);
    let flash = (unfused.clone()).map_transformer(|mut t| {
        t.attention.attention_backend = burn_megatron::models::AttnBackend::Flash;
        t
    });
    check_against(
        "llama flash",
        &unfused,
        &flash,
        &[(1, 2, false), (1, 4, false)],
    );
}

#[test]
fn gpt2_style_gpt_with_context_parallelism_matches_one_rank() {
    check("gpt2", &gpt2(2, SEQ), &[(1, 2, false), (2, 2, false)]);
}

#[test]
fn a_sequence_not_divisible_by_twice_cp_is_refused() {
    let layout = ParallelConfig::new(2, 1, 1).with_context_parallel(2);
    let errors = threads(&layout, LaunchOptions::default(), |ctx| {
        Ok::<_, Error>(
            ContextParallel::new(ctx.groups.cp.clone(), 6)
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap();
    assert!(
        errors[0].contains("--seq-length 6") && errors[0].contains("(4)"),
        "{}",
        errors[0]
    );
}

/// Ulysses trades sequence for heads: heads that do not split over CP are refused by the
/// model's forward, naming both numbers, before any collective.
#[test]
fn a2a_with_heads_not_divisible_by_cp_is_refused() {
    let layout = ParallelConfig::new(3, 1, 1).with_context_parallel(3);
    let config = gpt2(1, 12);
    let errors = threads(&layout, LaunchOptions::default(), |ctx| {
        let model = config.init(&ctx.groups.tp, &ctx.device)?;
        let cp = ContextParallel::new(ctx.groups.cp.clone(), 12)?.with_comm_type(CpCommType::A2a);
        let ids = Tensor::<2, Int>::zeros([1, 4], &ctx.device);
        Ok::<_, Error>(
            model
                .forward_stage_cp(Some(ids), None, None, &cp)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default(),
        )
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("the 4 heads") && e.contains("--context-parallel-size 3"),
            "{e}"
        );
    }
}

/// Bidirectional attention (BERT's layer: padding mask, no causal mask) under CP 2 and 4,
/// unfused and flash: each rank's outputs and input gradients are the unsplit unfused
/// layer's at its positions, and the parameter gradients summed over CP are the unsplit ones
/// (keys padded at the end of one sample, so the gathered padding must follow the gathered
/// keys' order; with flash, the ring's blocks take each block's padding).
#[test]
fn bidirectional_attention_under_context_parallelism_matches_one_rank() {
    use burn::tensor::{Bool, Device};
    use burn_megatron::comm::{CommunicatorExt, ReduceOp};
    use burn_megatron::models::{AttentionInputs, AttnBackend, CpAttention};
    const S: usize = 16;
    const B: usize = 2;
    const H: usize = 32;
    let padded: Vec<Vec<bool>> = (0..B)
        .map(|b| (0..S).map(|j| b == 1 && j >= S - 3).collect())
        .collect();
    let rows = |v: &[f32], positions: &[usize]| rows_at(v, positions, B * H);
    let layouts = [2, 4]
        .into_iter()
        .flat_map(|cp| COMM_TYPES.map(|c| (cp, c)));
    let backends = [AttnBackend::Unfused, AttnBackend::Flash];
    for ((cp, comm_type), backend) in layouts.flat_map(|l| backends.map(|b| (l, b))) {
        let layout = ParallelConfig::new(cp, 1, 1).with_context_parallel(cp);
        let out = threads(&layout, LaunchOptions::default(), |ctx| {
            let d: &Device = &ctx.device;
            let reference = no_dropout(layer(H, 4, 64)).init(&ctx.groups.tp, d)?;
            let mut config = no_dropout(layer(H, 4, 64));
            config.attention.attention_backend = backend;
            // The same seeds: the same weights as the reference.
            let split_layer = config.init(&ctx.groups.tp, d)?;
            let (x, w) = (host(S * B * H, 37), host(S * B * H, 53));
            let run = |layer: &burn_megatron::models::TransformerLayer,
                       x: Vec<f32>,
                       w: Vec<f32>,
                       s: usize,
                       inputs: &AttentionInputs| {
                let x = Tensor::<3>::from_data(TensorData::new(x, [s, B, H]), d).require_grad();
                let w = Tensor::<3>::from_data(TensorData::new(w, [s, B, H]), d);
                let y = layer.forward(x.clone(), inputs, None);
                let grads = (y.clone() * w).sum().backward();
                let gx: Vec<f32> = x.grad(&grads).unwrap().into_data().try_to_vec().unwrap();
                let gp = gathered(
                    layer,
                    Some(&GradientsParams::from_grads(grads, layer)),
                    &ctx.groups.tp,
                );
                (values(y.inner()), gx, gp)
            };
            let flat: Vec<bool> = padded.concat();
            let full_pad = Tensor::<2, Bool>::from_data(TensorData::new(flat, [B, S]), d);
            let full = AttentionInputs::padding(full_pad);
            let (y1, gx1, gp1) = run(&reference, x.clone(), w.clone(), S, &full);
            let split = ContextParallel::new(ctx.groups.cp.clone(), S)?.with_comm_type(comm_type);
            let inputs = AttentionInputs {
                padding: Some(split.gathered_padding(&padded, d)?),
                rotary: None,
                context_parallel: Some(CpAttention {
                    cp: split.clone(),
                    causal: false,
                }),
            };
            let pos = split.positions().to_vec();
            let (y, gx, mut gp) = run(
                &split_layer,
                rows(&x, &pos),
                rows(&w, &pos),
                pos.len(),
                &inputs,
            );
            for v in gp.values_mut() {
                ctx.groups.cp.all_reduce_vec(v, ReduceOp::Sum)?;
            }
            Ok::<_, Error>((y, rows(&y1, &pos), gx, rows(&gx1, &pos), gp, gp1))
        })
        .unwrap();
        for (rank, (y, y1, gx, gx1, gp, gp1)) in out.into_iter().enumerate() {
            let close = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
                    .fold(0.0f32, f32::max)
            };
            assert!(
                close(&y, &y1) <= 1e-5,
                "cp {cp} {comm_type:?} {backend:?} rank {rank}: outputs differ by {}",
                close(&y, &y1)
            );
            assert!(
                close(&gx, &gx1) <= 1e-4,
                "cp {cp} {comm_type:?} {backend:?} rank {rank}: input gradients differ by {}",
                close(&gx, &gx1)
            );
            let (g, at) = max_rel_diff(&gp, &gp1, 1e-6);
            assert!(
                g <= 1e-5,
                "cp {cp} {comm_type:?} {backend:?} rank {rank}: gradient of {at} differs by {g}"
            );
        }
    }
}

/// Ring attention is one op with a handwritten backward that replays the forward's
/// attention dropout: with dropout 0.3 at CP 2, the gradient of a causal layer's output with
/// respect to its QKV weight (which reaches the output only through attention) equals the
/// central difference of its own forward (the same seed each time) along a direction,
/// summed over the CP ranks, with the blocks attended by Burn ops and by the flash op. The
/// two draw one seed per block in the same order and hash the same indices, so they drop the
/// same elements: equal outputs and gradients. The forward sends and receives CP − 1
/// blocks per layer, the backward 2·(CP − 1) + 1 (the K/V blocks with their gradients, and
/// the gradients home); with flash, each rank's 5 visible blocks are 5 flash calls each way.
#[test]
fn ring_attention_with_dropout_has_the_gradient_of_its_forward() {
    use burn::module::Param;
    use burn::tensor::Device;
    use burn_megatron::context_parallel::RingStats;
    use burn_megatron::models::{AttentionInputs, AttnBackend, CpAttention};
    use burn_megatron::tensor_parallel::RngTracker;
    use burn_megatron_kernels::thread_flash_launches;
    const S: usize = 16;
    const B: usize = 2;
    const H: usize = 32;
    let layout = ParallelConfig::new(2, 1, 1).with_context_parallel(2);
    let run = |backend: AttnBackend| {
        threads(&layout, LaunchOptions::default(), |ctx| {
            let d: &Device = &ctx.device;
            let mut layer = layer(H, 4, 64).with_hidden_dropout(0.0);
            layer.attention.attention_dropout = 0.3;
            layer.attention.attention_backend = backend;
            let layer = layer.init(&ctx.groups.tp, d)?;
            let cp =
                ContextParallel::new(ctx.groups.cp.clone(), S)?.with_comm_type(CpCommType::P2p);
            let inputs = AttentionInputs {
                context_parallel: Some(CpAttention {
                    cp: cp.clone(),
                    causal: true,
                }),
                ..AttentionInputs::default()
            };
            let local = S / 2 * B * H;
            let r = cp.rank();
            // This rank's part of one pattern over the whole sequence.
            let part = |n: usize, k: usize| host((r + 1) * n, k)[r * n..].to_vec();
            let tensor = |v: Vec<f32>| Tensor::<3>::from_data(TensorData::new(v, [S / 2, B, H]), d);
            let (x, w) = (tensor(part(local, 37)), tensor(part(local, 53)));
            let weight = &layer.attention.query_key_value.weight;
            let dims = weight.dims();
            // One direction for every rank: the weight is the same on each.
            let dir: Vec<f32> = (0..dims[0] * dims[1])
                .map(|i| ((i * 61 + 7) % 101) as f32 / 101.0 - 0.5)
                .collect();
            let direction = Tensor::<2>::from_data(TensorData::new(dir.clone(), dims), d);
            let f = |layer: &burn_megatron::models::TransformerLayer, rng: Option<&RngTracker>| {
                (layer.forward(x.clone(), &inputs, rng) * w.clone()).sum()
            };
            let seeded = || RngTracker::new(7, 0);
            let calls = || thread_flash_launches().composed;
            let before = calls();
            let loss = f(&layer, Some(&seeded()));
            let flash_forward = calls() - before;
            let counts = |s: RingStats| (s.sends, s.received.len());
            let forward = counts(cp.take_ring_stats());
            let grads = loss.clone().backward();
            let flash_backward = calls() - before - flash_forward;
            let backward = counts(cp.take_ring_stats());
            let g: Vec<f32> = weight
                .val()
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec()
                .unwrap();
            let analytic = cp.sum(g.iter().zip(&dir).map(|(g, v)| g * v).sum::<f32>())?;
            let eps = 1e-2;
            let shifted = |sign: f32| -> Result<f32, Error> {
                let mut moved = layer.clone();
                let step = direction.clone().mul_scalar(sign * eps);
                let moved_weight = (weight.val().detach() + step).into_data();
                moved.attention.query_key_value.weight =
                    Param::from_tensor(Tensor::from_data(moved_weight, d));
                Ok(cp.sum(values(f(&moved, Some(&seeded())).inner())[0])?)
            };
            let numeric = (shifted(1.0)? - shifted(-1.0)?) / (2.0 * eps);
            let plain = values(f(&layer, None).inner())[0];
            let dropped = values(loss.inner())[0];
            Ok::<_, Error>((
                (analytic, numeric, plain - dropped),
                (forward, backward),
                (flash_forward, flash_backward),
                dropped,
            ))
        })
        .unwrap()
    };
    let (unfused, flash) = (run(AttnBackend::Unfused), run(AttnBackend::Flash));
    for (backend, out, calls) in [("unfused", &unfused, 0), ("flash", &flash, 5)] {
        for (rank, ((analytic, numeric, changed), sent, flash_calls, _)) in out.iter().enumerate() {
            let what = format!("{backend} rank {rank}");
            assert!(
                changed.abs() > 1e-3,
                "{what}: dropout must change the output ({changed})"
            );
            assert!(
                (analytic - numeric).abs() <= 5e-3 * numeric.abs().max(0.1),
                "{what}: gradient {analytic} vs central difference {numeric}"
            );
            assert_eq!(*sent, ((1, 1), (3, 3)), "{what}: blocks sent, received");
            assert_eq!(*flash_calls, (calls, calls), "{what}: flash calls each way");
        }
    }
    for (rank, (u, f)) in unfused.iter().zip(&flash).enumerate() {
        let (loss, grad) = ((u.3, f.3), (u.0.0, f.0.0));
        assert!(
            (loss.0 - loss.1).abs() <= 1e-5 * loss.0.abs().max(1.0),
            "rank {rank}: the flash blocks drop other elements: loss {} vs {}",
            loss.1,
            loss.0
        );
        assert!(
            (grad.0 - grad.1).abs() <= 1e-4 * grad.0.abs().max(1.0),
            "rank {rank}: gradient along the direction {} (flash) vs {}",
            grad.1,
            grad.0
        );
    }
}

/// Ring attention in bf16 (the dtype GPUs train in): a causal attention's weights and input
/// cast to bf16 at CP 2, the ring's blocks by Burn ops and by the flash op, against the same
/// attention in f32 on one rank, at CP 2 and 4: outputs and input gradients within bf16's
/// tolerance (measured: at most 1.8e-2 of the largest value; the halves of the output in the
/// wrong order give 0.99).
#[test]
fn ring_attention_in_bf16_stays_within_bf16_tolerance() {
    use burn::tensor::{DType, Device};
    use burn_megatron::models::{
        AttentionInputs, AttnBackend, AttnMaskType, CpAttention, ParallelAttention,
    };
    use burn_megatron::optimizer::cast_params;
    const S: usize = 64;
    const B: usize = 2;
    const H: usize = 32;
    let rows = |v: &[f32], positions: &[usize]| rows_at(v, positions, B * H);
    let backends = [AttnBackend::Unfused, AttnBackend::Flash];
    for (cp, backend) in [2, 4].into_iter().flat_map(|cp| backends.map(|b| (cp, b))) {
        let layout = ParallelConfig::new(cp, 1, 1).with_context_parallel(cp);
        let out = threads(&layout, LaunchOptions::default(), |ctx| {
            let d: &Device = &ctx.device;
            let mut config = no_dropout(layer(H, 4, 64));
            config.attention.attention_backend = backend;
            config.attention.attn_mask_type = AttnMaskType::Causal;
            let attention = config.init(&ctx.groups.tp, d)?.attention;
            let (x, w) = (host(S * B * H, 37), host(S * B * H, 53));
            let run = |attention: &ParallelAttention,
                       x: Vec<f32>,
                       w: Vec<f32>,
                       dtype: DType,
                       inputs: &AttentionInputs| {
                let s = x.len() / (B * H);
                let tensor = |v: Vec<f32>| {
                    Tensor::<3>::from_data(TensorData::new(v, [s, B, H]), d).cast(dtype)
                };
                let x = tensor(x).require_grad();
                let y = attention.forward(x.clone(), inputs, None);
                let grads = (y.clone() * tensor(w)).sum().backward();
                let read = |t: Tensor<3>| values(t.cast(DType::F32).inner());
                (read(y), read(x.grad(&grads).unwrap()))
            };
            let full = run(
                &attention,
                x.clone(),
                w.clone(),
                DType::F32,
                &Default::default(),
            );
            let split =
                ContextParallel::new(ctx.groups.cp.clone(), S)?.with_comm_type(CpCommType::P2p);
            let inputs = AttentionInputs {
                context_parallel: Some(CpAttention {
                    cp: split.clone(),
                    causal: true,
                }),
                ..AttentionInputs::default()
            };
            let pos = split.positions().to_vec();
            let half = cast_params(attention, DType::BF16);
            let got = run(&half, rows(&x, &pos), rows(&w, &pos), DType::BF16, &inputs);
            Ok::<_, Error>((got, (rows(&full.0, &pos), rows(&full.1, &pos))))
        })
        .unwrap();
        for (rank, ((y, gx), (y1, gx1))) in out.into_iter().enumerate() {
            let worst = |a: &[f32], b: &[f32]| {
                let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs());
                diff.fold(0.0f32, f32::max) / scale
            };
            let (ey, eg) = (worst(&y, &y1), worst(&gx, &gx1));
            eprintln!(
                "CP {cp} {backend:?} rank {rank}: bf16 ring vs f32, output {ey:.2e}, input gradient \
                 {eg:.2e} (of the largest)"
            );
            assert!(ey <= 3e-2, "{backend:?} rank {rank}: output off by {ey}");
            assert!(
                eg <= 3e-2,
                "{backend:?} rank {rank}: input gradient off by {eg}"
            );
        }
    }
}
