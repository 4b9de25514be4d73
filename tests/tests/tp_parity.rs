//! Parity of tensor-parallel models with the same model on one rank: losses, gathered
//! gradients and gathered weights over 5 SGD steps, TP ∈ {1, 2, 4}, with and without
//! sequence parallelism.

use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::{Device, Int, Tensor};
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::tensor_parallel::mappings::gather_from_sequence_parallel_region;
use burn_megatron::tensor_parallel::*;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::*;
use std::time::Duration;

const STEPS: usize = 5;
const LR: f64 = 0.1;
const TOL: f32 = 1e-5;
// Activations are [s, b, d] (sequence first, split under sequence parallelism).
const S: usize = 4;
const B: usize = 2;
const D: usize = 8;
const FFN: usize = 16;
const VOCAB: usize = 16;

/// Per step: loss, then every parameter's (gathered) gradient and (gathered) updated value.
type Trace = Vec<(f32, Vec<Vec<f32>>, Vec<Vec<f32>>)>;

fn options() -> LaunchOptions {
    LaunchOptions::default().with_timeout(Duration::from_secs(20))
}

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

#[derive(Module, Debug)]
struct TpMlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}

fn mlp_batch(step: usize, device: &Device) -> (Tensor<3>, Tensor<3>) {
    (
        data([S, B, D], step, 1, device),
        data([S, B, D], step, 2, device),
    )
}

fn reference_mlp() -> Trace {
    let device = Device::flex().autodiff();
    let mut model = Mlp {
        fc1: seeded_linear(D, FFN, 10, &device),
        fc2: seeded_linear(FFN, D, 20, &device),
    };
    let mut optim = SgdConfig::new().init();
    let mut trace = Vec::new();
    for step in 0..STEPS {
        let (x, target) = mlp_batch(step, &device);
        let y = model.fc2.forward(gelu(model.fc1.forward(x)));
        let loss = (y - target).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let g = |id| values(grads.get::<2>(id).unwrap());
        let gb = |id| values(grads.get::<1>(id).unwrap());
        let step_grads = vec![
            g(model.fc1.weight.id),
            gb(model.fc1.bias.as_ref().unwrap().id),
            g(model.fc2.weight.id),
            gb(model.fc2.bias.as_ref().unwrap().id),
        ];
        let loss = values(loss.inner())[0];
        model = optim.step(LR, model, grads);
        let weights = vec![
            values(model.fc1.weight.val().inner()),
            values(model.fc1.bias.as_ref().unwrap().val().inner()),
            values(model.fc2.weight.val().inner()),
            values(model.fc2.bias.as_ref().unwrap().val().inner()),
        ];
        trace.push((loss, step_grads, weights));
    }
    trace
}

fn parallel_mlp(tp: usize, sp: bool) -> Vec<Trace> {
    threads(&ParallelConfig::new(tp, tp, 1), options(), |ctx| {
        let group = &ctx.groups.tp;
        let device = &ctx.device;
        // Drop-in: each rank builds the plain layers from the seed and keeps its shard.
        let col = ColumnParallelLinearConfig::new(D, FFN).with_sequence_parallel(sp);
        let row = RowParallelLinearConfig::new(FFN, D).with_sequence_parallel(sp);
        let mut model = TpMlp {
            fc1: ColumnParallelLinear::from_linear(
                &seeded_linear(D, FFN, 10, device),
                &col,
                group,
            )?,
            fc2: RowParallelLinear::from_linear(&seeded_linear(FFN, D, 20, device), &row, group)?,
        };
        let mut optim = SgdConfig::new().init();
        let mut trace = Vec::new();
        let rank = ctx.state.tensor_model_parallel_rank();
        for step in 0..STEPS {
            let (x, target) = mlp_batch(step, device);
            let x = if sp {
                x.narrow(0, rank * S / tp, S / tp)
            } else {
                x
            };
            let y = model.fc2.forward(gelu(model.fc1.forward(x)));
            let y = if sp {
                gather_from_sequence_parallel_region(y, group, false)
            } else {
                y
            };
            let loss = (y - target).powi_scalar(2).mean();
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            allreduce_sequence_parallel_grads(&model, &mut grads, group)?;
            let g2 = |id, dim| all_gather(&**group, grads.get::<2>(id).unwrap(), dim).map(values);
            let g1 = |id, dim| all_gather(&**group, grads.get::<1>(id).unwrap(), dim).map(values);
            let step_grads = vec![
                g2(model.fc1.weight.id, 1)?,
                g1(model.fc1.bias.as_ref().unwrap().id, 0)?,
                g2(model.fc2.weight.id, 0)?,
                values(grads.get::<1>(model.fc2.bias.as_ref().unwrap().id).unwrap()),
            ];
            let loss = values(loss.inner())[0];
            model = optim.step(LR, model, grads);
            let (fc1, fc2) = (model.fc1.to_linear()?, model.fc2.to_linear()?);
            let weights = vec![
                values(fc1.weight.val()),
                values(fc1.bias.unwrap().val()),
                values(fc2.weight.val()),
                values(fc2.bias.unwrap().val()),
            ];
            trace.push((loss, step_grads, weights));
        }
        Ok::<_, TpError>(trace)
    })
    .unwrap()
}

fn assert_trace_matches(got: &Trace, reference: &Trace, what: &str) {
    for (step, ((l, g, w), (rl, rg, rw))) in got.iter().zip(reference).enumerate() {
        assert_close(&[*l], &[*rl], TOL, &format!("{what} step {step} loss"));
        for (i, (a, b)) in g.iter().zip(rg).enumerate() {
            assert_close(a, b, TOL, &format!("{what} step {step} grad {i}"));
        }
        for (i, (a, b)) in w.iter().zip(rw).enumerate() {
            assert_close(a, b, TOL, &format!("{what} step {step} weight {i}"));
        }
    }
    assert_eq!(got.len(), reference.len());
}

#[test]
fn mlp_matches_single_rank_at_every_tp_size() {
    let reference = reference_mlp();
    // The loss must actually move, or the comparison proves little.
    assert!(reference[STEPS - 1].0 < reference[0].0);
    for (tp, sp) in [(1, false), (2, false), (4, false), (2, true), (4, true)] {
        for (rank, trace) in parallel_mlp(tp, sp).iter().enumerate() {
            assert_trace_matches(
                trace,
                &reference,
                &format!("mlp tp {tp} sp {sp} rank {rank}"),
            );
        }
    }
}

#[derive(Module, Debug)]
struct Lm {
    embedding: Embedding,
    head: Linear,
}

#[derive(Module, Debug)]
struct TpLm {
    embedding: VocabParallelEmbedding,
    head: ColumnParallelLinear,
}

/// Token ids `[b, s]` and targets `[b, s]`, covering every vocabulary slice; the same batch
/// every step, so the loss visibly falls.
fn lm_batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let ids: Vec<i64> = (0..B * S).map(|i| ((i * 5 + 3) % VOCAB) as i64).collect();
    let tgt: Vec<i64> = (0..B * S).map(|i| ((i * 11 + 1) % VOCAB) as i64).collect();
    (
        Tensor::<1, Int>::from_ints(ids.as_slice(), device).reshape([B, S]),
        Tensor::<1, Int>::from_ints(tgt.as_slice(), device).reshape([B, S]),
    )
}

fn reference_lm() -> Trace {
    let device = Device::flex().autodiff();
    let mut model = Lm {
        embedding: seeded_embedding(VOCAB, D, 30, &device),
        head: seeded_linear(D, VOCAB, 40, &device),
    };
    let mut optim = SgdConfig::new().init();
    let mut trace = Vec::new();
    for _ in 0..STEPS {
        let (ids, target) = lm_batch(&device);
        let logits = model
            .head
            .forward(model.embedding.forward(ids))
            .reshape([B * S, VOCAB]);
        let logp = log_softmax(logits, 1);
        let loss = logp.gather(1, target.reshape([B * S, 1])).neg().mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let step_grads = vec![
            values(grads.get::<2>(model.embedding.weight.id).unwrap()),
            values(grads.get::<2>(model.head.weight.id).unwrap()),
            values(
                grads
                    .get::<1>(model.head.bias.as_ref().unwrap().id)
                    .unwrap(),
            ),
        ];
        let loss = values(loss.inner())[0];
        model = optim.step(LR, model, grads);
        let weights = vec![
            values(model.embedding.weight.val().inner()),
            values(model.head.weight.val().inner()),
            values(model.head.bias.as_ref().unwrap().val().inner()),
        ];
        trace.push((loss, step_grads, weights));
    }
    trace
}

fn parallel_lm(tp: usize, sp: bool) -> Vec<Trace> {
    threads(&ParallelConfig::new(tp, tp, 1), options(), |ctx| {
        let group = &ctx.groups.tp;
        let device = &ctx.device;
        let head = ColumnParallelLinearConfig::new(D, VOCAB).with_sequence_parallel(sp);
        let mut model = TpLm {
            embedding: VocabParallelEmbedding::from_embedding(
                &seeded_embedding(VOCAB, D, 30, device),
                sp,
                group,
            )?,
            head: ColumnParallelLinear::from_linear(
                &seeded_linear(D, VOCAB, 40, device),
                &head,
                group,
            )?,
        };
        let mut optim = SgdConfig::new().init();
        let mut trace = Vec::new();
        for _ in 0..STEPS {
            let (ids, target) = lm_batch(device);
            // Under sequence parallelism the activations are [s, b, ·]: targets follow.
            let target = if sp { target.swap_dims(0, 1) } else { target };
            let logits = model.head.forward(model.embedding.forward(ids));
            let [a, b, v] = logits.dims();
            let losses = vocab_parallel_cross_entropy(
                logits.reshape([a * b, v]),
                target.reshape([a * b]),
                0.0,
                group,
            )?;
            let loss = losses.mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let step_grads = vec![
                values(all_gather(
                    &**group,
                    grads.get::<2>(model.embedding.weight.id).unwrap(),
                    0,
                )?),
                values(all_gather(
                    &**group,
                    grads.get::<2>(model.head.weight.id).unwrap(),
                    1,
                )?),
                values(all_gather(
                    &**group,
                    grads
                        .get::<1>(model.head.bias.as_ref().unwrap().id)
                        .unwrap(),
                    0,
                )?),
            ];
            let loss = values(loss.inner())[0];
            model = optim.step(LR, model, grads);
            let (emb, head) = (model.embedding.to_embedding()?, model.head.to_linear()?);
            let weights = vec![
                values(emb.weight.val()),
                values(head.weight.val()),
                values(head.bias.unwrap().val()),
            ];
            trace.push((loss, step_grads, weights));
        }
        Ok::<_, TpError>(trace)
    })
    .unwrap()
}

#[test]
fn embedding_head_and_vocab_parallel_loss_match_single_rank() {
    let reference = reference_lm();
    assert!(reference[STEPS - 1].0 < reference[0].0);
    for (tp, sp) in [(1, false), (2, false), (4, false), (2, true), (4, true)] {
        for (rank, trace) in parallel_lm(tp, sp).iter().enumerate() {
            assert_trace_matches(
                trace,
                &reference,
                &format!("lm tp {tp} sp {sp} rank {rank}"),
            );
        }
    }
}

#[test]
fn initialisation_does_not_depend_on_the_tp_size() {
    let full = |tp: usize| {
        threads(&ParallelConfig::new(tp, tp, 1), options(), |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let col = ColumnParallelLinearConfig::new(D, FFN)
                .with_seed(5)
                .with_bias_initializer(MasterInit::Uniform {
                    low: -1.0,
                    high: 1.0,
                })
                .init(g, d)?
                .to_linear()?;
            let row = RowParallelLinearConfig::new(FFN, D)
                .with_seed(6)
                .init(g, d)?
                .to_linear()?;
            let emb = VocabParallelEmbeddingConfig::new(VOCAB, D)
                .with_seed(7)
                .init(g, d)?
                .to_embedding()?;
            Ok::<_, TpError>(vec![
                values(col.weight.val()),
                values(col.bias.unwrap().val()),
                values(row.weight.val()),
                values(emb.weight.val()),
            ])
        })
        .unwrap()
        .remove(0)
    };
    let one = full(1);
    for tp in [2, 4] {
        assert_eq!(full(tp), one, "tp {tp} must start bit-identical to tp 1");
    }
}

#[test]
fn parameters_carry_their_parallel_attributes() {
    threads(&ParallelConfig::new(2, 2, 1), options(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let col = ColumnParallelLinearConfig::new(D, FFN).init(g, d)?;
        let row = RowParallelLinearConfig::new(FFN, D)
            .with_sequence_parallel(true)
            .init(g, d)?;
        let emb = VocabParallelEmbeddingConfig::new(VOCAB, D).init(g, d)?;
        assert_eq!(parallel_attrs(col.weight.id), ParallelAttrs::sharded(1));
        assert_eq!(
            parallel_attrs(col.bias.as_ref().unwrap().id),
            ParallelAttrs::sharded(0)
        );
        assert_eq!(parallel_attrs(row.weight.id), ParallelAttrs::sharded(0));
        assert_eq!(
            parallel_attrs(row.bias.as_ref().unwrap().id),
            ParallelAttrs::sequence_parallel()
        );
        assert_eq!(parallel_attrs(emb.weight.id), ParallelAttrs::sharded(0));
        assert_eq!(col.weight.dims(), [D, FFN / 2]);
        assert_eq!(row.weight.dims(), [FFN / 2, D]);
        Ok::<_, TpError>(())
    })
    .unwrap();
}

#[test]
fn sizes_that_do_not_split_over_tp_are_errors() {
    let err = threads(&ParallelConfig::new(4, 4, 1), options(), |ctx| {
        VocabParallelEmbeddingConfig::new(30, D)
            .init(&ctx.groups.tp, &ctx.device)
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("vocabulary entries (30) are not divisible by the tensor-parallel size (4)"),
        "{err}"
    );
    let err = threads(&ParallelConfig::new(4, 4, 1), options(), |ctx| {
        ColumnParallelLinearConfig::new(D, 6)
            .init(&ctx.groups.tp, &ctx.device)
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("output features (6)"), "{err}");
}

#[test]
fn gather_output_skip_bias_add_and_unsplit_row_input_match_plain_linear() {
    let device = Device::flex();
    let x = data([S, B, D], 0, 3, &device);
    let (l1, l2) = (
        seeded_linear(D, FFN, 50, &device),
        seeded_linear(FFN, D, 60, &device),
    );
    let want_col = values(l1.forward(x.clone()));
    let want_row = values(l2.forward(data([S, B, FFN], 0, 4, &device)));
    let out = threads(&ParallelConfig::new(2, 2, 1), options(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let (l1, l2) = (seeded_linear(D, FFN, 50, d), seeded_linear(FFN, D, 60, d));
        let x = data([S, B, D], 0, 3, d);
        // gather_output: every rank gets the full output.
        let gathered = ColumnParallelLinear::from_linear(
            &l1,
            &ColumnParallelLinearConfig::new(D, FFN).with_gather_output(true),
            g,
        )?;
        let full = values(gathered.forward(x.clone()));
        // skip_bias_add: the bias comes back separately and is not in the output.
        let skip = ColumnParallelLinear::from_linear(
            &l1,
            &ColumnParallelLinearConfig::new(D, FFN).with_skip_bias_add(true),
            g,
        )?;
        let (out, bias) = skip.forward_with_bias(x);
        let with_bias = values(out.clone() + bias.clone().unwrap().unsqueeze());
        let without = values(out);
        // A row-parallel layer fed the full (unsplit) input splits it itself.
        let row = RowParallelLinear::from_linear(
            &l2,
            &RowParallelLinearConfig::new(FFN, D).with_input_is_parallel(false),
            g,
        )?;
        let row_out = values(row.forward(data([S, B, FFN], 0, 4, d)));
        Ok::<_, TpError>((full, with_bias, without, values(bias.unwrap()), row_out))
    })
    .unwrap();
    for (rank, (full, with_bias, without, bias, row_out)) in out.into_iter().enumerate() {
        assert_close(&full, &want_col, TOL, "gather_output");
        assert_close(&row_out, &want_row, TOL, "row input split");
        // This rank's columns of the plain output, with and without the bias.
        let half = FFN / 2;
        let mine: Vec<f32> = want_col
            .chunks(FFN)
            .flat_map(|r| r[rank * half..(rank + 1) * half].to_vec())
            .collect();
        assert_close(&with_bias, &mine, TOL, "skip_bias_add output + bias");
        assert_eq!(bias.len(), half);
        assert!(
            without.iter().zip(&mine).any(|(a, b)| (a - b).abs() > 1e-3),
            "bias must not be added"
        );
    }
}
