//! `gpt_pretrain` with mixture-of-experts layers: it trains at EP 2 and logs its experts'
//! token shares and load-balancing loss, the same with full recomputation; its checkpoints (experts saved under their global
//! index) resume exactly at EP 2 and, resharded, at EP 1, TP 2 × EP 2, TP 2 × EP 4,
//! TP 2 × EP 2 with each expert split over TP (`--expert-tensor-parallel-size 2`) and
//! TP 2 × PP 2 × DP 2 with the experts split (the same
//! micro-batches, so the same load-balancing losses); a run with experts split trains as
//! the run with them whole, and its checkpoints resume at EP 1; with the distributed optimizer
//! sharding the experts over expert-DP it trains as without, and its checkpoints resume
//! exactly and reshard; bad MoE flags are refused before any work.

use super::resume;
use crate::common::{assert_close_losses, assert_same_iterations, gpt_args as args, tmp};
use burn_megatron_examples::pretrain::run_gpt;

/// Four experts, top-2, on 2 ranks; f32 without dropout, so another layout differs only in
/// the order of sums.
const MOE: [&str; 24] = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--tensor-model-parallel-size",
    "1",
    "--world-size",
    "2",
    "--train-iters",
    "12",
    "--eval-interval",
    "0",
    "--generate-tokens",
    "0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
];

#[test]
fn an_moe_model_trains_logs_its_experts_and_resumes_at_other_expert_layouts() {
    let dir = tmp("gpt-moe");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let ep2 = [&MOE[..], &["--expert-model-parallel-size", "2"]].concat();
    let full = run_gpt(&args(
        &[&ep2[..], &["--save", s, "--save-interval", "6"]].concat(),
        &dir,
    ))
    .unwrap();
    let log = &full.log;
    assert!(log[11].lm_loss < log[0].lm_loss - 0.3, "the loss must fall");
    for e in log {
        let moe = e.moe.as_ref().expect("an MoE model logs its experts");
        assert_eq!(moe.expert_token_share.len(), 4);
        let total: f64 = moe.expert_token_share.iter().sum();
        assert!((total - 1.0).abs() < 1e-9, "shares sum to 1: {total}");
        // E · Σ fᵢ·Pᵢ: 1 when balanced, at most E.
        let lb = moe
            .load_balancing_loss
            .expect("--moe-aux-loss-coeff is set");
        assert!((0.9..4.0).contains(&lb), "load balancing loss {lb}");
        assert!(moe.max_over_mean() >= 1.0);
    }
    // Full recomputation re-runs each layer's routing and token exchange in backward:
    // the same run, bit for bit.
    let recompute = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    let recomputed = run_gpt(&args(&[&ep2[..], &recompute].concat(), &dir)).unwrap();
    for (a, b) in recomputed.log.iter().zip(log) {
        assert_eq!(
            (a.lm_loss, a.grad_norm),
            (b.lm_loss, b.grad_norm),
            "recomputed"
        );
    }
    // The same layout continues bit for bit.
    let same = resume(&save, 6, &ep2, &dir);
    assert_eq!(same.len(), 6);
    for (a, b) in same.iter().zip(&log[6..]) {
        assert_eq!((a.lm_loss, a.grad_norm), (b.lm_loss, b.grad_norm));
        assert_eq!(a.moe, b.moe, "iteration {}", a.iteration);
    }
    // Every expert on each rank (EP 1), and TP 2 × EP 2 with sequence parallelism: the
    // experts are found under their global names.
    let tp2 = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "2",
    ];
    // EP 4 over TP 2 × DP 2: one expert per rank.
    let ep4 = [
        "--world-size",
        "4",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-model-parallel-size",
        "4",
    ];
    // Each expert split over the TP ranks of TP 2 × DP 2.
    let etp2 = [&ep4[..6], &["2", "--expert-tensor-parallel-size", "2"]].concat();
    let ep1 = ["--expert-model-parallel-size", "1"];
    // And through a pipeline: TP 2 × PP 2 × DP 2, experts split over TP.
    let pp2 = [
        "--world-size",
        "8",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--expert-tensor-parallel-size",
        "2",
    ];
    for other in [&ep1[..], &tp2[..], &ep4[..], &etp2[..], &pp2[..]] {
        let resumed = resume(&save, 6, &[&MOE[..], other].concat(), &dir);
        assert_close_losses(&format!("{other:?}"), &resumed, &log[6..], 1e-5);
    }
    // Saved with the experts split: the experts' slices are written by their TP ranks and
    // read back whole.
    let split_save = dir.join("ckpt-etp");
    let split = split_save.to_str().unwrap();
    let saving = [&MOE[..], &etp2, &["--save", split, "--save-interval", "6"]].concat();
    let split_run = run_gpt(&args(&saving, &dir)).unwrap();
    assert_close_losses("expert TP 2", &split_run.log, log, 1e-5);
    let resumed = resume(&split_save, 6, &[&MOE[..], &ep1].concat(), &dir);
    assert_close_losses("expert TP 2 → EP 1", &resumed, &log[6..], 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// EP 2 on 4 ranks: every expert has 2 replicas (expert-DP 2), over which the distributed
/// optimizer shards the experts' state while it shards the dense state over DP 4. The
/// reduction overlapped with backward trains as the one after it.
#[test]
fn the_distributed_optimizer_shards_the_experts_and_its_checkpoints_reshard() {
    let dir = tmp("gpt-moe-zero");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let on_4 = |ep: &'static str| {
        let flags = ["--world-size", "4", "--micro-batch-size", "2"];
        [&MOE[..], &flags, &["--expert-model-parallel-size", ep]].concat()
    };
    // The fused Adam's flat shards, and burn-optim's AdamW on its pieces.
    for inner in [&["--use-fused-adam"][..], &[]] {
        let ep2 = [&on_4("2")[..], inner].concat();
        let zero = [&ep2[..], &["--use-distributed-optimizer"]].concat();
        let saving = [&zero[..], &["--save", s, "--save-interval", "6"]].concat();
        let sharded = run_gpt(&args(&saving, &dir)).unwrap().log;
        let plain = run_gpt(&args(&ep2, &dir)).unwrap().log;
        assert_close_losses(&format!("ZeRO-1 {inner:?}"), &sharded, &plain, 1e-5);
        if inner.is_empty() {
            // The dense reduction overlapped with backward: its buckets hold the dense
            // parameters only, the experts' are reduced over expert-DP after it.
            let overlapped = [&ep2[..], &["--overlap-grad-reduce"]].concat();
            let overlapped = run_gpt(&args(&overlapped, &dir)).unwrap().log;
            assert_close_losses("overlapped", &overlapped, &plain, 1e-5);
        }
        for (a, b) in sharded.iter().zip(&plain) {
            let (x, y) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
            assert!((x - y).abs() / y < 1e-5, "{inner:?}: grad norm {x} vs {y}");
        }
        // The state gathered to (expert) data-parallel rank 0 and read back into the shards.
        assert_same_iterations(&resume(&save, 6, &zero, &dir), &sharded[6..]);
        // Resharded: EP 4 (one replica per expert), and DP 2 without the distributed
        // optimizer (two micro-batches per rank: the same ones).
        let ep4 = [&on_4("4")[..], inner, &["--use-distributed-optimizer"]].concat();
        let dp2 = [&MOE[..], &["--micro-batch-size", "2"], inner].concat();
        for other in [ep4, dp2] {
            let resumed = resume(&save, 6, &other, &dir);
            assert_close_losses(&format!("{other:?}"), &resumed, &sharded[6..], 1e-5);
        }
        std::fs::remove_dir_all(&save).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_moe_flags_are_refused_before_any_work_naming_the_numbers() {
    let dir = tmp("gpt-moe-flags");
    let refused = |extra: &[&str]| run_gpt(&args(&[&MOE[..], extra].concat(), &dir)).unwrap_err();
    for (extra, want) in [
        (
            &["--num-experts", "3", "--expert-model-parallel-size", "2"][..],
            "3 experts over 2 expert-parallel ranks",
        ),
        (
            &["--moe-router-topk", "5"][..],
            "--moe-router-topk 5 is greater than --num-experts 4",
        ),
        (
            &["--expert-model-parallel-size", "4"][..],
            "world size 2 is not divisible by expert tensor (1) × expert (4) × pipeline (1) = 4",
        ),
        (
            &[
                "--moe-router-num-groups",
                "2",
                "--moe-router-group-topk",
                "3",
            ][..],
            "--moe-router-num-groups 2 and --moe-router-group-topk 3 with 4 experts",
        ),
        (&["--moe-router-num-groups", "2"][..], "go together"),
        (
            &["--expert-tensor-parallel-size", "2"][..],
            "expert tensor parallel size 2 is not supported with tensor parallel size 1",
        ),
        (
            &["--moe-expert-capacity-factor", "0"][..],
            "--moe-expert-capacity-factor must be a finite number > 0, got 0",
        ),
        (
            &["--moe-aux-loss-coeff", "nan"][..],
            "--moe-aux-loss-coeff must be a finite number ≥ 0, got NaN",
        ),
    ] {
        let e = refused(extra);
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let e = run_gpt(&args(&["--expert-model-parallel-size", "2"], &dir)).unwrap_err();
    assert!(e.contains("without --num-experts"), "{e}");
    let split = ["--world-size", "2", "--tensor-model-parallel-size", "2"];
    let split = [&split[..], &["--expert-tensor-parallel-size", "2"]].concat();
    let e = run_gpt(&args(&split, &dir)).unwrap_err();
    assert!(e.contains("without --num-experts"), "{e}");
    assert!(!dir.join("loss.png").exists(), "nothing ran");
    std::fs::remove_dir_all(&dir).unwrap();
}
