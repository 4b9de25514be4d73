//! Burn's `nn::attention::CrossAttention` swapped for `dropin::nn`'s and split by an `encoder`
//! rule: queries of one width over a context of another, 8 query heads sharing 4 key/value
//! heads. At TP 2 and 4, loaded from the record Burn's layer saved, the output (whole and
//! through the decoding cache) and every gathered gradient are Burn's; heads that do not
//! split are refused, naming the layer and the numbers.

use super::Error;
use burn::module::Module;
use burn::nn::attention::{CrossAttentionCache, CrossAttentionConfig};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_megatron::dropin::nn::attention as ours;
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{data, values};

const D_MODEL: usize = 16;
const D_CONTEXT: usize = 12;
const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const D_HEAD: usize = 3;
const B: usize = 2;
const S_Q: usize = 5;
const S_C: usize = 7;

/// A user's block holding the attention.
#[derive(Module, Debug)]
struct Block {
    attn: ours::CrossAttention,
}

fn config() -> CrossAttentionConfig {
    CrossAttentionConfig::new(D_MODEL, D_CONTEXT, HEADS, KV_HEADS, D_HEAD).with_dropout(0.0)
}

fn ours_config() -> ours::CrossAttentionConfig {
    ours::CrossAttentionConfig::new(D_MODEL, D_CONTEXT, HEADS, KV_HEADS, D_HEAD).with_dropout(0.0)
}

/// The second sample's last two context positions are padding.
fn padding(device: &Device) -> Tensor<2, Bool> {
    let pad: Vec<bool> = (0..B * S_C)
        .map(|i| i / S_C == 1 && i % S_C >= S_C - 2)
        .collect();
    Tensor::from_data(TensorData::new(pad, [B, S_C]), device)
}

/// The layer's output, a loss weighting it, and two decoding steps through a cache (three
/// queries, then five), whatever the layer.
struct Run {
    output: Vec<f32>,
    cached: Vec<Vec<f32>>,
}

fn run(
    forward: impl Fn(Tensor<3>, Tensor<3>, Tensor<2, Bool>) -> Tensor<3>,
    decode: impl Fn(Tensor<3>, Tensor<3>, Tensor<2, Bool>) -> Tensor<3>,
    device: &Device,
) -> (Tensor<1>, Run) {
    let query = data([B, S_Q, D_MODEL], 0, 1, device);
    let context = data([B, S_C, D_CONTEXT], 0, 2, device);
    let out = forward(query.clone(), context.clone(), padding(device));
    let loss = (out.clone() * data([B, S_Q, D_MODEL], 0, 3, device)).sum();
    let cached = [3, S_Q]
        .map(|s| {
            values(decode(
                query.clone().narrow(1, 0, s),
                context.clone(),
                padding(device),
            ))
        })
        .to_vec();
    let output = values(out);
    (loss, Run { output, cached })
}

#[test]
fn burns_cross_attention_splits_by_query_and_key_value_heads_at_tp_2_and_4() -> Result<(), Error> {
    let dir = super::load::scratch("cross-attention");
    let record = dir.join("attn.bpk");
    let device = Device::flex();
    device.seed(5);
    config().init(&device).save_file(&record)?;
    let ad = Device::flex().autodiff();
    let plain = config().init(&ad).load_file(&record);
    let cache = std::cell::RefCell::new(CrossAttentionCache::new());
    let (loss, want) = run(
        |q, c, m| plain.forward(q, c, Some(m)),
        |q, c, m| plain.forward_cache(q, c, Some(m), &mut cache.borrow_mut()),
        &ad,
    );
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &plain);
    let grads: super::Values = gathered(&plain, Some(&grads), &super::solo())
        .into_iter()
        .map(|(k, v)| (format!("attn.{k}"), v))
        .collect();

    // Burn's layer, its record loaded into ours in memory: the same numbers, unsplit.
    let converted = ours_config()
        .init(&device)
        .load_record(config().init(&device).load_file(&record).into_record());
    let out = converted.forward(
        data([B, S_Q, D_MODEL], 0, 1, &device),
        data([B, S_C, D_CONTEXT], 0, 2, &device),
        Some(padding(&device)),
    );
    let d = super::max_abs_diff(&values(out), &want.output);
    assert!(
        d < 1e-6,
        "Burn's record loaded into ours: output off by {d}"
    );

    let options = LoadOptions::default().with_key_remap("^", "attn.")?;
    let source = RecordSource::from_path(&record);
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let block = Block {
                attn: ours_config().init(d),
            };
            let block = TpPlan::new().encoder(&["attn"])?.apply(block, g)?;
            let (block, _) = load_sharded(block, &source, g, &options)?;
            let cache = std::cell::RefCell::new(ours::CrossAttentionCache::new());
            let (loss, got) = run(
                |q, c, m| block.attn.forward(q, c, Some(m)),
                |q, c, m| {
                    block
                        .attn
                        .forward_cache(q, c, Some(m), &mut cache.borrow_mut())
                },
                d,
            );
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &block);
            Ok::<_, Error>((got, gathered(&block, Some(&grads), g)))
        })?;
        for (rank, (got, gr)) in out.iter().enumerate() {
            let what = format!("TP {tp}, rank {rank}");
            let d = super::max_abs_diff(&got.output, &want.output);
            assert!(d < 1e-5, "{what}: output off by {d}");
            for (step, (got, want)) in got.cached.iter().zip(&want.cached).enumerate() {
                let d = super::max_abs_diff(got, want);
                assert!(d < 1e-5, "{what}: decoding step {step} off by {d}");
            }
            let (worst, name) = super::grad_diff(gr, &grads);
            assert!(worst < 1e-5, "{what}: {name} off by {worst}");
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// Key/value heads that do not split over the ranks (the query heads do), heads that cannot
/// share their key/value heads, and sequence parallelism for an attention with no residual
/// stream are refused when the plan is applied, naming the layer.
#[test]
fn cross_attention_heads_that_do_not_split_are_refused_by_the_plan() -> Result<(), Error> {
    let errors = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let refusal = |heads, kv_heads, plan: TpPlan| {
            let attn = ours::CrossAttentionConfig::new(12, 8, heads, kv_heads, 2).init(d);
            plan.apply(Block { attn }, g).unwrap_err().to_string()
        };
        let plan = || TpPlan::new().encoder(&["attn"]);
        Ok::<_, Error>([
            refusal(6, 3, plan()?),
            refusal(6, 4, plan()?),
            refusal(4, 2, plan()?.sequence_parallel()),
        ])
    })?;
    let [kv, share, sequence] = &errors[0];
    assert!(
        kv.contains("attn.tp") && kv.contains("3 key/value heads") && kv.contains("size 2"),
        "{kv}"
    );
    assert!(
        share.contains("attn.tp") && share.contains("6 query heads cannot share 4"),
        "{share}"
    );
    assert!(
        sequence.contains("attn:") && sequence.contains("without sequence parallelism"),
        "{sequence}"
    );
    Ok(())
}
