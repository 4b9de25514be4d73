//! Burn's LoRA (`Module::apply_lora`) on a model made tensor-parallel: the adapters Burn
//! attached before the plan, or `dropin::apply_lora` after it, are split with their weights
//! (a column-parallel weight's `a` whole and `b` split, a row-parallel weight's or a table's
//! `a` split and `b` whole), load from the record Burn's model saved, and at TP 2 and 4 give
//! Burn's model's loss, every trainable gradient (gathered) and, after a plain Burn AdamW
//! step, its parameters; under sequence parallelism and through `ParallelTraining` at DP 2
//! too; what cannot split is refused.

use super::Error;
use burn::module::{Lora, Module};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::dropin::{
    LoadOptions, RecordSource, TpPlan, apply_lora, load_sharded, save_gathered,
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::optimizer::InnerOptimizer;
use burn_megatron::topology::ParallelConfig;
use burn_megatron::training::ParallelTrainingConfig;
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::{data, tp_ranks};
use std::sync::Arc;

/// The model under Burn's own `nn`.
mod plain {
    use burn::module::Module;
    use burn::nn;
    use burn::tensor::{Device, Int, Tensor};
    include!("lora_model.rs");
}

/// The same model under the drop-in `nn`.
mod parallel {
    use burn::module::Module;
    use burn::tensor::{Device, Int, Tensor};
    use burn_megatron::dropin::nn;
    include!("lora_model.rs");
}

mod qlora;

const VOCAB: usize = 16;
const D: usize = 8;
const HEADS: usize = 4;
const FF: usize = 16;

fn lora() -> Lora {
    Lora::new(2, 4.0)
}

fn ids(device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..10).map(|i| (i * 5 % VOCAB) as i64).collect();
    Tensor::from_data(TensorData::new(ids, [2, 5]), device)
}

/// A loss weighting every logit.
fn loss(logits: Tensor<3>) -> Tensor<1> {
    let weights = data([2, 5, VOCAB], 0, 7, &logits.device());
    (logits * weights).sum()
}

/// Every layer split but `mix` (whole on every rank, its adapter too): the table by
/// vocabulary, both attentions as Megatron splits them (the cross-attention's key/value heads
/// too), the block column then row, the output layer by vocabulary (its logits gathered).
fn plan() -> Result<TpPlan, Error> {
    Ok(TpPlan::new()
        .vocab(&["embed"])?
        .encoder(&["attn", "cross"])?
        .column(&["up"])?
        .row(&["down"])?
        .gathered_vocab(&["out"])?)
}

type Values = super::Values;

/// Only the adapters' entries.
fn adapters(values: Values) -> Values {
    values
        .into_iter()
        .filter(|(k, _)| k.contains(".lora."))
        .collect()
}

/// Burn's `model` (a LoRA on it) after one AdamW step on `loss`, so that every `b` (zeros as
/// Burn draws it) holds values, saved at `record`; then its loss, every trainable gradient
/// (gathered) and its parameters after another step: what a split copy must reproduce.
fn reference<M: Module + Clone>(
    model: M,
    loss: impl Fn(&M) -> Tensor<1>,
    record: &std::path::Path,
) -> Result<(f32, Values, Values), Error> {
    let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
    let model = AdamWConfig::new().init().step(5e-2, model, grads);
    model.clone().save_file(record)?;
    let l = loss(&model);
    let value = l.clone().into_scalar::<f32>();
    let grads = GradientsParams::from_grads(l.backward(), &model);
    let trained = gathered(&model, Some(&grads), &super::solo());
    let stepped = AdamWConfig::new().init().step(5e-2, model, grads);
    Ok((value, trained, gathered(&stepped, None, &super::solo())))
}

/// Each rank's loss, gathered gradients and weights after a step against [`reference`]'s: the
/// loss within 1e-4, the gradients within 1e-5, the weights within 1e-4 (AdamW divides by the
/// gradient's own size: float noise in one grows to a few 1e-5).
fn assert_as_reference(what: &str, ranks: &[(f32, Values, Values)], want: (f32, &Values, &Values)) {
    for (rank, (value, grads, after)) in ranks.iter().enumerate() {
        let what = format!("{what}, rank {rank}");
        assert!(
            (value - want.0).abs() < 1e-4,
            "{what}: loss {value} against {}",
            want.0
        );
        let (worst, name) = super::grad_diff(grads, want.1);
        assert!(worst < 1e-5, "{what}: {name}'s gradient off by {worst}");
        let (worst, name) = super::grad_diff(after, want.2);
        assert!(worst < 1e-4, "{what}: {name} after a step off by {worst}");
    }
}

#[test]
fn burns_lora_adapters_split_with_their_weights_and_train_as_burns_at_tp_2_and_4()
-> Result<(), Error> {
    let dir = super::load::scratch("lora");
    let record = dir.join("net.bpk");
    let ad = Device::flex().autodiff();
    ad.seed(11);
    let plain = plain::Net::new(VOCAB, D, HEADS, FF, &ad).apply_lora(lora());
    let (want_loss, want_grads, want_after) =
        reference(plain, |m| loss(m.logits(ids(&ad))), &record)?;
    // Only the adapters train: Burn's LoRA freezes everything else, and so must the plan.
    assert_eq!(
        adapters(want_grads.clone()).len(),
        2 * 13,
        "every weight adapted"
    );
    assert_eq!(want_grads.len(), 2 * 13, "only the adapters train");

    let source = RecordSource::from_path(&record);
    // Burn's LoRA before the plan, and `dropin::apply_lora` after it.
    for (tp, post) in [(2, false), (4, false), (2, true), (4, true)] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let net = parallel::Net::new(VOCAB, D, HEADS, FF, d);
            let net = match post {
                false => plan()?.apply(net.apply_lora(lora()), g)?,
                true => apply_lora(plan()?.apply(net, g)?, lora(), g)?,
            };
            let (net, _) = load_sharded(net, &source, g, &LoadOptions::default())?;
            let l = loss(net.logits(ids(d)));
            let value = l.clone().into_scalar::<f32>();
            let grads = GradientsParams::from_grads(l.backward(), &net);
            let gathered_grads = gathered(&net, Some(&grads), g);
            let net = AdamWConfig::new().init().step(5e-2, net, grads);
            let after = gathered(&net, None, g);
            if tp == 2 && !post {
                save_gathered(&net, dir.join("written"), g)?;
            }
            Ok::<_, Error>((value, gathered_grads, after))
        })?;
        let what = format!("TP {tp}, LoRA after the plan {post}");
        assert_as_reference(&what, &out, (want_loss, &want_grads, &want_after));
    }
    // The written record is Burn's model's, its adapters whole.
    let written = plain::Net::new(VOCAB, D, HEADS, FF, &ad)
        .apply_lora(lora())
        .load_file(dir.join("written"));
    let written = gathered(&written, None, &super::solo());
    let (worst, name) = super::grad_diff(&written, &want_after);
    assert!(worst < 1e-4, "the written record's {name} off by {worst}");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A LoRA Burn draws afresh on each rank, before the plan or (`dropin::apply_lora`, on a base
/// loaded shard by shard) after it: the ranks get one adapter (every whole factor broadcast
/// from the first rank, the unsplit `mix` layer's too), so that the split model is one unsplit
/// model with one adapter, which `save_gathered` writes. Burn's model loading that record
/// takes the same AdamW step to the same loss.
#[test]
fn a_fresh_lora_on_each_rank_becomes_one_adapter_when_the_plan_splits_it() -> Result<(), Error> {
    let dir = super::load::scratch("lora-fresh");
    let (base, initial) = (dir.join("base.bpk"), dir.join("initial"));
    let device = Device::flex();
    device.seed(13);
    plain::Net::new(VOCAB, D, HEADS, FF, &device).save_file(&base)?;
    let step = |l: Tensor<1>| l.into_scalar::<f32>();
    for after in [false, true] {
        let losses = tp_ranks(2, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let net = parallel::Net::new(VOCAB, D, HEADS, FF, d);
            let net = match after {
                false => plan()?.apply(net.load_file(&base).apply_lora(lora()), g)?,
                // The way for a model that does not fit: no whole weight on a rank.
                true => {
                    let net = plan()?.apply(net, g)?;
                    let source = RecordSource::from_path(&base);
                    let (net, _) = load_sharded(net, &source, g, &LoadOptions::default())?;
                    apply_lora(net, lora(), g)?
                }
            };
            save_gathered(&net, &initial, g)?;
            let grads = GradientsParams::from_grads(loss(net.logits(ids(d))).backward(), &net);
            let net = AdamWConfig::new().init().step(5e-2, net, grads);
            Ok::<_, Error>(step(loss(net.logits(ids(d)))))
        })?;
        let ad = Device::flex().autodiff();
        let plain = plain::Net::new(VOCAB, D, HEADS, FF, &ad)
            .apply_lora(lora())
            .load_file(&initial);
        let grads = GradientsParams::from_grads(loss(plain.logits(ids(&ad))).backward(), &plain);
        let plain = AdamWConfig::new().init().step(5e-2, plain, grads);
        let want = step(loss(plain.logits(ids(&ad))));
        for (rank, got) in losses.iter().enumerate() {
            assert!(
                (got - want).abs() < 1e-4,
                "rank {rank}, LoRA after the plan {after}: loss after a step {got} against {want}"
            );
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Each step's loss (averaged over the data-parallel ranks) of `layout` trained through
/// `ParallelTraining` (AdamW): a LoRA drawn on each rank before the plan, the replicas made
/// one by `broadcast_params`, and (DP rank 0's replica) the initial model written at
/// `initial`; or with `from`, every rank loading that record instead. Data-parallel rank `r`
/// trains on batch `r` of the two, one rank on both.
fn train(
    layout: ParallelConfig,
    initial: &std::path::Path,
    from: bool,
    config: ParallelTrainingConfig,
) -> Result<Vec<Vec<f32>>, Error> {
    let out = threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let net = parallel::Net::new(VOCAB, D, HEADS, FF, d).apply_lora(lora());
        let net = plan()?.apply(net, g)?;
        let net = match from {
            true => {
                load_sharded(
                    net,
                    &RecordSource::from_path(initial),
                    g,
                    &Default::default(),
                )?
                .0
            }
            false => net,
        };
        let names = Arc::new(|path: &str| path.to_string());
        let training = config.init(&ctx, std::slice::from_ref(&net), names)?;
        let mut chunks = training.broadcast_params(vec![net])?;
        if !from && ctx.state.data_parallel_rank() == 0 {
            save_gathered(&chunks[0], initial, g)?;
        }
        let mut optimizer =
            training.optimizer(InnerOptimizer::from(AdamWConfig::new().init()), &chunks)?;
        let (dp, rank) = (layout.data_parallel_size(), ctx.state.data_parallel_rank());
        let mut losses = Vec::new();
        for step in 0..2 {
            let batches: Vec<usize> = (0..2).filter(|b| b % dp == rank).collect();
            // The overlapped reducer, when there is one, active over the step's one forward
            // and backward (its last).
            let active: Vec<_> = training
                .grad_sync()
                .into_iter()
                .flatten()
                .map(|h| h.enter(true))
                .collect();
            let mut l = Tensor::<1>::zeros([1], d);
            for b in &batches {
                l = l + loss(chunks[0].logits(data_ids(*b, step, d))) / batches.len() as f32;
            }
            let mut value = vec![l.clone().into_scalar::<f32>()];
            let mut grads = GradientsParams::from_grads(l.backward(), &chunks);
            drop(active);
            training.finalize(&chunks, &mut grads)?;
            (chunks, _) = optimizer.step(5e-2, chunks, grads)?;
            ctx.groups.dp.all_reduce_vec(&mut value, ReduceOp::Avg)?;
            losses.push(value[0]);
        }
        Ok::<_, Error>(losses)
    })?;
    Ok(out)
}

/// Batch `b` of step `step`.
fn data_ids(b: usize, step: usize, device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..10)
        .map(|i| ((i * 3 + b * 7 + step * 5) % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [2, 5]), device)
}

/// LoRA at TP 2 × DP 2 through `ParallelTraining`: drawn on each rank, made one adapter by the
/// plan and `broadcast_params`, it trains as one rank does from the same initial model, with
/// the distributed optimizer and the gradient reduction overlapped with backward (the
/// adapter's factors hooked where the layer reads them) too.
#[test]
fn lora_at_tp_2_and_dp_2_trains_through_parallel_training_as_one_rank() -> Result<(), Error> {
    let dir = super::load::scratch("lora-dp");
    let initial = dir.join("initial.bpk");
    for overlap in [false, true] {
        let config = ParallelTrainingConfig::new()
            .with_use_distributed_optimizer(overlap)
            .with_overlap_grad_reduce(overlap);
        let parallel = train(ParallelConfig::new(4, 2, 1), &initial, false, config)?;
        let one = train(
            ParallelConfig::new(1, 1, 1),
            &initial,
            true,
            ParallelTrainingConfig::new(),
        )?;
        for (rank, losses) in parallel.iter().enumerate() {
            let d = super::max_abs_diff(losses, &one[0]);
            assert!(
                d < 1e-4,
                "overlap {overlap}, rank {rank}: losses {losses:?} against {:?}",
                one[0]
            );
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A model built on a device that does not train (as one is built to be loaded), given its
/// LoRA there and split: once trained, only the adapters take gradients, as Burn's own model
/// would (the plan's shards are new parameters, which would otherwise all train).
#[test]
fn a_plan_on_a_device_that_does_not_train_keeps_what_lora_froze() -> Result<(), Error> {
    let out = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let plain_device = Device::flex();
        let net = parallel::Net::new(VOCAB, D, HEADS, FF, &plain_device).apply_lora(lora());
        let net = plan()?.apply(net, g)?.fork(d).train();
        let grads = GradientsParams::from_grads(loss(net.logits(ids(d))).backward(), &net);
        Ok::<_, Error>(gathered(&net, Some(&grads), g))
    })?;
    for (rank, grads) in out.iter().enumerate() {
        let trained: Vec<_> = grads.keys().filter(|k| !k.contains(".lora.")).collect();
        assert!(
            trained.is_empty(),
            "rank {rank}: frozen parameters trained: {trained:?}"
        );
        assert_eq!(grads.len(), 2 * 13, "rank {rank}: every adapter trains");
    }
    Ok(())
}

/// LoRA under sequence parallelism: an encoder split with `sequence_parallel()`, whose
/// column-parallel layers take the gathered sequence, trains as Burn's model at TP 2 (loss,
/// every trainable gradient, the parameters after an AdamW step).
#[test]
fn lora_in_a_sequence_parallel_encoder_trains_as_burns_at_tp_2() -> Result<(), Error> {
    let dir = super::load::scratch("lora-sp");
    let record = dir.join("net.bpk");
    let ids = |d: &Device| {
        let ids: Vec<i64> = (0..8).map(|i| (i * 5 % VOCAB) as i64).collect();
        Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 4]), d)
    };
    let loss =
        |logits: Tensor<3>| (logits.clone() * data([2, 4, VOCAB], 0, 7, &logits.device())).sum();
    let ad = Device::flex().autodiff();
    ad.seed(17);
    let plain = plain::EncoderNet::new(VOCAB, D, HEADS, FF, &ad).apply_lora(lora());
    let (want_loss, want_grads, want_after) =
        reference(plain, |m| loss(m.logits(ids(&ad))), &record)?;
    let source = RecordSource::from_path(&record);
    let out = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let net = parallel::EncoderNet::new(VOCAB, D, HEADS, FF, d).apply_lora(lora());
        let plan = TpPlan::new()
            .vocab(&["embed"])?
            .encoder(&["encoder"])?
            .gathered_vocab(&["out"])?
            .sequence_parallel();
        let net = plan.apply(net, g)?;
        let (net, _) = load_sharded(net, &source, g, &LoadOptions::default())?;
        let l = loss(net.logits(ids(d)));
        let value = l.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(l.backward(), &net);
        let got_grads = gathered(&net, Some(&grads), g);
        let net = AdamWConfig::new().init().step(5e-2, net, grads);
        Ok::<_, Error>((value, got_grads, gathered(&net, None, g)))
    })?;
    for (rank, (value, grads, after)) in out.iter().enumerate() {
        assert!(
            (value - want_loss).abs() < 1e-4,
            "rank {rank}: loss {value} against {want_loss}"
        );
        let (worst, name) = super::grad_diff(grads, &want_grads);
        assert!(
            worst < 1e-5,
            "rank {rank}: {name}'s gradient off by {worst}"
        );
        let (worst, name) = super::grad_diff(after, &want_after);
        assert!(
            worst < 1e-4,
            "rank {rank}: {name} after a step off by {worst}"
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A reparameterization that changes nothing, with one parameter of its own: what a user's
/// own (not Burn's LoRA) would look like to a plan.
#[derive(Module, Debug)]
struct Shift {
    delta: burn::module::Param<Tensor<1>>,
}

impl burn::module::Reparameterization for Shift {
    const NAME: &'static str = "shift";
    fn apply<const N: usize>(&self, base: Tensor<N>) -> Tensor<N> {
        base
    }
}

struct Shifts;

impl burn::module::Reparameterizer for Shifts {
    type Reparam = Shift;
    fn reparameterize<const N: usize>(
        &mut self,
        _: &str,
        param: burn::module::Param<Tensor<N>>,
    ) -> (burn::module::Param<Tensor<N>>, Option<Shift>) {
        let delta = Tensor::zeros([2], &param.lazy_device());
        let shift = Shift {
            delta: burn::module::Param::from_tensor(delta),
        };
        (param, (N == 2).then_some(shift))
    }
}

/// What the plan cannot split with a weight is refused, naming the layer: an adapter on a
/// linear in Burn's column layout, an adapter on a padded vocabulary (by the plan, and by
/// `apply_lora` on the split model), and a reparameterization other than Burn's LoRA.
#[test]
fn adapters_a_plan_cannot_split_are_refused_naming_the_layer() -> Result<(), Error> {
    use burn_megatron::dropin::nn;
    #[derive(Module, Debug)]
    struct Col {
        up: nn::Linear,
    }
    let errors = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let col = Col {
            up: nn::LinearConfig::new(D, FF)
                .with_layout(nn::LinearLayout::Col)
                .init(d),
        };
        let col = TpPlan::new()
            .column(&["up"])?
            .apply(col.apply_lora(lora()), g);
        let padded = plan()?.make_vocab_size_divisible_by(3)?;
        let padded = padded.apply(
            parallel::Net::new(VOCAB, D, HEADS, FF, d).apply_lora(lora()),
            g,
        );
        let shifted = parallel::Net::new(VOCAB, D, HEADS, FF, d).apply_reparameterization(Shifts);
        let shifted = plan()?.apply(shifted, g);
        // `apply_lora` on the split model refuses the same.
        let split_col = TpPlan::new().column(&["up"])?.apply(
            Col {
                up: nn::LinearConfig::new(D, FF)
                    .with_layout(nn::LinearLayout::Col)
                    .init(d),
            },
            g,
        )?;
        let late_col = apply_lora(split_col, lora(), g);
        let split_padded = plan()?.make_vocab_size_divisible_by(3)?;
        let split_padded = split_padded.apply(parallel::Net::new(VOCAB, D, HEADS, FF, d), g)?;
        let late_padded = apply_lora(split_padded, lora(), g);
        let message = |r: Result<_, _>| {
            r.err()
                .map(|e: burn_megatron::tensor_parallel::TpError| e.to_string())
                .unwrap_or_default()
        };
        Ok::<_, Error>([
            message(col.map(|_| ())),
            message(padded.map(|_| ())),
            message(shifted.map(|_| ())),
            message(late_col.map(|_| ())),
            message(late_padded.map(|_| ())),
        ])
    })?;
    let [col, padded, shifted, late_col, late_padded] = &errors[0];
    assert!(
        late_col.contains("up.weight.lora.a") && late_col.contains("column layout"),
        "{late_col:?}"
    );
    assert!(
        late_padded.contains("embed.weight.lora.a") && late_padded.contains("padded vocabulary"),
        "{late_padded:?}"
    );
    assert!(
        col.contains("up.weight.lora.a") && col.contains("column layout"),
        "{col:?}"
    );
    assert!(
        padded.contains("embed.weight.lora.a") && padded.contains("padded vocabulary"),
        "{padded:?}"
    );
    assert!(
        shifted.contains("embed.weight.shift.delta") && shifted.contains("other than Burn's LoRA"),
        "{shifted:?}"
    );
    Ok(())
}

/// Ranks whose adapters differ in number (a LoRA parameter group chosen per rank) get an
/// error naming the counts from `apply_lora`, on every rank, rather than broadcasts that pair
/// one rank's factor with another's.
#[test]
fn ranks_with_different_adapters_are_refused_by_apply_lora() -> Result<(), Error> {
    let errors = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let net = plan()?.apply(parallel::Net::new(VOCAB, D, HEADS, FF, d), g)?;
        let lora = match ctx.state.tensor_model_parallel_rank() {
            0 => lora(),
            _ => {
                let up =
                    burn::module::ParamGroup::from_regex("^up").map_err(|e| format!("{e:?}"))?;
                lora().set_param_group(up)
            }
        };
        let refused = apply_lora(net, lora, g).err();
        Ok::<_, Error>(refused.map(|e| e.to_string()).unwrap_or_default())
    })?;
    for (rank, message) in errors.iter().enumerate() {
        assert!(
            message.contains("different numbers of LoRA factors"),
            "rank {rank}: {message:?}"
        );
    }
    Ok(())
}
