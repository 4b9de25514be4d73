//! The `checkpoint` tool on TP 2 × PP 2 checkpoints: a BERT's index printed, and its weights
//! converted to Hugging Face's `BertForPreTraining`; a Llama-style and a GPT-2-style GPT's
//! converted to `LlamaForCausalLM` / `GPT2LMHeadModel`. Each Hugging Face model (read back by
//! the importers that are tested against `transformers`) computes the checkpoint's logits, and
//! the GPTs' checkpoints loaded into pipeline stages generate the whole model's tokens.

use crate::common::{LLAMA_STYLE, args, tmp};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_megatron::comm::LocalWorld;
use burn_megatron::data::GptTokenizer;
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{
    Bert, GenerateConfig, Gpt, generate, generate_stages, load_hf_bert, load_hf_gpt,
};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_examples::checkpoint_tool::{
    inspect, load_rank_stages, load_whole, resolve_iteration, to_hf,
};
use burn_megatron_examples::pretrain::{GptArgs, run, run_gpt};
use clap::Parser;
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
    let (ours, config) = load_whole::<Bert>(&save, None).unwrap();
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

/// Trains a tiny GPT with `gpt_pretrain` (`flags` on top of a small shape), converts its
/// checkpoint with `to-hf`, and checks that the Hugging Face directory, read back by
/// `load_hf_gpt` at TP 1, computes the logits of the checkpoint's whole model.
fn gpt_round_trip(name: &str, flags: &[&str], architecture: &str) {
    let dir = tmp(name);
    let save = dir.join("ckpt");
    let plot = dir.join("loss.png");
    let mut argv = vec![
        "gpt_pretrain",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "4",
        "--init-method-std",
        "0.2",
        "--synthetic-documents",
        "300",
        "--vocab-size",
        "300",
        "--eval-interval",
        "0",
        "--no-progress",
        "--generate-tokens",
        "0",
        "--loss-plot",
        plot.to_str().unwrap(),
        "--save",
        save.to_str().unwrap(),
    ];
    argv.extend_from_slice(flags);
    run_gpt(&GptArgs::try_parse_from(argv).unwrap()).unwrap();

    let hf = dir.join("hf");
    assert_eq!(to_hf(&save, None, &hf).unwrap(), architecture);
    let tokenizer = GptTokenizer::from_file(&hf.join("tokenizer.json")).unwrap();
    let (ours, config) = load_whole::<Gpt>(&save, None).unwrap();
    let device = Device::flex();
    let solo = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
    let (theirs, hf_config) = load_hf_gpt(&hf, &(solo as _), &device).unwrap();
    assert_eq!(hf_config.num_hidden_layers, config.num_layers);
    assert_eq!(hf_config.eos_token_id, vec![tokenizer.eod]);
    assert_eq!(hf_config.bos_token_id, Some(tokenizer.eod));
    let vocab = tokenizer.vocab_size();
    assert_eq!(hf_config.vocab_size, vocab);
    let (b, seq) = (2, 16);
    let ids: Vec<i64> = (0..b * seq).map(|i| (i * 37 % vocab) as i64).collect();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, seq]), &device);
    // The real vocabulary's logits: the two models pad it differently (TP 2 and TP 1).
    let real = |t: Tensor<3>| {
        t.narrow(2, 0, vocab)
            .into_data()
            .iter::<f32>()
            .collect::<Vec<_>>()
    };
    let x = real(ours.forward(ids.clone()).unwrap());
    let y = real(theirs.forward(ids).unwrap());
    let worst = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.1, "logits too small to compare: {scale}");
    assert!(worst <= 1e-6, "logits differ by {worst}");
    // Loaded into pipeline stages (PP 2, and TP 2 × PP 2), the checkpoint generates the
    // whole model's greedy tokens.
    let prompts = vec![vec![5, 6, 7], vec![9, 10]];
    let generate_config = GenerateConfig::new(8);
    let whole = generate(&ours, &prompts, &generate_config).unwrap().tokens;
    let iteration = resolve_iteration(&save, None).unwrap();
    for (tp, pp) in [(1, 2), (2, 2)] {
        let layout = ParallelConfig::new(tp * pp, tp, pp);
        let options = LaunchOptions::default().with_device(|_| Device::flex());
        let staged = threads(&layout, options, |ctx| {
            let chunks = load_rank_stages::<Gpt>(&save, iteration, &config, &ctx)?;
            generate_stages(&chunks, &ctx.groups.pp, &prompts, &generate_config)
                .map(|g| g.tokens)
                .map_err(|e| e.to_string())
        })
        .unwrap();
        for (rank, tokens) in staged.iter().enumerate() {
            assert_eq!(tokens, &whole, "TP {tp} × PP {pp} rank {rank}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_llama_style_checkpoint_at_tp2_pp2_converts_to_hugging_face() {
    let layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--world-size",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
    ];
    let flags = [&layout[..], LLAMA_STYLE].concat();
    gpt_round_trip("gpt-llama-to-hf", &flags, "LlamaForCausalLM");
}

#[test]
fn a_gpt2_style_checkpoint_at_tp2_converts_to_hugging_face() {
    let flags = ["--tensor-model-parallel-size", "2", "--world-size", "2"];
    gpt_round_trip("gpt2-to-hf", &flags, "GPT2LMHeadModel");
}

/// Experts saved at EP 2 load whole (their global names) and convert to Mixtral.
#[test]
fn a_mixtral_style_checkpoint_at_ep2_converts_to_hugging_face() {
    let experts = [
        "--tensor-model-parallel-size",
        "1",
        "--world-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
    ];
    let flags = [&experts[..], LLAMA_STYLE].concat();
    gpt_round_trip("gpt-mixtral-to-hf", &flags, "MixtralForCausalLM");
}
