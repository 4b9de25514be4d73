//! The `checkpoint` tool on a TP 2 × PP 2 checkpoint: its index printed, and its weights
//! converted to Hugging Face's `BertForPreTraining`, whose model (read back by the importer
//! that is tested against `transformers`) computes the checkpoint's logits.

mod common;

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_megatron::comm::LocalWorld;
use burn_megatron::models::load_hf_bert;
use burn_megatron_examples::checkpoint_tool::{inspect, load_whole, to_hf};
use burn_megatron_examples::pretrain::run;
use common::{args, tmp};
use std::sync::Arc;

#[test]
fn a_checkpoint_is_inspected_and_converted_to_hugging_face() {
    let dir = tmp("ckpt-tool");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let flags = [
        "--pipeline-model-parallel-size",
        "2",
        "--world-size",
        "4",
        "--num-layers",
        "4",
        "--train-iters",
        "6",
        "--eval-interval",
        "0",
        "--use-fused-adam",
        "--save",
        s,
    ];
    run(&args(&flags, &dir)).unwrap();

    let text = inspect(&save, None).unwrap();
    for expected in [
        "(iteration 6)",
        "saved at TP 2 × PP 2 (V 1) × DP 1",
        "the fused Adam after 6 steps",
        "layers.3.mlp",
        "embeddings.word_embeddings.weight",
        "[256, 32]",
        "model, master, exp_avg, exp_avg_sq",
        "4 rank directories",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
    assert!(
        inspect(&save, Some(3))
            .unwrap_err()
            .contains("iter_0000003")
    );

    let hf = dir.join("hf");
    to_hf(&save, None, &hf).unwrap();
    let (ours, config) = load_whole(&save, None).unwrap();
    let device = Device::flex();
    let solo = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
    let (theirs, hf_config) = load_hf_bert(&hf, &(solo as _), &device).unwrap();
    assert_eq!(hf_config.num_hidden_layers, config.num_layers);
    let (b, seq) = (2, 16);
    let ids: Vec<i64> = (0..b * seq).map(|i| (i * 37 % 191) as i64).collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, seq]), &device);
    let types = ids.clone().zeros_like();
    let padding =
        Tensor::<2, Bool>::from_data(TensorData::new(vec![false; b * seq], [b, seq]), &device);
    let a = ours.forward(ids.clone(), types.clone(), padding.clone(), None);
    let h = theirs.forward(ids, types, padding, None);
    // The real vocabulary's logits (HF has no padded rows) and the binary head's.
    let vocab = hf_config.vocab_size;
    let real = |t: Tensor<3>| {
        t.narrow(2, 0, vocab)
            .into_data()
            .iter::<f32>()
            .collect::<Vec<_>>()
    };
    let (x, y) = (real(a.lm_logits), real(h.lm_logits));
    let worst = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "MLM logits differ by {worst}");
    let bin = |t: Tensor<2>| t.into_data().iter::<f32>().collect::<Vec<_>>();
    let (p, q) = (bin(a.binary_logits), bin(h.binary_logits));
    assert_eq!(p.len(), 4);
    assert!(
        p.iter().zip(&q).all(|(u, v)| (u - v).abs() < 1e-4),
        "{p:?} vs {q:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
