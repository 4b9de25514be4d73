//! Burn's `nn::attention::MultiHeadAttention` used on its own, swapped for `dropin::nn`'s
//! and split by an `encoder` rule: at TP 2 and 4, from the record Burn's layer saved,
//! self-attention under padding and causal masks and cross-attention over a longer key
//! sequence give Burn's context, each rank its heads' slice of Burn's attention weights, and
//! Burn's gradients (gathered).

use super::Error;
use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig, generate_autoregressive_mask};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_megatron::dropin::nn::attention as ours;
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{data, values};

const D: usize = 16;
const HEADS: usize = 4;
const B: usize = 2;
const S_Q: usize = 5;
const S_K: usize = 7;

/// A user's block holding the attention.
#[derive(Module, Debug)]
struct Block {
    attn: ours::MultiHeadAttention,
}

/// One attention call: query, key and value, the padding mask, and a causal mask or none.
struct Call {
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    mask_pad: Tensor<2, Bool>,
    causal: bool,
}

/// Self-attention under padding and causal masks, cross-attention over 7 keys under padding;
/// the second sample's last two keys are padding.
fn calls(device: &Device) -> Vec<Call> {
    let pad = |s: usize| {
        let pad: Vec<bool> = (0..B * s).map(|i| i / s == 1 && i % s >= s - 2).collect();
        Tensor::<2, Bool>::from_data(TensorData::new(pad, [B, s]), device)
    };
    let x = data([B, S_Q, D], 0, 1, device);
    vec![
        Call {
            query: x.clone(),
            key: x.clone(),
            value: x,
            mask_pad: pad(S_Q),
            causal: true,
        },
        Call {
            query: data([B, S_Q, D], 0, 2, device),
            key: data([B, S_K, D], 0, 3, device),
            value: data([B, S_K, D], 0, 4, device),
            mask_pad: pad(S_K),
            causal: false,
        },
    ]
}

/// Each call's context and weights, and a loss weighting every context.
fn run(
    attend: impl Fn(&Call) -> (Tensor<3>, Tensor<4>),
    device: &Device,
) -> (Tensor<1>, Vec<(Vec<f32>, Tensor<4>)>) {
    let mut loss = Tensor::<1>::zeros([1], device);
    let mut out = Vec::new();
    for (i, call) in calls(device).iter().enumerate() {
        let (context, weights) = attend(call);
        loss = loss + (context.clone() * data([B, S_Q, D], 0, 10 + i, device)).sum();
        out.push((values(context), weights));
    }
    (loss, out)
}

#[test]
fn burns_multi_head_attention_on_its_own_splits_by_heads_at_tp_2_and_4() -> Result<(), Error> {
    let dir = super::load::scratch("attention");
    let record = dir.join("attn.bpk");
    let config = MultiHeadAttentionConfig::new(D, HEADS).with_dropout(0.0);
    let device = Device::flex();
    device.seed(3);
    config.init(&device).save_file(&record)?;
    let ad = Device::flex().autodiff();
    let plain = config.init(&ad).load_file(&record);
    let (loss, plain_out) = run(
        |c| {
            let input = MhaInput::new(c.query.clone(), c.key.clone(), c.value.clone())
                .mask_pad(c.mask_pad.clone());
            let input = match c.causal {
                true => input.mask_attn(generate_autoregressive_mask(B, S_Q, &c.query.device())),
                false => input,
            };
            let out = plain.forward(input);
            (out.context, out.weights)
        },
        &ad,
    );
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &plain);
    let grads: super::Values = gathered(&plain, Some(&grads), &super::solo())
        .into_iter()
        .map(|(k, v)| (format!("attn.{k}"), v))
        .collect();
    let options = LoadOptions::default().with_key_remap("^", "attn.")?;
    let source = RecordSource::from_path(&record);
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let block = Block {
                attn: ours::MultiHeadAttentionConfig::new(D, HEADS)
                    .with_dropout(0.0)
                    .init(d),
            };
            let block = TpPlan::new().encoder(&["attn"])?.apply(block, g)?;
            let (block, _) = load_sharded(block, &source, g, &options)?;
            let (loss, out) = run(
                |c| {
                    let input =
                        ours::MhaInput::new(c.query.clone(), c.key.clone(), c.value.clone())
                            .mask_pad(c.mask_pad.clone());
                    let input = match c.causal {
                        true => input.mask_attn(generate_autoregressive_mask(B, S_Q, d)),
                        false => input,
                    };
                    let out = block.attn.forward(input);
                    (out.context, out.weights)
                },
                d,
            );
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &block);
            let out: Vec<_> = out.into_iter().map(|(c, w)| (c, values(w))).collect();
            Ok::<_, Error>((out, gathered(&block, Some(&grads), g)))
        })?;
        let per_rank = HEADS / tp;
        for (rank, (calls, gr)) in out.iter().enumerate() {
            let what = format!("TP {tp}, rank {rank}");
            for (i, ((context, weights), (plain_context, plain_weights))) in
                calls.iter().zip(&plain_out).enumerate()
            {
                let dc = super::max_abs_diff(context, plain_context);
                assert!(dc < 1e-5, "{what}, call {i}: context off by {dc}");
                let mine = plain_weights.clone().narrow(1, rank * per_rank, per_rank);
                let dw = super::max_abs_diff(weights, &values(mine.inner()));
                assert!(
                    dw < 1e-6,
                    "{what}, call {i}: its heads' weights off by {dw}"
                );
            }
            let (worst, name) = super::grad_diff(gr, &grads);
            assert!(worst < 1e-5, "{what}: {name} off by {worst}");
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Heads that do not split over the ranks are refused when the plan is applied, naming the
/// layer, on its own and inside an encoder, although the width (24 over 2) splits.
#[test]
fn attention_heads_that_do_not_split_are_refused_by_the_plan() -> Result<(), Error> {
    use burn_megatron::dropin::nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
    #[derive(Module, Debug)]
    struct WithEncoder {
        encoder: TransformerEncoder,
    }
    let errors = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let block = Block {
            attn: ours::MultiHeadAttentionConfig::new(24, 3).init(d),
        };
        let alone = TpPlan::new()
            .encoder(&["attn"])?
            .apply(block, g)
            .unwrap_err();
        let encoder = WithEncoder {
            encoder: TransformerEncoderConfig::new(24, 32, 3, 1).init(d),
        };
        let inside = TpPlan::new()
            .encoder(&["encoder"])?
            .apply(encoder, g)
            .unwrap_err();
        Ok::<_, Error>((alone.to_string(), inside.to_string()))
    })?;
    let (alone, inside) = &errors[0];
    assert!(
        alone.contains("attn.tp")
            && alone.contains("3 attention heads")
            && alone.contains("size 2"),
        "{alone}"
    );
    assert!(
        inside.contains("encoder.layers.0.mha") && inside.contains("3 attention heads"),
        "{inside}"
    );
    Ok(())
}
