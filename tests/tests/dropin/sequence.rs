//! Sequence parallelism in a split encoder and decoder (`TpPlan::sequence_parallel`): at TP
//! 2 and 4, pre- and post-norm, Burn's encoder under a padding mask and Burn's decoder under
//! a causal mask over a memory of odd length (which stays whole) give Burn's outputs and
//! gradients straight from backward, as a plain Burn training loop takes them (the norms'
//! and row biases' partial gradients are summed inside the graph). The collectives show the
//! split: all-gathers and reduce-scatters, and all-reduces of parameter-sized vectors only. A
//! sequence that does not split is padded and gives Burn's result; plans it cannot apply to
//! are errors naming them; decoding with a cache runs whole and gives the same tokens.

use super::{B, D_MODEL, Error, HEADS, Values, config, encoder_record, padding, plain_encoder};
use burn::module::Module;
use burn::nn::transformer as burn_tr;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use burn_megatron::comm::{Comm, Probed};
use burn_megatron::dropin::TpPlan;
use burn_megatron::dropin::nn::attention::{
    MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn_megatron::dropin::nn::transformer as ours;
use burn_megatron::tensor_parallel::parallel_attrs;
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::{data, tp_ranks, values};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Splits over 2 and 4 ranks.
const S: usize = 8;
/// The decoder's memory: whole on every rank, so any length.
const S_M: usize = 7;

/// The collectives counted.
const OPS: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

/// Calls and elements sent per collective, as a [`Probed`] group saw them.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<&'static str, (usize, usize)>>);

impl Counts {
    /// Calls of `op` and the elements they sent.
    fn calls(&self, op: &str) -> (usize, usize) {
        self.0.lock().unwrap().get(op).copied().unwrap_or_default()
    }
}

/// `tp`, counting its collectives into the returned counts.
fn counting(tp: &Comm) -> (Comm, Arc<Counts>) {
    let counts = Arc::new(Counts::default());
    let seen = counts.clone();
    let probed = Probed::new(tp.clone(), move |call| {
        let mut calls = seen.0.lock().unwrap();
        let entry = calls.entry(call.op).or_default();
        *entry = (entry.0 + 1, entry.1 + call.elements);
    });
    (Arc::new(probed), counts)
}

/// The plan of these tests: Megatron's split of every layer, with or without sequence
/// parallelism.
fn plan(root: &str, sequence_parallel: bool) -> Result<TpPlan, Error> {
    let plan = TpPlan::new().encoder(&[root])?;
    Ok(match sequence_parallel {
        true => plan.sequence_parallel(),
        false => plan,
    })
}

/// `sum(y · w)`'s gradients of `module`, gathered.
fn grads<M: Module>(module: &M, y: Tensor<3>, w: Tensor<3>, tp: &Comm) -> Values {
    let grads = GradientsParams::from_grads((y * w).sum().backward(), module);
    gathered(module, Some(&grads), tp)
}

/// Burn's encoder's output and gradients over a sequence of `s`.
fn plain_encoder_run(
    config: &burn_tr::TransformerEncoderConfig,
    record: &std::path::Path,
    s: usize,
) -> (Vec<f32>, Values) {
    let d = Device::flex().autodiff();
    let encoder = plain_encoder(config, record, &d);
    let input = burn_tr::TransformerEncoderInput::new(data([B, s, D_MODEL], 0, 1, &d))
        .mask_pad(padding(s, &d));
    let y = encoder.forward(input);
    let g = grads(
        &encoder,
        y.clone(),
        data([B, s, D_MODEL], 0, 2, &d),
        &super::solo(),
    );
    (values(y), g)
}

#[test]
fn a_sequence_parallel_encoder_gives_burns_output_and_gradients() -> Result<(), Error> {
    let dir = super::load::scratch("sequence");
    for norm_first in [false, true] {
        let config = config(norm_first, 0.0);
        let record = encoder_record(&config, &dir, &format!("encoder-{norm_first}.bpk"));
        let (y_plain, g_plain) = plain_encoder_run(&config, &record, S);
        for tp in [2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let d = &ctx.device;
                let mut calls = Vec::new();
                let mut runs = Vec::new();
                for sequence_parallel in [false, true] {
                    let (g, counting) = counting(&ctx.groups.tp);
                    let encoder: ours::TransformerEncoder =
                        plain_encoder(&config, &record, d).into();
                    let encoder = plan("layers.*", sequence_parallel)?.apply(encoder, &g)?;
                    // Tracked, so every layer's communication runs backward too.
                    let x = data([B, S, D_MODEL], 0, 1, d).require_grad();
                    let input = ours::TransformerEncoderInput::new(x).mask_pad(padding(S, d));
                    let y = encoder.forward(input);
                    let w = data([B, S, D_MODEL], 0, 2, d);
                    let grads =
                        GradientsParams::from_grads((y.clone() * w).sum().backward(), &encoder);
                    calls.push(OPS.map(|op| counting.calls(op)));
                    // Whole already: `finalize_model_grads` must not sum them again.
                    let norm = &encoder.layers[0].norm_1;
                    let bias = encoder.layers[0].pwff.linear_outer.bias.as_ref().unwrap();
                    let marked =
                        [norm.gamma.id, bias.id].map(|id| parallel_attrs(id).sequence_parallel);
                    runs.push((values(y), gathered(&encoder, Some(&grads), &g), marked));
                }
                Ok::<_, Error>((calls, runs))
            })?;
            for (rank, (calls, runs)) in out.iter().enumerate() {
                let what = format!("norm_first {norm_first}, TP {tp}, rank {rank}");
                for ((y, g, marked), sp) in runs.iter().zip([false, true]) {
                    super::assert_parity(
                        &format!("{what}, sequence parallel {sp}"),
                        (y, g),
                        (&y_plain, &g_plain),
                    );
                    assert_eq!(marked, &[false; 2], "{what}: norm and row bias marked");
                }
                // Two layers. Tensor parallelism all-reduces each block's output forward and
                // each column layer's input gradient backward (query, key and value apart):
                // activations, `[B, S, D]` each. Sequence parallelism all-gathers before each
                // block (once for query, key and value) and reduce-scatters after it; backward
                // gathers again for the weight gradients, reduce-scatters the input gradients
                // and all-gathers the output's; with the stack's gather out and its scatter's
                // gradient in. It all-reduces only the norms' parameters and the row biases'
                // (six `D` vectors a layer).
                let activation = B * S * D_MODEL;
                let [all_reduce, all_gather, reduce_scatter] = calls[0];
                assert_eq!(all_reduce, (12, 12 * activation), "{what}: tensor parallel");
                assert_eq!(
                    (all_gather.0, reduce_scatter.0),
                    (0, 0),
                    "{what}: tensor parallel"
                );
                let [all_reduce, all_gather, reduce_scatter] = calls[1];
                assert_eq!(all_reduce, (12, 12 * D_MODEL), "{what}: sequence parallel");
                assert_eq!(
                    (all_gather.0, reduce_scatter.0),
                    (14, 8),
                    "{what}: sequence parallel"
                );
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn a_sequence_parallel_decoder_keeps_its_memory_whole_and_gives_burns_result() -> Result<(), Error>
{
    let dir = super::load::scratch("sequence-decoder");
    for norm_first in [false, true] {
        let record = dir.join(format!("decoder-{norm_first}.bpk"));
        let burn_config = burn_tr::TransformerDecoderConfig::new(D_MODEL, 32, HEADS, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first);
        let device = Device::flex();
        device.seed(5);
        burn_config.init(&device).save_file(&record)?;
        let inputs = |d: &Device| {
            (
                data([B, S, D_MODEL], 0, 1, d),
                data([B, S_M, D_MODEL], 0, 2, d),
                data([B, S, D_MODEL], 0, 3, d),
            )
        };
        let ad = Device::flex().autodiff();
        let plain = burn_config.init(&ad).load_file(&record);
        let (target, memory, w) = inputs(&ad);
        let input = burn_tr::TransformerDecoderInput::new(target, memory)
            .target_mask_attn(generate_autoregressive_mask(B, S, &ad))
            .memory_mask_pad(padding(S_M, &ad));
        let y = plain.forward(input);
        let (y_plain, g_plain) = (values(y.clone()), grads(&plain, y, w, &super::solo()));
        for tp in [2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let decoder: ours::TransformerDecoder =
                    burn_config.init(d).load_file(&record).into();
                let decoder = plan("layers.*", true)?.apply(decoder, g)?;
                let (target, memory, w) = inputs(d);
                let input = ours::TransformerDecoderInput::new(target, memory)
                    .target_mask_attn(generate_autoregressive_mask(B, S, d))
                    .memory_mask_pad(padding(S_M, d));
                let y = decoder.forward(input);
                Ok::<_, Error>((values(y.clone()), grads(&decoder, y, w, g)))
            })?;
            for (rank, (y, g)) in out.iter().enumerate() {
                let what = format!("norm_first {norm_first}, TP {tp}, rank {rank}");
                super::assert_parity(&what, (y, g), (&y_plain, &g_plain));
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// An attention outside any transformer layer.
#[derive(Module, Debug)]
struct Attention {
    mha: MultiHeadAttention,
}

/// A sequence the ranks do not split (5 and 7 positions at TP 2 and 4) is padded at its end,
/// the padding masked and cut off: Burn's encoder under a padding mask, and Burn's decoder
/// under a causal mask give Burn's outputs and gradients; the encoder's layers called one by
/// one give its output.
#[test]
fn a_sequence_that_does_not_split_is_padded_and_gives_burns_result() -> Result<(), Error> {
    let dir = super::load::scratch("sequence-odd");
    let config = config(true, 0.0);
    let record = encoder_record(&config, &dir, "encoder.bpk");
    let decoder_record = dir.join("decoder.bpk");
    let burn_decoder = burn_tr::TransformerDecoderConfig::new(D_MODEL, 32, HEADS, 2)
        .with_dropout(0.0)
        .with_norm_first(true);
    let device = Device::flex();
    device.seed(6);
    burn_decoder.init(&device).save_file(&decoder_record)?;
    let decoder_inputs = |s: usize, d: &Device| {
        let (target, memory) = (
            data([B, s, D_MODEL], 0, 1, d),
            data([B, S_M, D_MODEL], 0, 2, d),
        );
        let w = data([B, s, D_MODEL], 0, 3, d);
        (target, memory, w)
    };
    for s in [5, 7] {
        let (y_plain, g_plain) = plain_encoder_run(&config, &record, s);
        let ad = Device::flex().autodiff();
        let plain = burn_decoder.init(&ad).load_file(&decoder_record);
        let (target, memory, w) = decoder_inputs(s, &ad);
        let input = burn_tr::TransformerDecoderInput::new(target, memory)
            .target_mask_attn(generate_autoregressive_mask(B, s, &ad))
            .memory_mask_pad(padding(S_M, &ad));
        let y = plain.forward(input);
        let (yd_plain, gd_plain) = (values(y.clone()), grads(&plain, y, w, &super::solo()));
        for tp in [2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let encoder: ours::TransformerEncoder = plain_encoder(&config, &record, d).into();
                let encoder = plan("layers.*", true)?.apply(encoder, g)?;
                let x = data([B, s, D_MODEL], 0, 1, d);
                let input = ours::TransformerEncoderInput::new(x.clone()).mask_pad(padding(s, d));
                let y = encoder.forward(input);
                // Layer by layer, as a model that calls the layers itself does.
                let by_layer = (encoder.layers.iter())
                    .fold(x, |x, layer| layer.forward(x, Some(padding(s, d)), None));
                let layered = values(by_layer);
                let encoded = (
                    values(y.clone()),
                    grads(&encoder, y, data([B, s, D_MODEL], 0, 2, d), g),
                );
                let decoder: ours::TransformerDecoder =
                    burn_decoder.init(d).load_file(&decoder_record).into();
                let decoder = plan("layers.*", true)?.apply(decoder, g)?;
                let (target, memory, w) = decoder_inputs(s, d);
                let input = ours::TransformerDecoderInput::new(target, memory)
                    .target_mask_attn(generate_autoregressive_mask(B, s, d))
                    .memory_mask_pad(padding(S_M, d));
                let y = decoder.forward(input);
                let decoded = (values(y.clone()), grads(&decoder, y, w, g));
                Ok::<_, Error>((encoded, decoded, layered))
            })?;
            for (rank, (encoded, decoded, layered)) in out.iter().enumerate() {
                let what = format!("s {s}, TP {tp}, rank {rank}");
                let (y, g) = encoded;
                super::assert_parity(&format!("{what}, encoder"), (y, g), (&y_plain, &g_plain));
                assert_eq!(layered, y, "{what}: the encoder's layers one by one");
                let (y, g) = decoded;
                super::assert_parity(&format!("{what}, decoder"), (y, g), (&yd_plain, &gd_plain));
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A plan with no `encoder` rule, or one naming an attention alone, is an error; decoding
/// with a cache runs whole, as the same model without sequence parallelism.
#[test]
fn sequence_parallelism_refuses_what_it_cannot_split_and_decodes_whole() -> Result<(), Error> {
    let out = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let encoder = || {
            ours::TransformerEncoderConfig::new(D_MODEL, 32, HEADS, 2)
                .with_dropout(0.0)
                .init(d)
        };
        let sp = plan("layers.*", true)?.with_seed(4).apply(encoder(), g)?;
        let no_encoder = TpPlan::new()
            .column(&["layers.0.mha.query"])?
            .sequence_parallel();
        let no_encoder = no_encoder.apply(encoder(), g).unwrap_err().to_string();
        let attention = Attention {
            mha: MultiHeadAttentionConfig::new(D_MODEL, HEADS).init(d),
        };
        let alone = plan("mha", true)?
            .apply(attention, g)
            .unwrap_err()
            .to_string();
        // Decoding with a cache, with and without sequence parallelism: the same weights.
        let whole = plan("layers.*", false)?.with_seed(4).apply(encoder(), g)?;
        let x = data([B, 4, D_MODEL], 0, 7, d);
        let mut steps = Vec::new();
        for model in [&sp, &whole] {
            let mut cache = model.new_autoregressive_cache();
            let mut out = Vec::new();
            for s in 1..=4 {
                let input = ours::TransformerEncoderInput::new(x.clone().narrow(1, 0, s))
                    .mask_attn(generate_autoregressive_mask(B, s, d));
                out.extend(values(
                    model.forward_autoregressive_inference(input, &mut cache),
                ));
            }
            steps.push(out);
        }
        Ok::<_, Error>((no_encoder, alone, steps))
    })?;
    let (no_encoder, alone, steps) = &out[0];
    assert!(no_encoder.contains("`encoder` rule"), "{no_encoder}");
    assert!(
        alone.contains("mha: ") && alone.contains("attention on its own"),
        "{alone}"
    );
    assert_eq!(
        steps[0], steps[1],
        "decoding runs whole under a sequence-parallel plan"
    );
    Ok(())
}
