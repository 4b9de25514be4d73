//! Burn's autoregressive inference through the drop-in layers: an encoder under a causal mask
//! and a decoder over a fixed memory, split at TP 2 and 4 and loaded from the records Burn's
//! layers saved, give Burn's cached outputs at every decoding step (`forward_cache`,
//! `new_autoregressive_cache`, `forward_autoregressive_inference`). The steps alternate
//! between two sequences, so that a cache that recomputed the earlier positions (or joined the
//! new one wrongly) would differ.

use super::Error;
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::transformer as burn_tr;
use burn::tensor::{Device, Tensor};
use burn_megatron::dropin::nn::transformer as ours;
use burn_megatron::dropin::{RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{data, values};

const D: usize = 16;
const B: usize = 2;
const STEPS: usize = 5;
const S_M: usize = 7;

/// Step `t`'s input, `[B, t, D]`: the first `t` positions of one of two sequences (the
/// second the first with its features reversed: not a shift or a scale, which a norm undoes).
fn step(t: usize, d: &Device) -> Tensor<3> {
    let x = data([B, STEPS, D], 0, 1, d).narrow(1, 0, t);
    match t % 2 {
        0 => x,
        _ => x.flip([2]),
    }
}

fn memory(d: &Device) -> Tensor<3> {
    data([B, S_M, D], 0, 3, d)
}

fn largest_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let steps = a.iter().zip(b).map(|(a, b)| super::max_abs_diff(a, b));
    steps.fold(0f32, f32::max)
}

#[test]
fn burns_autoregressive_inference_runs_through_the_split_encoder_and_decoder() -> Result<(), Error>
{
    let dir = super::load::scratch("cache");
    for norm_first in [false, true] {
        let enc_config = burn_tr::TransformerEncoderConfig::new(D, 32, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        let dec_config = burn_tr::TransformerDecoderConfig::new(D, 32, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        let (enc_record, dec_record) = (dir.join("encoder.bpk"), dir.join("decoder.bpk"));
        enc_config.init(&Device::flex()).save_file(&enc_record)?;
        dec_config.init(&Device::flex()).save_file(&dec_record)?;
        // Burn's own decoding, step by step.
        let d = Device::flex();
        let (encoder, decoder) = (
            enc_config.init(&d).load_file(&enc_record),
            dec_config.init(&d).load_file(&dec_record),
        );
        let (mut enc_cache, mut dec_cache) = (
            encoder.new_autoregressive_cache(),
            decoder.new_autoregressive_cache(),
        );
        let (mut enc_want, mut dec_want) = (Vec::new(), Vec::new());
        for t in 1..=STEPS {
            let mask = generate_autoregressive_mask(B, t, &d);
            let input = burn_tr::TransformerEncoderInput::new(step(t, &d)).mask_attn(mask.clone());
            enc_want.push(values(
                encoder.forward_autoregressive_inference(input, &mut enc_cache),
            ));
            let input = burn_tr::TransformerDecoderInput::new(step(t, &d), memory(&d))
                .target_mask_attn(mask);
            dec_want.push(values(
                decoder.forward_autoregressive_inference(input, &mut dec_cache),
            ));
        }
        // The steps' inputs alternate, so the cached outputs are not the whole forward's.
        let full = encoder.forward(
            burn_tr::TransformerEncoderInput::new(step(STEPS, &d))
                .mask_attn(generate_autoregressive_mask(B, STEPS, &d)),
        );
        let apart = largest_diff(&[values(full)], &enc_want[STEPS - 1..]);
        assert!(
            apart > 1e-3,
            "the test cannot tell a cache from none ({apart})"
        );
        for tp in [2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let plan = TpPlan::new().encoder(&["layers.*"])?;
                let encoder = ours::TransformerEncoderConfig::new(D, 32, 4, 2)
                    .with_dropout(0.0)
                    .with_norm_first(norm_first)
                    .init(d);
                let decoder = ours::TransformerDecoderConfig::new(D, 32, 4, 2)
                    .with_dropout(0.0)
                    .with_norm_first(norm_first)
                    .init(d);
                let options = Default::default();
                let source = RecordSource::from_path(&enc_record);
                let (encoder, _) = load_sharded(plan.apply(encoder, g)?, &source, g, &options)?;
                let source = RecordSource::from_path(&dec_record);
                let (decoder, _) = load_sharded(plan.apply(decoder, g)?, &source, g, &options)?;
                let (mut enc_cache, mut dec_cache) = (
                    encoder.new_autoregressive_cache(),
                    decoder.new_autoregressive_cache(),
                );
                let (mut enc, mut dec) = (Vec::new(), Vec::new());
                for t in 1..=STEPS {
                    let mask = generate_autoregressive_mask(B, t, d);
                    let input =
                        ours::TransformerEncoderInput::new(step(t, d)).mask_attn(mask.clone());
                    enc.push(values(
                        encoder.forward_autoregressive_inference(input, &mut enc_cache),
                    ));
                    let input = ours::TransformerDecoderInput::new(step(t, d), memory(d))
                        .target_mask_attn(mask);
                    dec.push(values(
                        decoder.forward_autoregressive_inference(input, &mut dec_cache),
                    ));
                }
                Ok::<_, Error>((enc, dec))
            })?;
            for (rank, (enc, dec)) in out.iter().enumerate() {
                let what = format!("norm_first {norm_first}, TP {tp}, rank {rank}");
                let e = largest_diff(enc, &enc_want);
                assert!(e < 1e-5, "{what}: the encoder's steps off by {e}");
                let e = largest_diff(dec, &dec_want);
                assert!(e < 1e-5, "{what}: the decoder's steps off by {e}");
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
