//! The `bert_pretrain` example end to end: it trains (loss falls), resumes exactly, and
//! rejects bad arguments before any work.

mod context_parallel;

use crate::common::{args, assert_same_iterations, binary, sop, tmp};
use burn_megatron_examples::pretrain::{IterationLog, Summary, run};

/// Six iterations at TP 2 × DP 2, no evaluation: for comparing two runs step by step.
const SHORT_TP2_DP2: [&str; 6] = [
    "--world-size",
    "4",
    "--train-iters",
    "6",
    "--eval-interval",
    "0",
];

/// Resumes `flags` from iteration `at` of the checkpoints under `save`, as if the run had
/// stopped there; returns the resumed run's log.
fn resume(
    save: &std::path::Path,
    at: usize,
    flags: &[&str],
    dir: &std::path::Path,
) -> Vec<IterationLog> {
    std::fs::write(
        save.join("latest_checkpointed_iteration.txt"),
        at.to_string(),
    )
    .unwrap();
    let load = save.to_str().unwrap();
    run(&args(&[flags, &["--load", load]].concat(), dir))
        .unwrap()
        .log
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn trains_with_falling_loss_and_writes_the_plot() {
    let dir = tmp("train");
    let a = args(&["--sequence-parallel"], &dir);
    let Summary { log, evals, .. } = run(&a).unwrap();
    assert_eq!(log.len(), 40);
    assert_eq!(log[39].consumed_samples, 320);
    let first = mean(log[..5].iter().map(|e| e.lm_loss));
    let last = mean(log[35..].iter().map(|e| e.lm_loss));
    assert!(last < first - 0.5, "lm loss must fall: {first} → {last}");
    assert!(log.iter().all(|e| e.grad_norm.is_some_and(f64::is_finite)));
    assert_eq!(log[0].lr, 0.0, "warmup starts at 0 as Megatron's");
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), vec![20, 40]);
    let png = std::fs::read(dir.join("loss.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resuming_continues_the_exact_loss_sequence() {
    let dir = tmp("resume");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    // bf16 so the FP32 master weights are checkpointed too; TP 2 × DP 2.
    let common = [
        "--world-size",
        "4",
        "--bf16",
        "--train-iters",
        "20",
        "--eval-interval",
        "0",
    ];
    let mut full_args: Vec<&str> = common.to_vec();
    full_args.extend(["--save", s, "--save-interval", "10"]);
    let full = run(&args(&full_args, &dir)).unwrap();
    assert!(
        save.join("iter_0000010/mp_rank_01/master.safetensors")
            .is_file()
    );
    assert!(
        save.join("iter_0000020/mp_rank_00/optim.safetensors")
            .is_file()
    );
    let resumed = resume(&save, 10, &common, &dir);
    assert_same_iterations(&resumed, &full.log[10..]);
    // Another layout (TP 1 × DP 2) resumes too, AdamW's moments resharded with the weights;
    // in bf16 with dropout it follows the original run only roughly (tests/reshard.rs checks
    // the exact continuation).
    let other_layout = ["--tensor-model-parallel-size", "1", "--world-size", "2"];
    let other_layout = [&common[..], &["--load", s], &other_layout].concat();
    let log = run(&args(&other_layout, &dir)).unwrap().log;
    assert_eq!(log.first().map(|e| e.iteration), Some(11));
    for (a, b) in log.iter().zip(&full.log[10..]) {
        let at = a.iteration;
        assert!(
            (a.lm_loss - b.lm_loss).abs() < 0.1,
            "{at}: {} vs {}",
            a.lm_loss,
            b.lm_loss
        );
    }
    let weights_only = [
        &other_layout[..],
        &["--no-load-optim", "--train-iters", "12"],
    ]
    .concat();
    let log = run(&args(&weights_only, &dir)).unwrap().log;
    assert_eq!(log.first().map(|e| e.iteration), Some(11));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fused_adam_gives_the_same_run_and_resumes_exactly() {
    let dir = tmp("fused");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    // bf16 TP 2 × DP 2: the flat FP32 buffers are the master weights.
    let base = [
        "--world-size",
        "4",
        "--bf16",
        "--train-iters",
        "10",
        "--eval-interval",
        "0",
    ];
    let plain = run(&args(&base, &dir)).unwrap();
    let mut fused_args: Vec<&str> = base.to_vec();
    fused_args.push("--use-fused-adam");
    let mut saving = fused_args.clone();
    saving.extend(["--save", s, "--save-interval", "5"]);
    let fused = run(&args(&saving, &dir)).unwrap();
    assert!(
        save.join("iter_0000005/mp_rank_01/exp_avg_sq.safetensors")
            .is_file()
    );
    // The same update in the same f32 operations: the same bits, iteration by iteration.
    assert_same_iterations(&plain.log, &fused.log);
    let resumed = resume(&save, 5, &fused_args, &dir);
    assert_same_iterations(&resumed, &fused.log[5..]);
    // A burn-optim run cannot pick up the fused state.
    let mut wrong: Vec<&str> = base.to_vec();
    wrong.extend(["--load", s]);
    let e = run(&args(&wrong, &dir)).unwrap_err();
    assert!(e.contains("saved by the fused Adam"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gradient_accumulation_fusion_trains_the_same_model() {
    let dir = tmp("grad-accum-fusion");
    // Under sequence parallelism the column layers' f32 weight gradients come from the
    // gathered product's backward.
    let base = [
        &SHORT_TP2_DP2[..],
        &["--overlap-grad-reduce", "--sequence-parallel"],
    ]
    .concat();
    let run_with = |extra: &[&str]| run(&args(&[&base[..], extra].concat(), &dir)).unwrap().log;
    let plain = run_with(&[]);
    // f32: the fused weight gradients are the same f32 sums in another order.
    let fused = run_with(&["--gradient-accumulation-fusion"]);
    // bf16: f32 weight gradients into the FP32 main-grad buckets; the bf16 forward differs.
    let bf16 = run_with(&["--gradient-accumulation-fusion", "--bf16"]);
    assert_eq!((fused.len(), bf16.len()), (plain.len(), plain.len()));
    for ((p, f), b) in plain.iter().zip(&fused).zip(&bf16) {
        let at = format!("iteration {}", p.iteration);
        assert!(
            (p.lm_loss - f.lm_loss).abs() <= 1e-4 * p.lm_loss,
            "{at}: {p:?} vs {f:?}"
        );
        assert!(
            (p.grad_norm.unwrap() - f.grad_norm.unwrap()).abs() <= 1e-4 * p.grad_norm.unwrap(),
            "{at}"
        );
        assert!(
            (p.lm_loss - b.lm_loss).abs() <= 0.02 * p.lm_loss,
            "{at}: bf16 {b:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn overlapped_gradient_reduction_gives_the_same_run() {
    let dir = tmp("overlap");
    let plain = run(&args(&SHORT_TP2_DP2, &dir)).unwrap();
    let with = [&SHORT_TP2_DP2[..], &["--overlap-grad-reduce"]].concat();
    let overlapped = run(&args(&with, &dir)).unwrap();
    assert_same_iterations(&plain.log, &overlapped.log);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The example end to end at four layouts, dropout off: TP 1 × DP 1 is the reference.
#[test]
fn every_layout_trains_the_same_model() {
    let dir = tmp("layouts");
    let losses = |tp: &str, world: &str, extra: &[&str]| {
        let mut a = vec![
            "--tensor-model-parallel-size",
            tp,
            "--world-size",
            world,
            "--train-iters",
            "6",
            "--eval-interval",
            "0",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
        ];
        a.extend_from_slice(extra);
        run(&args(&a, &dir)).unwrap().log
    };
    let reference = losses("1", "1", &[]);
    for (tp, world, extra) in [
        ("2", "2", &[][..]),
        ("1", "2", &[]),
        ("2", "4", &["--sequence-parallel"]),
    ] {
        let log = losses(tp, world, extra);
        assert_eq!(log.len(), reference.len());
        for (a, b) in log.iter().zip(&reference) {
            let what = format!("tp {tp} world {world} {extra:?} iteration {}", a.iteration);
            assert!(
                (a.lm_loss - b.lm_loss).abs() < 1e-4,
                "{what}: {} vs {}",
                a.lm_loss,
                b.lm_loss
            );
            assert!((sop(a) - sop(b)).abs() < 1e-4, "{what}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// TP 2 × PP 2 trains (its loss falls), writes the timeline, saves per-stage checkpoints
/// under Megatron's names and resumes from them exactly.
#[test]
fn pipeline_parallel_training_falls_saves_and_resumes() {
    let dir = tmp("pipeline");
    let save = dir.join("ckpt");
    let (s, trace) = (save.to_str().unwrap(), dir.join("trace.json"));
    let common = [
        "--pipeline-model-parallel-size",
        "2",
        "--world-size",
        "4",
        "--num-layers",
        "2",
        "--eval-interval",
        "20",
    ];
    let mut full_args: Vec<&str> = common.to_vec();
    full_args.extend(["--save", s, "--save-interval", "20"]);
    full_args.extend(["--timeline", trace.to_str().unwrap()]);
    let full = run(&args(&full_args, &dir)).unwrap();
    assert_eq!(full.log.len(), 40);
    let first = mean(full.log[..5].iter().map(|e| e.lm_loss));
    let last = mean(full.log[35..].iter().map(|e| e.lm_loss));
    assert!(last < first - 0.5, "lm loss must fall: {first} → {last}");
    assert_eq!(full.evals.len(), 2);
    for stage in ["mp_rank_00_000", "mp_rank_01_001"] {
        assert!(
            save.join("iter_0000020")
                .join(stage)
                .join("model.safetensors")
                .is_file()
        );
    }
    let events: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let names: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    // Two microbatches (8 samples / 4 per microbatch / DP 1) through 2 stages.
    for name in [
        "F0.0",
        "F1.0",
        "B0.0",
        "B1.0",
        "send F0.0",
        "recv B1.0",
        "idle",
    ] {
        assert!(
            names.contains(&name),
            "{name} missing from the trace: {names:?}"
        );
    }
    assert_eq!(&std::fs::read(dir.join("trace.png")).unwrap()[1..4], b"PNG");
    let resumed = resume(&save, 20, &common, &dir);
    assert_same_iterations(&resumed, &full.log[20..]);
    let mut no_pp: Vec<&str> = [&common[..], &["--load", s]].concat();
    no_pp.extend(["--pipeline-model-parallel-size", "1", "--world-size", "2"]);
    let log = run(&args(&no_pp, &dir)).unwrap().log;
    assert_eq!(log.first().map(|e| e.iteration), Some(21));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The example at pipeline layouts (1F1B, interleaved, with TP + SP, with DP + overlap), dropout
/// off, against TP 1 × PP 1 × DP 1.
#[test]
fn every_pipeline_layout_trains_the_same_model() {
    let dir = tmp("pipeline-layouts");
    let losses = |tp: &str, pp: &str, world: &str, extra: &[&str]| {
        let mut a = vec![
            "--tensor-model-parallel-size",
            tp,
            "--pipeline-model-parallel-size",
            pp,
            "--world-size",
            world,
            "--num-layers",
            "4",
        ];
        a.extend_from_slice(&SHORT_TP2_DP2[2..]);
        a.extend(["--hidden-dropout", "0", "--attention-dropout", "0"]);
        a.extend_from_slice(extra);
        run(&args(&a, &dir)).unwrap().log
    };
    let reference = losses("1", "1", "1", &[]);
    for (tp, pp, world, extra) in [
        ("1", "2", "2", &[][..]),
        (
            "1",
            "2",
            "2",
            &["--num-layers-per-virtual-pipeline-stage", "1"],
        ),
        ("2", "2", "4", &["--sequence-parallel"]),
        ("1", "2", "4", &["--overlap-grad-reduce"]),
    ] {
        let log = losses(tp, pp, world, extra);
        assert_eq!(log.len(), reference.len());
        for (a, b) in log.iter().zip(&reference) {
            let what = format!(
                "tp {tp} pp {pp} world {world} {extra:?} iteration {}",
                a.iteration
            );
            assert!(
                (a.lm_loss - b.lm_loss).abs() < 1e-4,
                "{what}: {} vs {}",
                a.lm_loss,
                b.lm_loss
            );
            assert!((sop(a) - sop(b)).abs() < 1e-4, "{what}");
            let (na, nb) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
            assert!((na - nb).abs() <= 1e-4 * nb, "{what}: norm {na} vs {nb}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn error_of(extra: &[&str]) -> String {
    // Tests run in parallel: each call gets a directory of its own.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = tmp(&format!("bad-{n}"));
    let e = run(&args(extra, &dir)).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    e
}

/// Each flag list must be refused with an error containing every one of its phrases.
fn assert_refused(cases: &[(&[&str], &[&str])]) {
    for (flags, phrases) in cases {
        let e = error_of(flags);
        // `--lr=-1` once named only the weight-decay flags.
        if flags.iter().any(|f| f.starts_with("--lr")) {
            assert!(!e.contains("weight-decay"), "{flags:?}: {e}");
        }
        for phrase in *phrases {
            assert!(
                e.contains(phrase),
                "{flags:?}: {phrase:?} missing from: {e}"
            );
        }
    }
}

#[test]
fn bad_arguments_are_rejected_with_clear_messages() {
    assert_refused(&[
        (
            &["--num-attention-heads", "3", "--hidden-size", "48"],
            &[
                "--num-attention-heads (3)",
                "--tensor-model-parallel-size (2)",
            ],
        ),
        (
            &["--world-size", "4", "--global-batch-size", "12"],
            &["--global-batch-size (12)", "data-parallel size (2"],
        ),
        (
            &["--data-path", "/nonexistent/corpus.jsonl"],
            &["--data-path /nonexistent/corpus.jsonl: no such file"],
        ),
        (&["--world-size", "3"], &["--world-size 3", "2"]),
        // Zero sizes would divide by zero while the model is built.
        (
            &["--hidden-size", "0", "--num-attention-heads", "0"],
            &["--hidden-size must be at least 1"],
        ),
        (
            &["--num-attention-heads", "0"],
            &["--num-attention-heads must be at least 1"],
        ),
        (&["--load", "/nonexistent/ckpt"], &["no checkpoint"]),
        (
            &["--init-method-std=-0.5"],
            &["--init-method-std must be a finite number ≥ 0, got -0.5"],
        ),
        (&["--init-method-std", "NaN"], &["--init-method-std", "NaN"]),
        // Every float flag: NaN, infinities and values out of range, naming the flag.
        (
            &["--lr", "nan"],
            &["--lr must be a finite number ≥ 0, got NaN"],
        ),
        (&["--lr=-1"], &["--lr must be a finite number ≥ 0, got -1"]),
        (
            &["--lr", "inf"],
            &["--lr must be a finite number ≥ 0, got inf"],
        ),
        (
            &["--lr", "0.001", "--min-lr", "0.01"],
            &["--min-lr (0.01) must not exceed --lr (0.001)"],
        ),
        (
            &["--hidden-dropout", "1"],
            &["--hidden-dropout", "in [0, 1), got 1"],
        ),
        (&["--attention-dropout=-0.1"], &["--attention-dropout"]),
        (&["--clip-grad", "NaN"], &["--clip-grad"]),
        (&["--weight-decay=-0.01"], &["--weight-decay must be"]),
        (&["--lr-warmup-fraction", "1"], &["--lr-warmup-fraction"]),
        (
            &["--fp16", "--loss-scale", "0"],
            &["--loss-scale must be a finite number > 0"],
        ),
        // A constant weight decay cannot move from 0 to 0.1.
        (
            &["--start-weight-decay", "0", "--end-weight-decay", "0.1"],
            &["--weight-decay-incr-style"],
        ),
    ]);
}

/// Every `u64` is a seed: the derived streams wrap instead of overflowing.
#[test]
fn the_largest_seed_trains() {
    let dir = tmp("max-seed");
    let max = u64::MAX.to_string();
    let flags = [
        &SHORT_TP2_DP2[..],
        &["--seed", max.as_str(), "--train-iters", "2"],
    ]
    .concat();
    let log = run(&args(&flags, &dir)).unwrap().log;
    assert!(log.iter().all(|e| e.lm_loss.is_finite()), "{log:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_pipeline_flags_are_rejected_with_clear_messages() {
    let pp2 = |extra: &[&'static str]| -> Vec<&'static str> {
        let base = ["--pipeline-model-parallel-size", "2", "--world-size", "4"];
        [&base[..], &["--num-layers", "4"], extra].concat()
    };
    assert_refused(&[
        (
            &["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
            &["--num-layers (3)", "--pipeline-model-parallel-size (2)"],
        ),
        // TP 2 × PP 2 needs a world of 4.
        (
            &["--pipeline-model-parallel-size", "2", "--num-layers", "2"],
            &["--world-size 2", "--pipeline-model-parallel-size 2"],
        ),
        (
            &["--num-layers-per-virtual-pipeline-stage", "1"],
            &["needs --pipeline-model-parallel-size > 1"],
        ),
        (
            &pp2(&["--num-layers-per-virtual-pipeline-stage", "3"]),
            &["(3) must divide the 2 layers of each stage"],
        ),
        (
            &pp2(&["--microbatch-group-size-per-virtual-pipeline-stage", "2"]),
            &["needs the interleaved schedule"],
        ),
        (
            &pp2(&[
                "--num-virtual-stages-per-pipeline-rank",
                "1",
                "--microbatch-group-size-per-virtual-pipeline-stage",
                "2",
            ]),
            &["these flags give one, plain 1F1B"],
        ),
        // An uneven split interleaves through --num-virtual-stages-per-pipeline-rank, each
        // rank's layers split evenly over its chunks: the first stage's one layer cannot.
        (
            &pp2(&[
                "--decoder-first-pipeline-num-layers",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ]),
            &["the first pipeline stage's 1 layers do not split evenly over its 2 model chunks"],
        ),
        // Interleaving needs at least P microbatches: 8 samples / (8 per microbatch × DP 1).
        (
            &pp2(&[
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--micro-batch-size",
                "8",
            ]),
            &["pipeline schedule of 1 microbatches", "[2, 1]"],
        ),
    ]);
}

/// The example binary itself: a bad flag value ends with the message and exit status 1
/// before any training output.
#[test]
fn the_binary_exits_nonzero_on_bad_arguments() {
    let bin = binary();
    let out = std::process::Command::new(&bin)
        .args([
            "--num-attention-heads",
            "3",
            "--hidden-size",
            "48",
            "--no-progress",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("error: --num-attention-heads (3) must be divisible"),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "no work may start: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
