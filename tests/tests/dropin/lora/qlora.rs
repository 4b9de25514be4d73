//! Burn's QLoRA on a split model: each rank quantizes its shards, and the split model trains
//! as Burn's QLoRA model on one rank.

use super::{
    D, Error, FF, HEADS, VOCAB, assert_as_reference, ids, lora, loss, parallel, plain, plan,
    reference,
};
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use burn_megatron::dropin::{
    LoadOptions, RecordSource, apply_qlora, load_sharded, save_gathered, save_gathered_group,
};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;

/// Burn's QLoRA quantizer: blocks of one row and two columns, over the parameters `group`
/// matches (all without it).
fn quantizer(device: &Device, group: Option<&str>) -> Result<burn::module::Quantizer, Error> {
    use burn::tensor::quantization::{Calibration, QuantValue, ScaleDtype};
    let scheme = device.settings().quantization.scheme;
    let scheme = scheme
        .with_value(QuantValue::Q8S)
        .per_block([1, 2], ScaleDtype::F32);
    let mut quantizer = burn::module::Quantizer::new(Calibration::MinMax, scheme);
    if let Some(group) = group {
        let group = burn::module::ParamGroup::from_regex(group).map_err(|e| format!("{e:?}"))?;
        quantizer.set_param_group(group);
    }
    Ok(quantizer)
}

/// Burn's QLoRA on the split model (`dropin::apply_qlora`, after the plan and the base loaded
/// shard by shard): each rank quantizes its shards as the whole weights' blocks are quantized,
/// and its adapters are one adapter, so the model trains as Burn's QLoRA model on one rank:
/// the loss, every adapter's gradient and the weights after an AdamW step, at TP 2 and at TP
/// 4. At TP 4 the cross-attention's key and value (4 features, one a rank) split into no
/// block of two: refused on every rank before anything is quantized, naming the layer, and
/// quantized without that layer, the model trains as Burn's quantized alike. The adapters
/// come from the trained reference's record; its quantized base is skipped, and the split
/// model quantizes the float base itself.
#[test]
fn burns_qlora_on_the_split_model_trains_as_burns_at_tp_2_and_4() -> Result<(), Error> {
    let dir = crate::dropin::load::scratch("qlora");
    let base = dir.join("base.bpk");
    let ad = Device::flex().autodiff();
    ad.seed(17);
    plain::Net::new(VOCAB, D, HEADS, FF, &ad).save_file(&base)?;
    let split_base = |g: &burn_megatron::comm::Comm, d: &Device| {
        let net = plan()?.apply(parallel::Net::new(VOCAB, D, HEADS, FF, d), g)?;
        let source = RecordSource::from_path(&base);
        Ok::<_, Error>(load_sharded(net, &source, g, &LoadOptions::default())?.0)
    };
    let refused = tp_ranks(4, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let qlora = apply_qlora(split_base(g, d)?, lora(), quantizer(d, None)?, g);
        Ok::<_, Error>(qlora.err().map(|e| e.to_string()))
    })?;
    for e in refused {
        let e = e.expect("a block straddling two shards is refused");
        assert!(e.contains("cross.") && e.contains("[1, 2]"), "{e}");
    }
    let adapters_only = LoadOptions::default()
        .with_skipped(r"(weight|bias)$")?
        .with_allow_missing(true);
    let not_cross = r"^(embed|attn|mix|up|down|out)\.";
    for (tp, group) in [(2, None), (4, Some(not_cross))] {
        let record = dir.join(format!("trained-{tp}.bpk"));
        let qlora = |d: &Device| -> Result<_, Error> {
            Ok(burn::module::QLora::new(lora(), quantizer(d, group)?))
        };
        let plain = plain::Net::new(VOCAB, D, HEADS, FF, &ad)
            .load_file(&base)
            .apply_qlora(qlora(&ad)?);
        let (want_loss, want_grads, want_after) =
            reference(plain, |m| loss(m.logits(ids(&ad))), &record)?;
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let net = apply_qlora(split_base(g, d)?, lora(), quantizer(d, group)?, g)?;
            // The quantized base takes no float weights.
            let into_quantized = load_sharded(
                net.clone(),
                &RecordSource::from_path(&base),
                g,
                &LoadOptions::default(),
            );
            let e = into_quantized
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("a quantized parameter"), "{e:?}");
            // Nor does `save_gathered` write it (it gathers float tensors): the adapters are
            // written alone, below.
            let saved = save_gathered(&net, dir.join(format!("quantized-{tp}")), g);
            let e = saved.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("not supported by the collectives"), "{e:?}");
            let source = RecordSource::from_path(&record);
            let (net, report) = load_sharded(net, &source, g, &adapters_only)?;
            assert_eq!(report.loaded.len(), 2 * 13, "{:?}", report.loaded);
            let l = loss(net.logits(ids(d)));
            let value = l.clone().into_scalar::<f32>();
            let grads = GradientsParams::from_grads(l.backward(), &net);
            let gathered_grads = gathered(&net, Some(&grads), g);
            let net = AdamWConfig::new().init().step(5e-2, net, grads);
            let lora =
                burn::module::ParamGroup::from_regex(r"\.lora\.").map_err(|e| format!("{e:?}"))?;
            save_gathered_group(&net, dir.join(format!("adapters-{tp}")), g, &lora)?;
            let trained = loss(net.logits(ids(d))).into_scalar::<f32>();
            Ok::<_, Error>(((value, gathered_grads, gathered(&net, None, g)), trained))
        })?;
        let (ranks, trained): (Vec<_>, Vec<f32>) = out.into_iter().unzip();
        assert_as_reference(
            &format!("TP {tp}"),
            &ranks,
            (want_loss, &want_grads, &want_after),
        );
        // The adapters written alone, over Burn's QLoRA model of the same base: the split
        // model's loss after its step.
        let plain = plain::Net::new(VOCAB, D, HEADS, FF, &ad)
            .load_file(&base)
            .apply_qlora(qlora(&ad)?);
        let adapters = RecordSource::from_path(dir.join(format!("adapters-{tp}.bpk")));
        let missing = LoadOptions::default().with_allow_missing(true);
        let (plain, report) = load_sharded(plain, &adapters, &crate::dropin::solo(), &missing)?;
        assert_eq!(
            report.loaded.len(),
            2 * 13,
            "only the adapters: {:?}",
            report.loaded
        );
        let reloaded = loss(plain.logits(ids(&ad))).into_scalar::<f32>();
        assert!(
            (reloaded - trained[0]).abs() < 1e-4,
            "{reloaded} against {}",
            trained[0]
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
