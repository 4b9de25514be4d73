//! A Hugging Face BERT checkpoint in the user's BERT: the bert-burn-style masked-LM of
//! `examples/examples/tp_bert_dropin` (Burn's `TransformerEncoder`), made tensor-parallel by
//! its imports, compiled here from the example's own files. At TP 1, 2 and 4 against
//! `transformers` (`tests/fixtures/hf_bert_tiny`: a `BertForPreTraining`, its decoder tied to
//! the word embeddings, two segments, a padded sample, 100 tokens padded at TP 2 and 4): the
//! prediction logits at every position, the masked-LM loss, and the prediction head's
//! gradients.

#[allow(dead_code)]
#[path = "../../../examples/examples/tp_bert_dropin/bert.rs"]
mod bert;
#[allow(dead_code)]
#[path = "../../../examples/examples/tp_bert_dropin/hf.rs"]
mod hf;
#[allow(dead_code)]
#[path = "../../../examples/examples/tp_bert_dropin/parallel.rs"]
mod parallel;

use super::Error;
use super::hf_llama::{grads_checkpoint, worst_gradient};
use super::load::scratch;
use bert::{BertConfig, masked};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::{fixture, read_safetensors, tp_ranks, values};
use std::collections::BTreeMap;

type Fixture = BTreeMap<String, (Vec<usize>, Vec<f64>)>;
type Values = BTreeMap<String, Vec<f32>>;

/// The prediction head's parameters: only the masked-LM loss reaches them (the fixture's
/// gradients are of it and the sentence-order loss, which also reaches the encoder and the
/// embeddings).
const HEAD: [&str; 5] = [
    "lm_head.dense.weight",
    "lm_head.dense.bias",
    "lm_head.layer_norm.gamma",
    "lm_head.layer_norm.beta",
    "lm_head.decoder.bias",
];

fn ints(f: &Fixture, name: &str, device: &burn::tensor::Device) -> Tensor<2, Int> {
    let (shape, v) = &f[name];
    let v: Vec<i64> = v.iter().map(|x| *x as i64).collect();
    Tensor::from_data(TensorData::new(v, [shape[0], shape[1]]), device)
}

#[test]
fn a_hugging_face_bert_in_the_users_bert_gives_transformers_numbers() -> Result<(), Error> {
    let dir = fixture("hf_bert_tiny");
    let checkpoint = hf::Checkpoint::open(&dir)?;
    let c = &checkpoint.config;
    let expected = read_safetensors(&dir.join("expected.safetensors"));
    let gradients = read_safetensors(&dir.join("gradients.safetensors"));
    let scratch = scratch("hf-bert");
    let grads_path = grads_checkpoint(&gradients, &scratch);
    let reference = checkpoint.options()?;
    let (_, labels) = &gradients["mlm_labels"];
    let at: Vec<i64> = (0..labels.len() as i64)
        .filter(|&i| labels[i as usize] >= 0.0)
        .collect();
    let targets: Vec<i64> = at.iter().map(|&i| labels[i as usize] as i64).collect();
    let want_loss = gradients["lm_loss"].1[0];
    for tp in [1, 2, 4] {
        let ranks = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = checkpoint.load(g, d)?;
            let (tokens, types) = (
                ints(&expected, "input_ids", d),
                ints(&expected, "token_type_ids", d),
            );
            let pad = ints(&expected, "attention_mask", d).equal_elem(0);
            let logits = model.forward(tokens, types, pad);
            let n = at.len();
            let positions = Tensor::from_data(TensorData::new(at.clone(), [n]), d);
            let labels = Tensor::from_data(TensorData::new(targets.clone(), [n]), d);
            let loss = CrossEntropyLossConfig::new()
                .init(d)
                .forward(masked(logits.clone(), positions), labels);
            let value = loss.clone().into_scalar::<f32>();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let want = parallel::BertMaskedLm::load(c, &grads_path, &reference, g, d)?;
            let head = |v: Values| -> Values {
                (v.into_iter())
                    .filter(|(path, _)| HEAD.contains(&path.as_str()))
                    .collect()
            };
            Ok::<_, Error>((
                values(logits),
                value,
                head(gathered(&model, Some(&grads), g)),
                head(gathered(&want, None, g)),
            ))
        })?;
        for (rank, (logits, loss, grads, want)) in ranks.into_iter().enumerate() {
            let what = format!("TP {tp}, rank {rank}");
            let want_logits: Vec<f32> = (expected["prediction_logits"].1.iter())
                .map(|x| *x as f32)
                .collect();
            let d = super::max_abs_diff(&logits, &want_logits);
            assert!(d <= 1e-4, "{what}: logits off by {d}");
            let dl = (f64::from(loss) - want_loss).abs();
            assert!(dl <= 1e-5, "{what}: loss {loss} vs {want_loss}");
            assert_eq!(want.len(), HEAD.len(), "{what}: the head's gradients");
            let (worst, param) = worst_gradient(&grads, &want);
            assert!(
                worst <= 1e-5,
                "{what}: {param}'s gradient off by {worst:.2e} relative"
            );
            println!("{what}: logits within {d:.1e}, loss within {dl:.1e}");
        }
    }
    std::fs::remove_dir_all(scratch)?;
    Ok(())
}

/// The way back: the BERT loaded at TP 2 and written with `save_safetensors` through the
/// example's `save_options` holds, bit for bit and under the same names, every tensor of the
/// checkpoint `transformers` wrote but the pooler and the sentence-order head, which this
/// model has not (`BertForMaskedLM`'s layout); the tied decoder is left out, as there.
#[test]
fn the_users_bert_writes_back_the_hugging_face_checkpoint_it_read() -> Result<(), Error> {
    let checkpoint = hf::Checkpoint::open(&fixture("hf_bert_tiny"))?;
    let out = scratch("hf-bert-save");
    tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let model = checkpoint.load(g, d)?;
        checkpoint.save(&model, &out, g)
    })?;
    let mut want = read_safetensors(&fixture("hf_bert_tiny").join("model.safetensors"));
    want.retain(|k, _| !k.starts_with("bert.pooler.") && !k.starts_with("cls.seq_relationship."));
    let got = read_safetensors(&out.join("model.safetensors"));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, w) in &want {
        assert!(got[k] == *w, "{k} differs");
    }
    std::fs::remove_dir_all(out)?;
    Ok(())
}

/// What the BERT cannot hold is refused before anything loads, naming the setting.
#[test]
fn a_checkpoint_the_users_bert_cannot_hold_is_an_error_naming_the_setting() -> Result<(), Error> {
    let fixture = fixture("hf_bert_tiny");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json"))?)?;
    let dir = scratch("hf-bert-config");
    for (key, value) in [
        ("model_type", serde_json::json!("roberta")),
        ("hidden_act", serde_json::json!("gelu_new")),
        ("position_embedding_type", serde_json::json!("relative_key")),
        ("is_decoder", serde_json::json!(true)),
        ("add_cross_attention", serde_json::json!(true)),
    ] {
        let mut json = base.clone();
        json[key] = value;
        std::fs::write(dir.join("config.json"), json.to_string())?;
        let e = hf::Checkpoint::open(&dir).err().expect("refused");
        assert!(e.contains(key), "{key}: {e}");
    }
    // Read where given, transformers' defaults where not.
    let mut json = base.clone();
    json["layer_norm_eps"] = serde_json::json!(1e-5);
    json["hidden_act"] = serde_json::json!("gelu_python");
    json.as_object_mut()
        .map(|o| o.remove("tie_word_embeddings"));
    std::fs::write(dir.join("config.json"), json.to_string())?;
    let read = hf::Checkpoint::open(&dir)?;
    let config: BertConfig = read.config;
    assert!(config.layer_norm_eps == 1e-5 && read.tie_word_embeddings);
    json.as_object_mut().map(|o| o.remove("layer_norm_eps"));
    std::fs::write(dir.join("config.json"), json.to_string())?;
    assert_eq!(hf::Checkpoint::open(&dir)?.config.layer_norm_eps, 1e-12);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
