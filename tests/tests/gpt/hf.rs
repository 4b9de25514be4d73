//! Hugging Face interop against fixtures made by `transformers` (tests/fixtures/
//! make_hf_causal_lm.py; see each directory's README): a Llama with grouped-query attention
//! and Llama-3 rope scaling saved over four safetensors files, a Qwen2 with QKV biases, tied
//! embeddings and an older-style config, and a GPT-2. At TP 1 and TP 2: the logits, the
//! causal-LM loss and every parameter's gradient; export gives the checkpoint's tensors back;
//! checkpoints the model cannot represent are errors naming what.

use super::Error;
use burn::optim::GradientsParams;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::models::{
    Gpt, GptStageOutput, HfGptConfig, Positions, hf_gpt_state_dict, load_hf_gpt, save_hf_gpt,
};
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{as_gradients, fixture, read_safetensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub(super) const FIXTURES: [&str; 3] = ["hf_llama_tiny", "hf_qwen2_tiny", "hf_gpt2_tiny"];

pub(super) type Fixture = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

fn ints(
    f: &Fixture,
    name: &str,
    map: impl Fn(f64) -> i64,
    device: &burn::tensor::Device,
) -> Tensor<2, Int> {
    let (shape, v) = &f[name];
    let v: Vec<i64> = v.iter().map(|&x| map(x)).collect();
    Tensor::from_data(TensorData::new(v, [shape[0], shape[1]]), device)
}

/// What one rank computes on a fixture's batch.
pub(super) struct Outputs {
    /// `[b, s, V]`, the padding of the vocabulary cut off.
    pub(super) logits: Vec<f64>,
    pub(super) loss: f64,
    /// Every gradient under its Hugging Face name.
    pub(super) grads: Vec<(String, Vec<f64>)>,
}

/// Our causal-LM loss of `transformers`' batch: labels shifted (position j predicts label
/// j + 1), -100 and the last position masked out; keys at padding masked, as its attention
/// mask does.
fn forward(
    model: &Gpt,
    hf: &HfGptConfig,
    f: &Fixture,
    device: &burn::tensor::Device,
) -> Result<Outputs, Error> {
    forward_then(model, hf, f, device, |_| Ok(()))
}

/// [`forward`] with `finalize` applied to the gradients before they are compared (the
/// reductions of a layout whose ranks hold the same batch).
pub(super) fn forward_then(
    model: &Gpt,
    hf: &HfGptConfig,
    f: &Fixture,
    device: &burn::tensor::Device,
    finalize: impl Fn(&mut GradientsParams) -> Result<(), Error>,
) -> Result<Outputs, Error> {
    let ids = ints(f, "input_ids", |x| x as i64, device);
    let [b, s] = ids.dims();
    let padding: Tensor<2, Bool> = ints(f, "attention_mask", |x| x as i64, device).equal_elem(0);
    let shifted = |map: &dyn Fn(f64) -> f64| {
        let (_, labels) = &f["labels"];
        let v: Vec<f32> = (0..b * s)
            .map(|i| {
                if i % s + 1 < s {
                    map(labels[i + 1]) as f32
                } else {
                    map(-100.0) as f32
                }
            })
            .collect();
        Tensor::<2>::from_data(TensorData::new(v, [b, s]), device)
    };
    let labels = shifted(&|x| x.max(0.0)).int();
    let mask = shifted(&|x| f64::from(u8::from(x >= 0.0)));
    let GptStageOutput::Logits(logits) = model.forward_with(
        Some(ids),
        None,
        &Positions::default(),
        Some(padding),
        None,
        None,
    )?
    else {
        unreachable!("a whole model")
    };
    let loss = model.loss(logits.clone(), labels, mask)?;
    let full = all_gather(&**model.tp(), logits.detach(), 2)?
        .swap_dims(0, 1)
        .narrow(2, 0, hf.vocab_size);
    let value = f64::from(loss.clone().into_scalar::<f32>());
    let mut grads = GradientsParams::from_grads(loss.backward(), model);
    finalize(&mut grads)?;
    let grads = hf_gpt_state_dict(&as_gradients(model, &grads), hf)?
        .into_iter()
        .map(|(n, d)| (n, d.iter::<f32>().map(f64::from).collect()))
        .collect();
    Ok(Outputs {
        logits: full.into_data().iter::<f32>().map(f64::from).collect(),
        loss: value,
        grads,
    })
}

/// `o`'s logits within 1e-4, its loss within 1e-5 and each of `grads` (by Hugging Face
/// name) within 1e-5 (the difference's norm over the gradient's) of the fixture's, every
/// reference gradient covered; prints the margins.
pub(super) fn check_against(
    what: &str,
    o: &Outputs,
    grads: &[(String, Vec<f64>)],
    expected: &Fixture,
) {
    let d = o
        .logits
        .iter()
        .zip(&expected["logits"].1)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(d <= 1e-4, "{what}: logits differ by {d}");
    let want = expected["loss"].1[0];
    assert!(
        (o.loss - want).abs() <= 1e-5,
        "{what}: loss {} vs {want}",
        o.loss
    );
    let references = expected.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(
        grads.len(),
        references,
        "{what}: every parameter has a reference"
    );
    let mut worst = 0.0f64;
    for (param, got) in grads {
        let want = &expected[&format!("grad.{param}")].1;
        assert_eq!(got.len(), want.len(), "{what} {param}");
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let diff = norm(&mut got.iter().zip(want).map(|(a, b)| a - b));
        let scale = norm(&mut want.iter().copied());
        worst = worst.max(diff / scale.max(1e-12));
        assert!(
            diff <= 1e-5 * scale,
            "{what} {param}: ‖Δ‖ {diff:.3e} vs ‖grad‖ {scale:.3e}"
        );
    }
    println!("{what}: logits within {d:.1e}, worst relative gradient error {worst:.2e}");
}

/// A checkpoint in PyTorch's shards (`pytorch_model-0000k-of-00004.bin` and their index, as
/// `save_pretrained(safe_serialization=False)` writes them; the fixture's tensors re-saved
/// by torch, see `tests/fixtures/make_pytorch_checkpoints.py`) reads as its safetensors
/// shards do, tensor for tensor and bit for bit; a directory with neither is an error
/// naming it.
#[test]
fn pytorch_bin_shards_read_as_their_safetensors() {
    use burn_megatron::models::read_hf_tensors;
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf_llama_tiny_bin");
    let (want, got) = (
        read_hf_tensors(&fixture("hf_llama_tiny")).unwrap(),
        read_hf_tensors(&bin).unwrap(),
    );
    assert_eq!(got.len(), want.len());
    for (name, t) in &want {
        assert_eq!(got.get(name), Some(t), "{name}");
    }
    let empty = std::env::temp_dir().join(format!("bm-hf-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let e = read_hf_tensors(&empty).unwrap_err().to_string();
    assert!(
        e.contains("bm-hf-empty") && e.contains("pytorch_model.bin"),
        "{e}"
    );
    std::fs::remove_dir_all(empty).unwrap();
}

#[test]
fn transformers_logits_loss_and_gradients_are_reproduced_at_tp1_and_tp2() {
    for name in FIXTURES {
        let expected = read_safetensors(&fixture(name).join("expected.safetensors"));
        for tp in [1, 2] {
            let out = tp_ranks(tp, |ctx| {
                let device = ctx.device.clone().autodiff();
                let (model, hf) = load_hf_gpt(&fixture(name), &ctx.groups.tp, &device)?;
                forward(&model, &hf, &expected, &device)
            })
            .unwrap();
            for (rank, o) in out.iter().enumerate() {
                let what = format!("{name} tp {tp} rank {rank}");
                check_against(&what, o, &o.grads, &expected);
            }
        }
    }
}

#[test]
fn export_gives_the_checkpoints_tensors_and_config_back() {
    for name in FIXTURES {
        let dir = std::env::temp_dir().join(format!(
            "burn_megatron_gpt_export_{name}_{}",
            std::process::id()
        ));
        tp_ranks(2, |ctx| {
            let (model, hf) = load_hf_gpt(&fixture(name), &ctx.groups.tp, &ctx.device)?;
            save_hf_gpt(&model, &hf, &dir)?;
            Ok::<_, Error>(())
        })
        .unwrap();
        let original = burn_megatron::models::read_hf_tensors(&fixture(name)).unwrap();
        let exported = burn_megatron::models::read_hf_tensors(&dir).unwrap();
        let mut names: Vec<&String> = original.keys().collect();
        names.sort();
        let mut got: Vec<&String> = exported.keys().collect();
        got.sort();
        assert_eq!(got, names, "{name}: the same tensor names");
        for (n, t) in &original {
            assert_eq!(exported[n], *t, "{name}: {n} round-trips bit for bit");
        }
        let a = HfGptConfig::from_file(&fixture(name).join("config.json")).unwrap();
        let b = HfGptConfig::from_file(&dir.join("config.json")).unwrap();
        assert_eq!(
            a.to_gpt_config(1).to_string(),
            b.to_gpt_config(1).to_string(),
            "{name}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The fixture's config with `edit` applied, in a fresh directory beside its weights.
fn edited(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "burn_megatron_gpt_bad_{name}_{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
    dir
}

fn load_error(dir: &Path, tp: usize) -> String {
    let out = tp_ranks(tp, |ctx| {
        Ok::<_, Error>(
            load_hf_gpt(dir, &ctx.groups.tp, &ctx.device)
                .err()
                .map(|e| e.to_string()),
        )
    })
    .unwrap();
    out[0].clone().expect("the checkpoint must be refused")
}

#[test]
fn checkpoints_the_model_cannot_represent_are_refused_naming_what() {
    // (fixture, config edit, TP size, what the error names)
    type Case = (
        &'static str,
        Box<dyn Fn(&mut serde_json::Value)>,
        usize,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "hf_llama_tiny",
            Box::new(|v| v["model_type"] = "falcon".into()),
            1,
            "model_type \"falcon\"",
        ),
        (
            "hf_llama_tiny",
            Box::new(|v| v["rope_parameters"]["rope_type"] = "yarn".into()),
            1,
            "rope scaling type \"yarn\"",
        ),
        (
            "hf_llama_tiny",
            Box::new(|v| v["num_attention_heads"] = 8.into()),
            1,
            "q_proj",
        ),
        (
            "hf_llama_tiny",
            Box::new(|v| v["vocab_size"] = 90.into()),
            1,
            "embed_tokens",
        ),
        (
            "hf_llama_tiny",
            Box::new(|v| v["hidden_act"] = "gelu".into()),
            1,
            "hidden_act \"gelu\"",
        ),
        (
            "hf_llama_tiny",
            Box::new(|v| v["mlp_bias"] = true.into()),
            1,
            "mlp_bias true",
        ),
        (
            "hf_llama_tiny",
            Box::new(|v| v["num_key_value_heads"] = 1.into()),
            2,
            "query groups (1)",
        ),
        (
            "hf_qwen2_tiny",
            Box::new(|v| v["tie_word_embeddings"] = false.into()),
            1,
            "lm_head.weight",
        ),
        (
            "hf_gpt2_tiny",
            Box::new(|v| v["activation_function"] = "relu".into()),
            1,
            "\"relu\"",
        ),
    ];
    for (name, edit, tp, want) in cases {
        let dir = edited(name, edit);
        let e = load_error(&dir, tp);
        assert!(e.contains(want), "{name}: {e:?} should name {want:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
