//! Hugging Face interop: a `BertForPreTraining` checkpoint made by the transformers
//! library (tests/fixtures/hf_bert_tiny, see its README) loads at TP 1 and TP 2 and gives
//! transformers' logits, losses and gradients of every parameter; export → import gives
//! identical tensors.

use burn::tensor::{Bool, Int, Tensor, TensorData};
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::models::{HfError, hf_bert_state_dict, load_hf_bert, save_hf_bert};
use burn_megatron_tests::read_safetensors as read;
use burn_megatron_tests::tp_ranks;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf_bert_tiny")
}

/// The same checkpoint as `pytorch_model.bin` (torch's container; see
/// `tests/fixtures/make_pytorch_checkpoints.py`).
fn fixture_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf_bert_tiny_bin")
}

/// (prediction logits [b, s, 100], seq-relationship logits [b, 2]) at tensor-parallel `tp`.
fn logits_at(tp: usize) -> Vec<(Vec<f64>, Vec<f64>)> {
    logits_of(&fixture(), tp)
}

/// [`logits_at`] of the checkpoint in `dir`.
fn logits_of(dir: &Path, tp: usize) -> Vec<(Vec<f64>, Vec<f64>)> {
    let expected = read(&fixture().join("expected.safetensors"));
    tp_ranks(tp, |ctx| {
        let (model, hf) = load_hf_bert(dir, &ctx.groups.tp, &ctx.device)?;
        let ints = |name: &str| {
            let (shape, v) = &expected[name];
            let v: Vec<i64> = v.iter().map(|x| *x as i64).collect();
            Tensor::<2, Int>::from_data(TensorData::new(v, [shape[0], shape[1]]), &ctx.device)
        };
        let padding: Tensor<2, Bool> = ints("attention_mask").equal_elem(0);
        let out = model.forward(ints("input_ids"), ints("token_type_ids"), padding, None);
        let lm = all_gather(&*ctx.groups.tp, out.lm_logits, 2)?.swap_dims(0, 1);
        let lm = lm.narrow(2, 0, hf.vocab_size);
        let lm: Vec<f64> = lm.into_data().iter::<f32>().map(f64::from).collect();
        let nsp: Vec<f64> = out
            .binary_logits
            .into_data()
            .iter::<f32>()
            .map(f64::from)
            .collect();
        Ok::<_, HfError>((lm, nsp))
    })
    .unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn transformers_logits_are_reproduced_at_tp1_and_tp2() {
    let expected = read(&fixture().join("expected.safetensors"));
    let lm_ref = &expected["prediction_logits"].1;
    let nsp_ref = &expected["seq_relationship_logits"].1;
    let one = logits_at(1).remove(0);
    for (tp, results) in [(1, vec![one.clone()]), (2, logits_at(2))] {
        for (rank, (lm, nsp)) in results.iter().enumerate() {
            let (d_lm, d_nsp) = (max_diff(lm, lm_ref), max_diff(nsp, nsp_ref));
            println!(
                "tp {tp} rank {rank}: max abs diff to transformers: logits {d_lm:.2e}, nsp {d_nsp:.2e}"
            );
            assert!(
                d_lm < 1e-4 && d_nsp < 1e-4,
                "tp {tp} rank {rank}: {d_lm} {d_nsp}"
            );
            // TP 2 against TP 1: the same computation split, up to summation order.
            assert!(max_diff(lm, &one.0) < 1e-5, "tp {tp} rank {rank} vs tp 1");
        }
    }
    // The checkpoint as `pytorch_model.bin` gives the same values, bit for bit.
    assert_eq!(logits_of(&fixture_bin(), 2), logits_at(2));
}

#[test]
fn export_then_import_round_trips_every_tensor() {
    let original = read(&fixture().join("model.safetensors"));
    let out = std::env::temp_dir().join(format!("bm-hf-export-{}", std::process::id()));
    // Load at TP 2, export (gathering the shards), re-import at TP 1 and export again.
    tp_ranks(2, |ctx| {
        let (model, hf) = load_hf_bert(&fixture(), &ctx.groups.tp, &ctx.device)?;
        save_hf_bert(&model, &hf, &out)
    })
    .unwrap();
    assert_eq!(
        read(&out.join("model.safetensors")),
        original,
        "TP 2 export"
    );
    let again = tp_ranks(1, |ctx| {
        let (model, hf) = load_hf_bert(&out, &ctx.groups.tp, &ctx.device)?;
        hf_bert_state_dict(&model, hf.vocab_size, &ctx.groups.tp)
    })
    .unwrap()
    .remove(0);
    assert_eq!(again.len(), original.len());
    for (name, data) in again {
        let values: Vec<f64> = data.iter::<f32>().map(f64::from).collect();
        assert_eq!((data.shape().to_vec(), values), original[&name], "{name}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn missing_and_misshapen_tensors_are_reported() {
    let dir = std::env::temp_dir().join(format!("bm-hf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).unwrap();
    let mut tensors = read(&fixture().join("model.safetensors"));
    tensors.remove("bert.encoder.layer.1.attention.self.key.weight");
    let write = |t: &BTreeMap<String, (Vec<usize>, Vec<f64>)>| {
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = t
            .iter()
            .map(|(n, (s, v))| {
                let b = v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect();
                (n.clone(), b, s.clone())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
            .iter()
            .map(|(n, b, s)| {
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
                (n.clone(), view.unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    };
    write(&tensors);
    let load = || {
        tp_ranks(1, |ctx| {
            load_hf_bert(&dir, &ctx.groups.tp, &ctx.device).map(|_| ())
        })
        .unwrap_err()
        .to_string()
    };
    let e = load();
    assert!(
        e.contains("missing tensor bert.encoder.layer.1.attention.self.key.weight"),
        "{e}"
    );
    let mut tensors = read(&fixture().join("model.safetensors"));
    tensors.insert(
        "bert.pooler.dense.weight".into(),
        (vec![16, 32], vec![0.0; 512]),
    );
    write(&tensors);
    let e = load();
    assert!(
        e.contains("bert.pooler.dense.weight") && e.contains("32×32"),
        "{e}"
    );
    // A key of another shape than its query: an error naming the three, not an index out of
    // range while interleaving the heads.
    let mut tensors = read(&fixture().join("model.safetensors"));
    tensors.insert(
        "bert.encoder.layer.0.attention.self.key.weight".into(),
        (vec![16, 32], vec![0.0; 512]),
    );
    write(&tensors);
    let e = load();
    assert!(
        e.contains("bert.encoder.layer.0.attention.self")
            && e.contains("query 32×32, key 16×32 and value 32×32 must have one shape"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Backward against an independent reference: `transformers`' gradients of lm + sop loss for
/// every parameter (tests/fixtures/make_hf_bert_grads.py, same inputs and labels), at TP 1
/// and gathered from TP 2. Per tensor ‖ours − theirs‖ ≤ 1e-4·‖theirs‖, plus 1e-6 for the
/// key biases, whose gradient is zero in exact arithmetic (softmax ignores a shift shared by
/// every key) and float noise of ~1e-8 in both.
#[test]
fn transformers_gradients_are_reproduced_at_tp1_and_tp2() {
    let reference = read(&fixture().join("gradients.safetensors"));
    let expected = read(&fixture().join("expected.safetensors"));
    for tp in [1, 2] {
        let out = tp_ranks(tp, |ctx| {
            let (model, hf) = load_hf_bert(&fixture(), &ctx.groups.tp, &ctx.device)?;
            let ints = |values: &[f64], shape: &[usize]| {
                let v: Vec<i64> = values.iter().map(|x| *x as i64).collect();
                TensorData::new(v, shape.to_vec())
            };
            let two = |name: &str, map: &dyn Fn(f64) -> f64| {
                let (shape, v) = &reference.get(name).or(expected.get(name)).unwrap();
                let v: Vec<f64> = v.iter().map(|x| map(*x)).collect();
                Tensor::<2, Int>::from_data(ints(&v, shape), &ctx.device)
            };
            let id = |x: f64| x;
            let padding: Tensor<2, Bool> = two("attention_mask", &id).equal_elem(0);
            // -100 marks unlabelled positions: label 0 there, masked out of the loss.
            let labels = two("mlm_labels", &|x| x.max(0.0));
            let mask = two("mlm_labels", &|x| f64::from(u8::from(x >= 0.0))).float();
            let (shape, v) = &reference["sop_labels"];
            let sop = Tensor::<1, Int>::from_data(ints(v, shape), &ctx.device);
            let out = model.forward(
                two("input_ids", &id),
                two("token_type_ids", &id),
                padding,
                None,
            );
            let (lm, so) = model.loss(out, labels, mask, sop)?;
            let losses = [lm.clone(), so.clone()].map(|l| f64::from(l.into_scalar::<f32>()));
            let grads = burn::optim::GradientsParams::from_grads((lm + so).backward(), &model);
            let as_grads = burn_megatron_tests::as_gradients(&model, &grads);
            let named = hf_bert_state_dict(&as_grads, hf.vocab_size, &ctx.groups.tp)?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((losses, named))
        })
        .unwrap();
        for (rank, (losses, named)) in out.iter().enumerate() {
            let what = format!("tp {tp} rank {rank}");
            for (i, name) in ["lm_loss", "sop_loss"].into_iter().enumerate() {
                let want = reference[name].1[0];
                assert!(
                    (losses[i] - want).abs() < 1e-5,
                    "{what} {name}: {} vs {want}",
                    losses[i]
                );
            }
            let names: Vec<&str> = reference
                .keys()
                .filter_map(|k| k.strip_prefix("grad."))
                .collect();
            assert_eq!(
                names.len(),
                named.len(),
                "{what}: every parameter has a reference"
            );
            let mut worst = 0.0f64;
            for (name, data) in named {
                let (_, want) = &reference[&format!("grad.{name}")];
                let got: Vec<f64> = data.iter::<f32>().map(f64::from).collect();
                assert_eq!(got.len(), want.len(), "{what} {name}");
                let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
                let diff = norm(&mut got.iter().zip(want).map(|(a, b)| a - b));
                let scale = norm(&mut want.iter().copied());
                assert!(
                    diff <= 1e-4 * scale + 1e-6,
                    "{what} {name}: ‖Δ‖ {diff:.3e} vs ‖grad‖ {scale:.3e}"
                );
                if scale > 1e-6 {
                    worst = worst.max(diff / scale);
                }
            }
            println!("{what}: worst relative gradient error {worst:.2e}");
        }
    }
}
