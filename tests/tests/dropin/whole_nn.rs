//! `dropin::nn` is all of Burn's `nn`: a model written against `burn::nn` compiles against it
//! with `use burn::nn;` swapped for `use dropin::nn;` and nothing else (norms, dropout,
//! initializers, activation configs and losses are Burn's own, re-exported), including
//! Burn's constructors of one encoder layer and of a stand-alone feed-forward block. Split
//! at TP 2 and 4 (the shared layer as Megatron splits a layer, the block column then row,
//! the vocabulary over both ends), from the record Burn's model saved, its loss and every
//! gathered gradient are Burn's model's.

use super::{Error, Values};
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::tp_ranks;
use std::path::{Path, PathBuf};

/// The model under Burn's own `nn`.
mod plain {
    use burn::config::Config;
    use burn::module::Module;
    use burn::nn;
    use burn::tensor::{Bool, Device, Int, Tensor};
    include!("whole_nn_model.rs");
}

/// The same model under the drop-in `nn`.
mod parallel {
    use burn::config::Config;
    use burn::module::Module;
    use burn::tensor::{Bool, Device, Int, Tensor};
    use burn_megatron::dropin::nn;
    include!("whole_nn_model.rs");
}

const VOCAB: usize = 24;
const B: usize = 2;
const S: usize = 6;

/// Ids over the whole vocabulary, their next-token targets, the second sample padded after 4.
fn batch(
    device: &Device,
) -> (
    Tensor<2, Int>,
    Tensor<2, Int>,
    Tensor<2, burn::tensor::Bool>,
) {
    let ids: Vec<i64> = (0..B * (S + 1))
        .map(|i| ((i * 7 + 3) % VOCAB) as i64)
        .collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [B, S + 1]), device);
    let pad: Vec<bool> = (0..B * S).map(|i| i / S == 1 && i % S >= 4).collect();
    let mask_pad = Tensor::from_data(TensorData::new(pad, [B, S]), device);
    (ids.clone().narrow(1, 0, S), ids.narrow(1, 1, S), mask_pad)
}

/// The model's layout: the shared layer as Megatron splits a layer, the block column then
/// row, the vocabulary over both ends (the logits gathered).
fn plan() -> Result<TpPlan, Error> {
    let plan = TpPlan::new().encoder(&["layer"])?;
    let plan = plan
        .column(&["head.linear_inner"])?
        .row(&["head.linear_outer"])?;
    Ok(plan.vocab(&["embedding"])?.gathered_vocab(&["output"])?)
}

#[test]
fn a_model_written_against_burns_nn_swaps_its_nn_and_trains_as_burns_at_tp_2_and_4()
-> Result<(), Error> {
    let dir = super::load::scratch("whole-nn");
    let record = dir.join("model.bpk");
    let (d_model, heads, ff, repeats) = (16, 4, 32, 3);
    let plain_config = plain::SharedLayerModelConfig::new(VOCAB, d_model, heads, ff, repeats);
    let config = parallel::SharedLayerModelConfig::new(VOCAB, d_model, heads, ff, repeats);
    let device = Device::flex();
    device.seed(23);
    plain_config.init(&device).save_file(&record)?;
    let ad = Device::flex().autodiff();
    let plain = plain_config.init(&ad).load_file(&record);
    let (ids, targets, mask_pad) = batch(&ad);
    let (value, grads) =
        super::loss_and_grads(&plain, plain.loss(ids, targets, mask_pad), &super::solo());
    let source = RecordSource::from_path(&record);
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = plan()?.apply(config.init(d), g)?;
            let (model, _) = load_sharded(model, &source, g, &LoadOptions::default())?;
            // Each rank holds its shards.
            let held = |w: [usize; 2]| w[0] * w[1];
            assert_eq!(
                held(model.layer.mha.query.weight.dims()),
                d_model * d_model / tp
            );
            assert_eq!(
                held(model.layer.pwff.linear_outer.weight.dims()),
                ff * d_model / tp
            );
            assert_eq!(
                held(model.head.linear_inner.weight.dims()),
                d_model * ff / tp
            );
            assert_eq!(held(model.embedding.weight.dims()), VOCAB * d_model / tp);
            assert_eq!(held(model.output.weight.dims()), d_model * VOCAB / tp);
            let (ids, targets, mask_pad) = batch(d);
            let loss = model.loss(ids, targets, mask_pad);
            Ok::<_, Error>(super::loss_and_grads(&model, loss, g))
        })?;
        for (rank, (l, gr)) in out.iter().enumerate() {
            let what = format!("TP {tp}, rank {rank}");
            super::assert_parity(&what, (&[*l], gr), (&[value], &grads));
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Burn 0.21's records and what it computed from them (`tests/fixtures/burn_mpk`).
fn burn_mpk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/burn_mpk")
}

/// `expected.json`'s entry for `record`: what Burn 0.21 computed from it.
fn burn_0_21_entry(record: &str) -> Result<serde_json::Value, Error> {
    let text = std::fs::read_to_string(burn_mpk_dir().join("expected.json"))?;
    let mut all: serde_json::Value = serde_json::from_str(&text)?;
    Ok(all[record].take())
}

/// A JSON list of numbers, as f32 (empty where `v` is no list).
fn floats(v: &serde_json::Value) -> Vec<f32> {
    let list = v.as_array().map(Vec::as_slice).unwrap_or_default();
    list.iter()
        .filter_map(|x| x.as_f64())
        .map(|x| x as f32)
        .collect()
}

/// The loss, logits and (where recorded) gradients Burn 0.21 computed from `record`.
fn burn_0_21_expected(record: &str) -> Result<(f32, Vec<f32>, Option<Values>), Error> {
    let entry = burn_0_21_entry(record)?;
    let loss = entry["loss"].as_f64().ok_or("no loss")? as f32;
    let grads = entry["grads"].as_object().map(|grads| {
        (grads.iter())
            .map(|(k, v)| (k.clone(), floats(v)))
            .collect()
    });
    Ok((loss, floats(&entry["logits"]), grads))
}

/// The records Burn users have from the Burn before 0.22 (`NamedMpkFileRecorder`, which
/// Burn 0.22 cannot read), written by Burn 0.21 itself at full precision and gzipped at half
/// precision, load straight into each rank's shards. Against what Burn 0.21 computed from
/// them: the same logits and loss, and (the full-precision record) every gathered gradient.
#[test]
fn burn_0_21_records_load_sharded_and_compute_what_burn_0_21_computed() -> Result<(), Error> {
    let dir = burn_mpk_dir();
    let config = parallel::SharedLayerModelConfig::new(VOCAB, 16, 4, 32, 3);
    for record in ["model.mpk", "model_half.mpk.gz"] {
        let (loss, logits, grads) = burn_0_21_expected(record)?;
        assert_eq!(
            logits.len(),
            B * S * VOCAB,
            "{record}: the fixture's logits"
        );
        // ANCHOR: legacy_record
        // A record of Burn 0.21's `NamedMpkFileRecorder`, by its extension.
        let source = RecordSource::from_path(dir.join(record));
        assert!(matches!(source, RecordSource::NamedMpk(_)));
        // ANCHOR_END: legacy_record
        for tp in [1, 2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let model = plan()?.apply(config.init(d), g)?;
                let (model, report) = load_sharded(model, &source, g, &LoadOptions::default())?;
                assert_eq!(report.loaded.len(), 25, "{record}: {report:?}");
                let (ids, targets, mask_pad) = batch(d);
                let logits =
                    burn_megatron_tests::values(model.logits(ids.clone(), mask_pad.clone()));
                let (l, gr) = super::loss_and_grads(&model, model.loss(ids, targets, mask_pad), g);
                Ok::<_, Error>((logits, l, gr))
            })?;
            for (rank, (got_logits, got_loss, got_grads)) in out.iter().enumerate() {
                let what = format!("{record} at TP {tp}, rank {rank}");
                let dl = super::max_abs_diff(got_logits, &logits);
                assert!(dl < 1e-5, "{what}: logits off by {dl}");
                assert!(
                    (got_loss - loss).abs() < 1e-5,
                    "{what}: loss {got_loss}, Burn 0.21's {loss}"
                );
                if let Some(grads) = &grads {
                    assert_eq!(got_grads.len(), grads.len(), "{what}: gradients");
                    let (worst, name) = super::grad_diff(got_grads, grads);
                    assert!(worst < 1e-5, "{what}: gradient {name} off by {worst}");
                }
            }
        }
    }
    Ok(())
}

/// Burn's own `TransformerEncoder` (its layers a `Vec` in the record), saved by Burn 0.21,
/// split at TP 2 and 4 as Megatron splits a layer: Burn 0.21's output.
#[test]
fn a_burn_0_21_transformer_encoder_record_loads_sharded() -> Result<(), Error> {
    use burn_megatron::dropin::nn::transformer as ours;
    let dir = burn_mpk_dir();
    let want = floats(&burn_0_21_entry("encoder.mpk")?["output"]);
    if want.is_empty() {
        return Err("no encoder output in expected.json".into());
    }
    let d_model = 16;
    let source = RecordSource::from_path(dir.join("encoder.mpk"));
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let config = ours::TransformerEncoderConfig::new(d_model, 32, 4, 2).with_dropout(0.0);
            let encoder = TpPlan::new()
                .encoder(&["layers.*"])?
                .apply(config.init(d), g)?;
            let (encoder, report) = load_sharded(encoder, &source, g, &LoadOptions::default())?;
            assert_eq!(report.loaded.len(), 2 * 16, "{report:?}");
            let x: Vec<f32> = (0..B * S * d_model)
                .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
                .collect();
            let x = Tensor::<3>::from_data(TensorData::new(x, [B, S, d_model]), d);
            let (_, _, mask_pad) = batch(d);
            let input = ours::TransformerEncoderInput::new(x).mask_pad(mask_pad);
            Ok::<_, Error>(burn_megatron_tests::values(encoder.forward(input)))
        })?;
        for (rank, y) in out.iter().enumerate() {
            assert_eq!(y.len(), want.len());
            let dy = super::max_abs_diff(y, &want);
            assert!(dy < 1e-5, "TP {tp}, rank {rank}: output off by {dy}");
        }
    }
    Ok(())
}

/// A Burn user who needs no parallelism converts the record once: `convert_named_mpk` writes
/// burnpack, which Burn 0.22's own reader loads into the plain model (here the model under
/// `burn::nn`), giving Burn 0.21's loss, logits and gradients. A half-precision record stays
/// f16: Burn 0.22 adopts a record's dtype unless asked to cast to the module's, which is
/// what Burn 0.21 did on load.
#[test]
fn a_converted_burn_0_21_record_loads_into_the_plain_burn_model() -> Result<(), Error> {
    use burn_megatron::dropin::convert_named_mpk;
    let fixtures = burn_mpk_dir();
    let dir = super::load::scratch("convert-mpk");
    let config = plain::SharedLayerModelConfig::new(VOCAB, 16, 4, 32, 3);
    for record in ["model.mpk", "model_half.mpk.gz"] {
        let (loss, logits, grads) = burn_0_21_expected(record)?;
        let converted = dir.join(format!("{record}.bpk"));
        let n = convert_named_mpk(&fixtures.join(record), &converted)?;
        assert_eq!(n, 25, "{record}");
        let device = Device::flex().autodiff();
        let stored = burn::store::ModuleRecord::load(&converted)?;
        let kept = config.init(&device).try_load_record(stored.clone())?;
        let half = record.contains("half");
        let dtype = kept.output.weight.val().dtype();
        assert_eq!(
            dtype == burn::tensor::DType::F16,
            half,
            "{record}: {dtype:?}"
        );
        let model = config
            .init(&device)
            .try_load_record(stored.cast_to_module_dtype())?;
        let (ids, targets, mask_pad) = batch(&device);
        let got_logits = burn_megatron_tests::values(model.logits(ids.clone(), mask_pad.clone()));
        let dl = super::max_abs_diff(&got_logits, &logits);
        assert!(dl < 1e-5, "{record}: logits off by {dl}");
        let loss_tensor = model.loss(ids, targets, mask_pad);
        let (got_loss, got_grads) = super::loss_and_grads(&model, loss_tensor, &super::solo());
        assert!(
            (got_loss - loss).abs() < 1e-5,
            "{record}: loss {got_loss}, Burn 0.21's {loss}"
        );
        if let Some(grads) = &grads {
            let (worst, name) = super::grad_diff(&got_grads, grads);
            assert!(worst < 1e-5, "{record}: gradient {name} off by {worst}");
        }
    }
    // A file that is not a record is refused, naming it; nothing is written.
    let bad = dir.join("not-a-record.mpk");
    std::fs::write(&bad, b"not msgpack")?;
    let e = convert_named_mpk(&bad, &dir.join("out.bpk"))
        .err()
        .ok_or("converted garbage")?;
    assert!(e.to_string().contains("not-a-record.mpk"), "{e}");
    assert!(!dir.join("out.bpk").exists());
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
