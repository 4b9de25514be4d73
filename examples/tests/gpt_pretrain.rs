//! The `gpt_pretrain` example end to end: a Llama-style model trains (loss falls, samples are
//! printed), resumes exactly at its layout and at another one (with ZeRO-1), round-trips
//! through a Hugging Face directory, and bad flags are refused before any work.

mod ecosystem;
mod moe;

use crate::common::{assert_close_losses, assert_same_iterations, gpt_args as args, gpt_argv, tmp};
use burn_megatron_examples::pretrain::{GptArgs, IterationLog, Summary, run_gpt};
use clap::Parser;
use std::path::Path;

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn a_llama_style_model_trains_with_falling_loss_and_writes_the_plot() {
    let dir = tmp("gpt-train");
    let Summary { log, evals, .. } = run_gpt(&args(&["--sequence-parallel"], &dir)).unwrap();
    assert_eq!(log.len(), 40);
    let first = mean(log[..5].iter().map(|e| e.lm_loss));
    let last = mean(log[35..].iter().map(|e| e.lm_loss));
    assert!(last < first - 1.0, "lm loss must fall: {first} → {last}");
    assert!(
        log.iter()
            .all(|e| e.sop_loss.is_none() && e.grad_norm.is_some())
    );
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), vec![20, 40]);
    assert!(evals.iter().all(|e| e.2.is_none() && e.1.is_finite()));
    let png = std::fs::read(dir.join("loss.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    // fp16 with FP32 master weights and the dynamic loss scaler: Megatron's initial scale
    // 2³² overflows, is halved until it fits, and the model still learns.
    let fp16 = [
        "--fp16",
        "--train-iters",
        "40",
        "--eval-interval",
        "0",
        "--generate-tokens",
        "0",
    ];
    let log = run_gpt(&args(&fp16, &dir)).unwrap().log;
    let skipped = log.last().unwrap().skipped_iterations;
    assert!(skipped > 0 && log.last().unwrap().loss_scale < 2f64.powi(32));
    let trained: Vec<f64> = log
        .iter()
        .filter(|e| e.grad_norm.is_some())
        .map(|e| e.lm_loss)
        .collect();
    assert!(trained.iter().all(|l| l.is_finite()));
    assert!(
        trained[trained.len() - 1] < trained[0] - 0.3,
        "fp16 lm loss must fall: {trained:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Resumes `flags` from iteration `at` of the checkpoints under `save`.
fn resume(save: &Path, at: usize, flags: &[&str], dir: &Path) -> Vec<IterationLog> {
    resume_said(save, at, flags, dir).0
}

/// [`resume`], and what the run said after training (its samples).
fn resume_said(
    save: &Path,
    at: usize,
    flags: &[&str],
    dir: &Path,
) -> (Vec<IterationLog>, Vec<String>) {
    std::fs::write(
        save.join("latest_checkpointed_iteration.txt"),
        at.to_string(),
    )
    .unwrap();
    let load = save.to_str().unwrap();
    let summary = run_gpt(&args(&[flags, &["--load", load]].concat(), dir)).unwrap();
    (summary.log, summary.said)
}

#[test]
fn resuming_continues_exactly_at_the_same_layout_and_closely_at_another() {
    let dir = tmp("gpt-resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    // bf16 with FP32 master weights and ZeRO-1 at TP 2 × DP 2.
    let bf16 = [
        "--world-size",
        "4",
        "--bf16",
        "--use-distributed-optimizer",
        "--train-iters",
        "12",
        "--eval-interval",
        "0",
        "--generate-tokens",
        "0",
    ];
    let full = run_gpt(&args(
        &[&bf16[..], &["--save", s, "--save-interval", "6"]].concat(),
        &dir,
    ))
    .unwrap();
    assert_same_iterations(&resume(&save, 6, &bf16, &dir), &full.log[6..]);
    std::fs::remove_dir_all(&save).unwrap();
    // f32 without dropout, saved at TP 2 × PP 2, resumed at TP 1 × DP 2 with ZeRO-1: the
    // state is the same, only the order of sums changes. The vocabulary of 400 pads to 432
    // rows at TP 2 and to 408 at TP 1 (multiples of 24 × TP): the checkpoint holds the
    // real 400.
    let f32_common = [
        "--make-vocab-size-divisible-by",
        "24",
        "--train-iters",
        "12",
        "--eval-interval",
        "0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ];
    let pp = [
        "--pipeline-model-parallel-size",
        "2",
        "--world-size",
        "4",
        "--generate-tokens",
        "0",
    ];
    let save_flags = ["--save", s, "--save-interval", "6"];
    let full = run_gpt(&args(&[&f32_common[..], &pp, &save_flags].concat(), &dir)).unwrap();
    // Both resumed runs generate 6 greedy tokens per prompt at the end.
    let other = [
        "--tensor-model-parallel-size",
        "1",
        "--world-size",
        "2",
        "--use-distributed-optimizer",
        "--generate-tokens",
        "6",
    ];
    let (resumed, samples) = resume_said(&save, 6, &[&f32_common[..], &other].concat(), &dir);
    assert_close_losses("TP 1 × DP 2", &resumed, &full.log[6..], 1e-5);
    // At PP 3 with the embedding counted as a layer (Megatron's uneven split): 2 layers + 1
    // over 3 stages, so the first stage only embeds and the others hold a layer each.
    let uneven = [
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "3",
        "--world-size",
        "3",
        "--account-for-embedding-in-pipeline-split",
        "--generate-tokens",
        "6",
    ];
    let (resumed, staged) = resume_said(&save, 6, &[&f32_common[..], &uneven].concat(), &dir);
    assert_close_losses("PP 3, embedding counted", &resumed, &full.log[6..], 1e-5);
    // Generated through the 3 stages, the same samples as on one stage.
    assert!(
        !samples.is_empty() && samples.iter().all(|s| s.starts_with("> sample:")),
        "a sample per prompt: {samples:?}"
    );
    assert_eq!(staged, samples, "samples through pipeline stages");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_hugging_face_directory_written_by_save_hf_loads_back_with_load_hf() {
    let dir = tmp("gpt-hf");
    let hf = dir.join("hf");
    let h = hf.to_str().unwrap();
    let short = [
        "--train-iters",
        "6",
        "--eval-interval",
        "6",
        "--generate-tokens",
        "0",
    ];
    let trained = run_gpt(&args(&[&short[..], &["--save-hf", h]].concat(), &dir)).unwrap();
    assert!(hf.join("config.json").is_file() && hf.join("tokenizer.json").is_file());
    // The loaded weights with a zero learning rate: the validation loss is the saved model's.
    let frozen = [
        "--load-hf",
        h,
        "--train-iters",
        "2",
        "--eval-interval",
        "2",
        "--lr",
        "0",
        "--min-lr",
        "0",
        "--generate-tokens",
        "0",
    ];
    // At the layout that saved it, and split over pipeline stages (each loads its layers).
    let pp2 = ["--pipeline-model-parallel-size", "2", "--world-size", "4"];
    for layout in [&[][..], &pp2[..]] {
        let loaded = run_gpt(&args(&[&frozen[..], layout].concat(), &dir)).unwrap();
        let (a, b) = (trained.evals[0].1, loaded.evals[0].1);
        assert!(
            (a - b).abs() <= 1e-6 * a,
            "{layout:?}: validation loss {b} after --load-hf, {a} when saved"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--attention-backend flash` reaches the model: the flash op runs (counted). On the CPU it
/// runs the chunked schedule's forward in the kernels' blocks of 32 query rows and the
/// kernels' backward from the saved output and log-sum-exp, so at seq 64 (two blocks) the
/// losses are those of `--attention-backend chunked --attention-query-chunk 32` and of the
/// unfused run within 1e-5 (relative).
#[test]
fn flash_attention_trains_as_its_blocks_on_the_cpu() {
    let dir = tmp("gpt-flash");
    let short = [
        "--train-iters",
        "4",
        "--eval-interval",
        "0",
        "--seq-length",
        "64",
    ];
    let run = |extra: &[&str]| {
        run_gpt(&args(&[&short[..], extra].concat(), &dir))
            .unwrap()
            .log
    };
    let calls = || burn_megatron_kernels::flash_launches().composed;
    let before = calls();
    let flash = run(&["--attention-backend", "flash"]);
    let flash_calls = calls() - before;
    assert!(flash_calls > 0, "--attention-backend flash ran no flash op");
    let chunked = run(&[
        "--attention-backend",
        "chunked",
        "--attention-query-chunk",
        "32",
    ]);
    assert_close_losses("flash vs chunked", &flash, &chunked, 1e-5);
    assert_close_losses("flash vs unfused", &flash, &run(&[]), 1e-5);
}

#[test]
fn bad_flags_are_refused_before_any_work_naming_them() {
    let dir = tmp("gpt-flags");
    let refused = |extra: &[&str]| run_gpt(&args(extra, &dir)).unwrap_err();
    for (extra, want) in [
        (&["--num-query-groups", "3"][..], "--num-query-groups (3)"),
        (
            &["--tensor-model-parallel-size", "4", "--world-size", "4"][..],
            "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)",
        ),
        (
            &[
                "--position-embedding-type",
                "learned_absolute",
                "--max-position-embeddings",
                "16",
            ][..],
            "--seq-length (32) exceeds --max-position-embeddings (16)",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "4",
                "--save-hf",
                "x",
            ][..],
            "--save-hf needs --pipeline-model-parallel-size 1",
        ),
        (&["--kv-channels", "7"][..], "rotated channels"),
        (&["--rotary-base", "0.5"][..], "rotary_base"),
        (
            &["--rotary-base", "nan"][..],
            "--rotary-base must be a finite number > 0",
        ),
        (
            &["--rotary-percent", "0"][..],
            "--rotary-percent must be a finite number in (0, 1]",
        ),
        (
            &["--norm-epsilon", "inf"][..],
            "--norm-epsilon must be a finite number > 0",
        ),
        (
            &["--attention-query-chunk", "0"][..],
            "--attention-query-chunk must be at least 1",
        ),
        (
            &["--decoder-first-pipeline-num-layers", "1"][..],
            "need pipeline parallelism",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "4",
                "--decoder-last-pipeline-num-layers",
                "2",
            ][..],
            "0 layers are left for 1 middle pipeline stages",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "4",
                "--num-layers",
                "4",
                "--decoder-first-pipeline-num-layers",
                "1",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ][..],
            "interleaves with --num-virtual-stages-per-pipeline-rank",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "4",
                "--num-layers",
                "3",
                "--pipeline-model-parallel-layout",
                "Ett|ttL",
            ][..],
            "it holds 4 transformer layers, and the model 3",
        ),
        (
            &["--pipeline-model-parallel-layout", "Et|tL"][..],
            "of more than one stage needs --pipeline-model-parallel-size > 1",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "4",
                "--num-layers",
                "4",
                "--pipeline-model-parallel-layout",
                "Ett|ttL",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ][..],
            "not with --num-layers-per-virtual-pipeline-stage",
        ),
        (
            &[
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "4",
                "--num-layers",
                "4",
                "--pipeline-model-parallel-layout",
                "Ett|ttL",
                "--decoder-first-pipeline-num-layers",
                "2",
            ][..],
            "cannot be set with it",
        ),
        // A byte-level BPE cannot be smaller; it once trained 257 tokens silently.
        (
            &["--vocab-size", "1"][..],
            "--vocab-size (1) must be at least 257",
        ),
    ] {
        let e = refused(extra);
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    assert!(!dir.join("loss.png").exists(), "nothing ran");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Megatron-Core's `--pipeline-model-parallel-layout` sets each virtual stage's layers and,
/// through their number, the model chunks per stage; a letter it does not build is refused
/// as the flag is parsed. (The layout trains as one rank: `tests/tests/gpt/pipeline.rs`.)
#[test]
fn a_pipeline_layout_sets_the_stages_and_the_model_chunks() {
    let dir = tmp("gpt-layout");
    let pp2 = |layout: &str| {
        let flags = [
            "--pipeline-model-parallel-size",
            "2",
            "--world-size",
            "4",
            "--num-layers",
        ];
        let layout = ["4", "--pipeline-model-parallel-layout", layout];
        gpt_argv(&[&flags[..], &layout[..]].concat(), &dir)
    };
    let written = GptArgs::try_parse_from(pp2("E|tt|t|tL")).expect("a layout");
    assert_eq!(
        written.train.layers_per_virtual_stage(),
        Ok(vec![0, 2, 1, 1])
    );
    let config = written.train.parallel_config().expect("a valid layout");
    assert_eq!(config.virtual_pipeline_model_parallel_size, Some(2));
    let e = GptArgs::try_parse_from(pp2("Ett|tmL")).expect_err("no multi-token prediction");
    assert!(e.to_string().contains("`m`: multi-token prediction"), "{e}");
}

/// `plan`'s predicted peak per pipeline rank against the peak each rank's counter measured
/// in `gpt_pretrain`, within 10%, at layouts that exercise each term: TP with SP, the 1F1B
/// pipeline's in-flight microbatches, DP with the overlapped reducer's buckets and the
/// distributed optimizer, and full recomputation's replay. (The README's table has more.)
#[test]
fn the_plan_predicts_each_ranks_measured_peak() {
    use burn_megatron_examples::plan::Setup;
    let dir = tmp("plan-vs-measured");
    let model = [
        "--num-layers",
        "4",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "704",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--vocab-size",
        "591",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--train-iters",
        "2",
        "--eval-interval",
        "0",
        "--generate-tokens",
        "0",
    ];
    let full = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    let layouts: [&[&str]; 3] = [
        &[
            "--tensor-model-parallel-size",
            "2",
            "--world-size",
            "2",
            "--sequence-parallel",
        ],
        &[
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "2",
            "--world-size",
            "2",
        ],
        &[
            "--tensor-model-parallel-size",
            "1",
            "--world-size",
            "2",
            "--overlap-grad-reduce",
            "--use-distributed-optimizer",
        ],
    ];
    for layout in layouts {
        for recompute in [&[][..], &full[..]] {
            let args = args(&[&model[..], layout, recompute].concat(), &dir);
            let stages = Setup::new(&args, 591).unwrap().plan().unwrap();
            let summary = run_gpt(&args).unwrap();
            assert_eq!(summary.peaks.len(), 2, "{layout:?}: every rank's peak");
            check_peaks(&format!("{layout:?} {recompute:?}"), &stages, summary.peaks);
        }
    }
    // Megatron's uneven split: 3 layers on the first stage (2 microbatches in flight), 1 on
    // the last beside the output layer.
    let uneven = [layouts[1], &["--decoder-last-pipeline-num-layers", "1"]].concat();
    let args_uneven = args(&[&model[..], &uneven].concat(), &dir);
    let stages = Setup::new(&args_uneven, 591).unwrap().plan().unwrap();
    check_peaks(
        "PP 2, layers 3+1",
        &stages,
        run_gpt(&args_uneven).unwrap().peaks,
    );
    // The step waits for the busiest rank. Here a layer costs more than the output layer
    // (h 256, ffn 704, vocab 640), so the even split (2 layers + the output on the last
    // rank) is the fastest: 3 + 1 loads the first rank with 3 layers, 1 + 3 the last with 3
    // and the output.
    let flops = |split: &[&str]| {
        let flags = [&model[..], layouts[1], split].concat();
        Setup::new(&args(&flags, &dir), 591)
            .unwrap()
            .flops_per_rank()
    };
    let (even, light_last, heavy_last) = (
        flops(&[]),
        flops(&["--decoder-last-pipeline-num-layers", "1"]),
        flops(&["--decoder-first-pipeline-num-layers", "1"]),
    );
    assert!(
        even < light_last && light_last < heavy_last,
        "{even} {light_last} {heavy_last}"
    );
    // An evaluation of four batches after the last step stays within the step's peak: it
    // keeps no graph. On the autodiff device, Burn kept every batch's graph until a next
    // backward that never came: 369 MB at the end against the step's 50 MB.
    let eval = ["--eval-interval", "2", "--eval-iters", "4"];
    let with_eval = args(&[&model[..], layouts[0], &eval].concat(), &dir);
    let stages = Setup::new(&with_eval, 591).unwrap().plan().unwrap();
    let peaks = run_gpt(&with_eval).unwrap().peaks;
    check_peaks("TP 2 with evaluation", &stages, peaks);
    // Context parallelism, each comm type: 1/CP of the tokens, and what each keeps of K/V
    // and of the scores.
    for comm in ["all_gather", "p2p", "a2a"] {
        let layout = [
            "--tensor-model-parallel-size",
            "1",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            comm,
            "--world-size",
            "2",
        ];
        let args = args(&[&model[..], &layout[..]].concat(), &dir);
        let stages = Setup::new(&args, 591).unwrap().plan().unwrap();
        let summary = run_gpt(&args).unwrap();
        check_peaks(&format!("CP 2 {comm}"), &stages, summary.peaks);
    }
    // The chunked attention keeps no scores: the TP 2 layout again, in blocks of 64 rows.
    let chunked = [
        "--attention-backend",
        "chunked",
        "--attention-query-chunk",
        "64",
    ];
    let chunked = args(&[&model[..], layouts[0], &chunked[..]].concat(), &dir);
    let stages = Setup::new(&chunked, 591).unwrap().plan().unwrap();
    let summary = run_gpt(&chunked).unwrap();
    check_peaks("TP 2 chunked attention", &stages, summary.peaks);
    // BERT (post-LayerNorm, the MLM head on the masked positions) on a pipeline.
    let bert_flags = [
        "--num-layers",
        "4",
        "--hidden-size",
        "256",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "16",
        "--vocab-size",
        "191",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--world-size",
        "2",
        "--train-iters",
        "2",
        "--eval-interval",
        "0",
    ];
    let bert = crate::common::args(&bert_flags, &dir);
    let stages = Setup::new_bert(&bert, 191).unwrap().plan().unwrap();
    let summary = burn_megatron_examples::pretrain::run(&bert).unwrap();
    check_peaks("bert PP 2", &stages, summary.peaks);
    // BERT under CP 2: bidirectional attention keeps every key's scores for its queries.
    for comm in ["all_gather", "p2p", "a2a"] {
        let layout = [
            "--seq-length",
            "256",
            "--pipeline-model-parallel-size",
            "1",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            comm,
        ];
        let cp = crate::common::args(&[&bert_flags[..], &layout[..]].concat(), &dir);
        let stages = Setup::new_bert(&cp, 191).unwrap().plan().unwrap();
        let summary = burn_megatron_examples::pretrain::run(&cp).unwrap();
        check_peaks(&format!("bert CP 2 {comm}"), &stages, summary.peaks);
    }
    // A refused layout is refused by both, with one message.
    let bad = args(
        &["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        &dir,
    );
    assert_eq!(
        Setup::new(&bad, 591).unwrap_err(),
        run_gpt(&bad).unwrap_err()
    );
    // So is `layernorm` recomputation of BERT's post-norm layers.
    let bad = crate::common::args(
        &[
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "layernorm",
        ],
        &dir,
    );
    let e = Setup::new_bert(&bad, 191).unwrap_err();
    assert!(e.contains("layernorm needs pre-norm layers"), "{e}");
    assert_eq!(e, burn_megatron_examples::pretrain::run(&bad).unwrap_err());
}

/// Each rank's measured peak within 15% of its stage's predicted one.
fn check_peaks(
    what: &str,
    stages: &[burn_megatron_examples::plan::StagePlan],
    peaks: Vec<(usize, usize, i64)>,
) {
    assert!(!peaks.is_empty(), "{what}: every rank's peak");
    for (rank, stage, measured) in peaks {
        let predicted = stages[stage].total_bytes as f64;
        let error = predicted / measured as f64 - 1.0;
        println!(
            "{what} rank {rank}: predicted {predicted} bytes, measured {measured} ({:+.1}%)",
            100.0 * error
        );
        assert!(
            error.abs() <= 0.10,
            "{what} rank {rank}: predicted {predicted} bytes, measured {measured} ({:+.1}%)",
            100.0 * error
        );
    }
}
