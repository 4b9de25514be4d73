//! `gpt_pretrain` with the ecosystem around it: Megatron's indexed datasets written,
//! inspected and trained on; burn-train's Learner driving the same training; context
//! parallelism against the unsplit run.

use super::mean;
use crate::common::{assert_same_iterations, gpt_args as args, tmp};
use burn_megatron_examples::pretrain::run_gpt;
use std::path::Path;

/// Megatron data end to end: `preprocess_data` writes a JSONL corpus as an indexed dataset
/// (every document's tokens are its text's, with the end-of-document token), `dataset
/// samples` prints what a run reads, `gpt_pretrain --data-path PREFIX` trains on it with a
/// falling loss, `bert_pretrain` trains on a sentence-split one, and a truncated `.bin` is
/// refused naming the file.
#[test]
fn megatron_datasets_are_written_inspected_and_trained_on() {
    use burn_megatron::data::megatron::IndexedDataset;
    use burn_megatron::data::{
        BertTokenizer, GptTokenizer, synthetic_corpus, synthetic_vocabulary,
    };
    use burn_megatron_examples::dataset_tool::{DatasetCli, DatasetCommand, samples};
    use burn_megatron_examples::preprocess::{PreprocessArgs, preprocess};
    use clap::Parser;

    let dir = tmp("megatron-data");
    let docs = synthetic_corpus(300, 5);
    let texts: Vec<String> = docs.iter().map(|d| d.join(" ")).collect();
    let jsonl: String = texts
        .iter()
        .map(|t| format!("{}\n", serde_json::json!({ "text": t, "id": 1 })))
        .collect();
    std::fs::write(dir.join("corpus.jsonl"), jsonl).unwrap();
    let tokenizer = GptTokenizer::train(&docs, 600).unwrap();
    let tok = dir.join("tokenizer.json");
    tokenizer.save(&tok).unwrap();
    let (input, prefix) = (dir.join("corpus.jsonl"), dir.join("corpus"));
    let pre = |extra: &[&str], tok: &Path| {
        let mut argv = vec!["preprocess_data", "--input", input.to_str().unwrap()];
        argv.extend(["--tokenizer-model", tok.to_str().unwrap(), "--quiet"]);
        argv.extend([
            "--output-prefix",
            prefix.to_str().unwrap(),
            "--workers",
            "2",
        ]);
        argv.extend(extra);
        preprocess(&PreprocessArgs::try_parse_from(argv).unwrap()).unwrap()
    };
    let written = pre(&["--append-eod"], &tok);
    assert_eq!((written[0].documents, &written[0].key[..]), (300, "text"));
    let gpt_prefix = format!("{}_text_document", prefix.display());
    let data = IndexedDataset::open(&gpt_prefix).unwrap();
    assert_eq!((data.num_documents(), data.len()), (300, 300));
    for (d, text) in texts.iter().enumerate() {
        let mut want: Vec<i64> = tokenizer
            .encode(text)
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect();
        want.push(i64::from(tokenizer.eod));
        assert_eq!(data.get(d, 0, None).unwrap(), want, "document {d}");
    }
    let cache = dir.join("cache");
    let cli = DatasetCli::try_parse_from([
        "dataset",
        "samples",
        "--data-path",
        &gpt_prefix,
        "--seq-length",
        "32",
        "--train-samples",
        "16",
        "--valid-samples",
        "4",
        "--json",
        "--data-cache-path",
        cache.to_str().unwrap(),
    ])
    .unwrap();
    let DatasetCommand::Samples(a) = &cli.command else {
        unreachable!()
    };
    let printed: serde_json::Value = serde_json::from_str(&samples(a).unwrap()).unwrap();
    assert_eq!(printed["train"].as_array().unwrap().len(), 16);
    assert!(
        printed["valid"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s.as_array().unwrap().len() == 33)
    );

    let flags = [
        "--data-path",
        &gpt_prefix,
        "--tokenizer-model",
        tok.to_str().unwrap(),
        "--data-cache-path",
        cache.to_str().unwrap(),
        "--generate-tokens",
        "0",
    ];
    let log = run_gpt(&args(&flags, &dir)).unwrap().log;
    let (first, last) = (
        mean(log[..5].iter().map(|e| e.lm_loss)),
        mean(log[35..].iter().map(|e| e.lm_loss)),
    );
    assert!(
        last < first - 1.0,
        "lm loss must fall on Megatron data: {first} → {last}"
    );

    // BERT: sentences as sequences, documents as documents.
    let vocab = dir.join("bert.json");
    BertTokenizer::from_vocab(synthetic_vocabulary())
        .unwrap()
        .save(&vocab)
        .unwrap();
    pre(
        &[
            "--split-sentences",
            "--tokenizer-type",
            "BertWordPieceLowerCase",
        ],
        &vocab,
    );
    let bert_prefix = format!("{}_text_sentence", prefix.display());
    let sentences = IndexedDataset::open(&bert_prefix).unwrap();
    assert_eq!(sentences.num_documents(), 300);
    assert!(sentences.len() > 3 * 300, "{} sentences", sentences.len());
    let bert = crate::common::args(
        &[
            "--data-path",
            &bert_prefix,
            "--vocab-file",
            vocab.to_str().unwrap(),
            "--train-iters",
            "20",
        ],
        &dir,
    );
    let log = burn_megatron_examples::pretrain::run(&bert).unwrap().log;
    assert!(
        log.last().unwrap().lm_loss < log[0].lm_loss - 0.5,
        "BERT lm loss must fall"
    );

    let bin = format!("{gpt_prefix}.bin");
    let bytes = std::fs::read(&bin).unwrap();
    std::fs::write(&bin, &bytes[..bytes.len() - 10]).unwrap();
    let err = run_gpt(&args(&flags, &dir)).unwrap_err();
    assert!(
        err.contains("corpus_text_document.bin") && err.contains("truncated"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// burn-train's Learner drives the same training as our loop: at TP 2 × DP 2 (and with
/// the overlapped reducer and the distributed optimizer) every iteration's learning rate,
/// loss and gradient norm, every validation, and the samples generated at the end equal
/// `gpt_pretrain`'s bit for bit.
#[test]
fn the_burn_train_learner_trains_to_our_loops_losses() {
    use burn_megatron_examples::pretrain::{LearnerOptions, Renderer, run_gpt_learner};
    let dir = tmp("learner");
    let options = LearnerOptions {
        artifact_dir: dir.join("artifacts"),
        renderer: Renderer::None,
    };
    let layouts: [&[&str]; 2] = [
        &[],
        &["--overlap-grad-reduce", "--use-distributed-optimizer"],
    ];
    for extra in layouts {
        let common: &[&str] = &["--world-size", "4", "--train-iters", "20"];
        let more: &[&str] = &["--eval-interval", "10", "--generate-tokens", "4"];
        let flags = [common, more, extra].concat();
        let ours = run_gpt(&args(&flags, &dir)).unwrap();
        let theirs = run_gpt_learner(&args(&flags, &dir), &options).unwrap();
        assert_same_iterations(&ours.log, &theirs.log);
        assert_eq!(ours.evals, theirs.evals, "{extra:?}: validations");
        assert_eq!(theirs.evals.len(), 2);
        assert!(!ours.said.is_empty(), "{extra:?}: samples");
        assert_eq!(ours.said, theirs.said, "{extra:?}: samples");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `gpt_pretrain --context-parallel-size`: CP 2 (also with full and selective
/// recomputation, whose replay gathers K and V again), TP 2 × CP 2 with SP, CP 2 × PP 2
/// (1F1B) and CP 2 × DP 2 with the distributed optimizer and the overlapped reducer train
/// as the unsplit run does (dropout off): every iteration's loss and grad norm within
/// 1e-5 relative of TP 1 × CP 1. A checkpoint saved at CP 2 resumes at CP 1; bad CP flags
/// are refused naming the numbers.
#[test]
fn context_parallel_training_matches_the_unsplit_run() {
    let dir = tmp("cp");
    let base = [
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--train-iters",
        "10",
        "--eval-interval",
        "0",
        "--generate-tokens",
        "0",
        "--tensor-model-parallel-size",
        "1",
        "--world-size",
        "1",
    ];
    let run = |extra: &[&str]| {
        run_gpt(&args(&[&base[..], extra].concat(), &dir))
            .unwrap()
            .log
    };
    let one = run(&[]);
    let layouts: [&[&str]; 9] = [
        &[
            "--world-size",
            "2",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            "p2p",
        ],
        &[
            "--world-size",
            "4",
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "p2p",
            "--seq-length",
            "32",
        ],
        &[
            "--world-size",
            "2",
            "--context-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        &[
            "--world-size",
            "2",
            "--context-parallel-size",
            "2",
            "--recompute-granularity",
            "selective",
            "--cp-comm-type",
            "p2p",
        ],
        &["--world-size", "2", "--context-parallel-size", "2"],
        // Ulysses with one query group per TP rank: repeated per head over CP.
        &[
            "--world-size",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--context-parallel-size",
            "2",
            "--sequence-parallel",
            "--cp-comm-type",
            "a2a",
        ],
        &[
            "--world-size",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--context-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        &[
            "--world-size",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--context-parallel-size",
            "2",
        ],
        &[
            "--world-size",
            "4",
            "--context-parallel-size",
            "2",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
        ],
    ];
    for layout in layouts {
        let log = run(layout);
        assert_eq!(log.len(), one.len(), "{layout:?}");
        for (a, b) in log.iter().zip(&one) {
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * y.abs().max(1.0);
            assert!(
                close(a.lm_loss, b.lm_loss),
                "{layout:?} iteration {}: loss {} vs {}",
                a.iteration,
                a.lm_loss,
                b.lm_loss
            );
            let (ga, gb) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
            assert!(
                close(ga, gb),
                "{layout:?} iteration {}: grad norm {ga} vs {gb}",
                a.iteration
            );
        }
    }
    // Saved at CP 2 × DP 2 with the distributed optimizer, resumed at CP 1 × DP 1.
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    run(&[
        "--world-size",
        "4",
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--save",
        s,
        "--save-interval",
        "5",
    ]);
    let resumed = run(&["--load", s, "--ckpt-step", "5"]);
    assert_eq!(resumed.first().unwrap().iteration, 6);
    for (a, b) in resumed.iter().zip(&one[5..]) {
        assert!(
            (a.lm_loss - b.lm_loss).abs() <= 1e-5 * b.lm_loss,
            "resumed iteration {}: {} vs {}",
            a.iteration,
            a.lm_loss,
            b.lm_loss
        );
    }
    let refused = |extra: &[&str]| run_gpt(&args(&[&base[..], extra].concat(), &dir)).unwrap_err();
    let e = refused(&[
        "--world-size",
        "2",
        "--context-parallel-size",
        "2",
        "--seq-length",
        "30",
    ]);
    assert!(e.contains("--seq-length (30)") && e.contains("(4)"), "{e}");
    let e = refused(&["--world-size", "3", "--context-parallel-size", "2"]);
    assert!(e.contains("--context-parallel-size 2"), "{e}");
    let e = refused(&[
        "--world-size",
        "3",
        "--context-parallel-size",
        "3",
        "--seq-length",
        "36",
        "--cp-comm-type",
        "a2a",
    ]);
    assert!(
        e.contains("--num-attention-heads (4)") && e.contains("--context-parallel-size (3)"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
