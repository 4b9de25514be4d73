//! Burn's `nn::transformer::TransformerDecoder`, swapped for `dropin::nn`'s and split by an
//! `encoder` rule: at TP 2 and 4, from the record Burn's decoder saved, pre- and post-norm,
//! under a causal and a padding mask on the target and a padding mask on a longer memory, the
//! output and every gradient (gathered) are Burn's; with dropout the ranks agree on the
//! residual stream.

use super::Error;
use burn::module::Module;
use burn::nn::transformer as burn_tr;
use burn::tensor::{Device, Tensor};
use burn_megatron::dropin::nn::attention::generate_autoregressive_mask;
use burn_megatron::dropin::nn::transformer as ours;
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{data, values};

const D: usize = 16;
const B: usize = 2;
const S_T: usize = 5;
const S_M: usize = 7;

#[derive(Module, Debug)]
struct WithDecoder {
    decoder: ours::TransformerDecoder,
}

/// The target, the memory and the weighting of the output.
fn inputs(device: &Device) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let target = data([B, S_T, D], 0, 1, device);
    (
        target,
        data([B, S_M, D], 0, 2, device),
        data([B, S_T, D], 0, 3, device),
    )
}

#[test]
fn burns_transformer_decoder_splits_as_megatron_splits_a_layer_at_tp_2_and_4() -> Result<(), Error>
{
    let dir = super::load::scratch("decoder");
    for norm_first in [false, true] {
        let record = dir.join(format!("decoder-{norm_first}.bpk"));
        let plain_config = burn_tr::TransformerDecoderConfig::new(D, 32, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        let device = Device::flex();
        device.seed(8);
        plain_config.init(&device).save_file(&record)?;
        let ad = Device::flex().autodiff();
        let plain = plain_config.init(&ad).load_file(&record);
        let (target, memory, w) = inputs(&ad);
        let input = burn_tr::TransformerDecoderInput::new(target, memory)
            .target_mask_attn(generate_autoregressive_mask(B, S_T, &ad))
            .target_mask_pad(super::padding(S_T, &ad))
            .memory_mask_pad(super::padding(S_M, &ad));
        let y = plain.forward(input);
        let y_plain = values(y.clone());
        let grads = burn::optim::GradientsParams::from_grads((y * w).sum().backward(), &plain);
        let grads: super::Values = gathered(&plain, Some(&grads), &super::solo())
            .into_iter()
            .map(|(k, v)| (format!("decoder.{k}"), v))
            .collect();
        let options = LoadOptions::default().with_key_remap("^", "decoder.")?;
        let source = RecordSource::from_path(&record);
        for tp in [2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let config = ours::TransformerDecoderConfig::new(D, 32, 4, 2)
                    .with_dropout(0.0)
                    .with_norm_first(norm_first);
                let model = WithDecoder {
                    decoder: config.init(d),
                };
                let model = TpPlan::new().encoder(&["decoder"])?.apply(model, g)?;
                let (model, _) = load_sharded(model, &source, g, &options)?;
                let (target, memory, w) = inputs(d);
                let input = ours::TransformerDecoderInput::new(target, memory)
                    .target_mask_attn(generate_autoregressive_mask(B, S_T, d))
                    .target_mask_pad(super::padding(S_T, d))
                    .memory_mask_pad(super::padding(S_M, d));
                let y = model.decoder.forward(input);
                let grads = burn::optim::GradientsParams::from_grads(
                    (y.clone() * w).sum().backward(),
                    &model,
                );
                Ok::<_, Error>((values(y), gathered(&model, Some(&grads), g)))
            })?;
            for (rank, (y, gr)) in out.iter().enumerate() {
                let what = format!("norm_first {norm_first}, TP {tp}, rank {rank}");
                super::assert_parity(&what, (y, gr), (&y_plain, &grads));
            }
        }
    }
    // With dropout, every rank drops the same entries of the residual stream.
    let out = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let config = ours::TransformerDecoderConfig::new(D, 32, 4, 2).with_dropout(0.3);
        let model = WithDecoder {
            decoder: config.init(d),
        };
        let model = TpPlan::new()
            .encoder(&["decoder"])?
            .with_seed(2)
            .apply(model, g)?;
        let (target, memory, _) = inputs(d);
        let input = ours::TransformerDecoderInput::new(target, memory);
        let y = model.decoder.forward(input.clone());
        let eval = model.decoder.valid().forward(input);
        Ok::<_, Error>((values(y), values(eval)))
    })?;
    assert_ne!(out[0].0, out[0].1, "dropout applied in training");
    assert_eq!(
        out[0].0, out[1].0,
        "the residual stream is dropped alike on both ranks"
    );
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// An encoder rule on a part of a transformer layer alone is refused, naming the layer: the
/// layer's residual dropout would stay on Burn's process-wide generator.
#[test]
fn an_encoder_rule_on_part_of_a_layer_is_refused() -> Result<(), Error> {
    let errors = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let config = ours::TransformerDecoderConfig::new(D, 32, 4, 1);
        let model = || WithDecoder {
            decoder: config.init(d),
        };
        let part = TpPlan::new().encoder(&["decoder.layers.0.self_attn"])?;
        let part = part.apply(model(), g).unwrap_err().to_string();
        let layer = TpPlan::new()
            .encoder(&["decoder.layers.0"])?
            .apply(model(), g);
        Ok::<_, Error>((part, layer.is_ok()))
    })?;
    let (part, layer) = &errors[0];
    assert!(
        part.contains("`decoder.layers.0`") && part.contains("self_attn"),
        "{part}"
    );
    assert!(layer, "a whole layer may be named");
    Ok(())
}
