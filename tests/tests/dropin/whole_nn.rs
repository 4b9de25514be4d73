//! `dropin::nn` is all of Burn's `nn`: a model written against `burn::nn` compiles against it
//! with `use burn::nn;` swapped for `use dropin::nn;` and nothing else (norms, dropout,
//! initializers, activation configs and losses are Burn's own, re-exported), including
//! Burn's constructors of one encoder layer and of a stand-alone feed-forward block. Split
//! at TP 2 and 4 (the shared layer as Megatron splits a layer, the block column then row,
//! the vocabulary over both ends), from the record Burn's model saved, its loss and every
//! gathered gradient are Burn's model's.

use super::Error;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::tensor_parallel::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::tp_ranks;

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
    use burn_megatron::tensor_parallel::dropin::nn;
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
            let plan = TpPlan::new().encoder(&["layer"])?;
            let plan = plan
                .column(&["head.linear_inner"])?
                .row(&["head.linear_outer"])?;
            let plan = plan.vocab(&["embedding"])?.gathered_vocab(&["output"])?;
            let model = plan.apply(config.init(d), g)?;
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
