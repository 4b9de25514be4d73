//! Burn's `text-generation` example's model with GPT-2's vocabulary (50257 tokens, which no
//! TP size splits), made tensor-parallel by its imports and a plan: the encoder split as
//! Megatron splits a layer, the token embeddings by vocabulary, the output layer over the
//! vocabulary with its logits gathered (so Burn's own loss with its padding token is
//! unchanged), the vocabulary padded as Megatron pads it. At TP 2 and 4, from the record
//! Burn's model saved, the loss and every gathered gradient are Burn's model's.

use super::Error;
use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron_tests::tp_ranks;

/// The model under Burn's own layers.
mod plain {
    use burn::config::Config;
    use burn::module::Module;
    use burn::nn::attention::generate_autoregressive_mask;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::nn::transformer::{
        TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
    };
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    use burn::tensor::{Bool, Device, Int, Tensor};
    include!("text_generation_model.rs");
}

/// The same model under the drop-in layers.
mod parallel {
    use burn::config::Config;
    use burn::module::Module;
    use burn::nn::attention::generate_autoregressive_mask;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::tensor::{Bool, Device, Int, Tensor};
    use burn_megatron::dropin::nn::transformer::{
        TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
    };
    use burn_megatron::dropin::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
    include!("text_generation_model.rs");
}

/// GPT-2's vocabulary, and its end-of-text token as the padding token.
const VOCAB: usize = 50257;
const PAD: usize = 50256;
const B: usize = 2;
const S: usize = 8;

/// Token ids spread over the whole vocabulary (the last rows included), the second sample
/// padded after 5 tokens.
fn batch(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>, Tensor<2, Bool>) {
    let ids: Vec<i64> = (0..B * (S + 1))
        .map(|i| match (i / (S + 1), i % (S + 1)) {
            (1, t) if t >= 5 => PAD as i64,
            _ => ((i * 7919 + 50249) % VOCAB) as i64,
        })
        .collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [B, S + 1]), device);
    let inputs = ids.clone().narrow(1, 0, S);
    let mask_pad = inputs.clone().equal_elem(PAD as i64);
    (inputs, ids.narrow(1, 1, S), mask_pad)
}

/// The configs of both, as Burn's example sizes them but small (no dropout, for parity).
fn config() -> (
    plain::TextGenerationModelConfig,
    parallel::TextGenerationModelConfig,
) {
    use burn_megatron::dropin::nn::transformer as dropin;
    let plain = burn::nn::transformer::TransformerEncoderConfig::new(32, 64, 4, 2)
        .with_dropout(0.0)
        .with_norm_first(true);
    let ours = dropin::TransformerEncoderConfig::new(32, 64, 4, 2)
        .with_dropout(0.0)
        .with_norm_first(true);
    (
        plain::TextGenerationModelConfig::new(plain, VOCAB, PAD, S),
        parallel::TextGenerationModelConfig::new(ours, VOCAB, PAD, S),
    )
}

#[test]
fn burns_text_generation_model_with_gpt2s_vocabulary_trains_as_burns_at_tp_2_and_4()
-> Result<(), Error> {
    let dir = super::load::scratch("text-generation");
    let record = dir.join("model.bpk");
    let (plain_config, config) = config();
    let device = Device::flex();
    device.seed(17);
    plain_config.init(&device).save_file(&record)?;
    let ad = Device::flex().autodiff();
    let plain = plain_config.init(&ad).load_file(&record);
    let (inputs, targets, mask_pad) = batch(&ad);
    let loss = plain.forward_training(inputs, targets, mask_pad);
    let (value, grads) = super::loss_and_grads(&plain, loss, &super::solo());
    let source = RecordSource::from_path(&record);
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let plan = TpPlan::new()
                .encoder(&["transformer"])?
                .vocab(&["embedding_token"])?;
            let plan = plan
                .gathered_vocab(&["output"])?
                .make_vocab_size_divisible_by(128)?;
            let model = plan.apply(config.init(d), g)?;
            let (model, _) = load_sharded(model, &source, g, &LoadOptions::default())?;
            let (inputs, targets, mask_pad) = batch(d);
            let loss = model.forward_training(inputs, targets, mask_pad);
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
