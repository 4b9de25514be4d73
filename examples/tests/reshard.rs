//! Checkpoints that load at any layout: a run saved at TP 2 × PP 2 at iteration 10 resumes at
//! other tensor, pipeline (interleaved too) and data-parallel sizes (with and without the
//! distributed optimizer)
//! and continues the uninterrupted run's losses; and a run killed at any step of a save
//! resumes the last complete checkpoint exactly.

mod common;

use burn_megatron::checkpoint::{CRASH_AT, iteration_dir, read_latest, verify_checkpoint};
use burn_megatron_examples::pretrain::{IterationLog, read_log_json, run};
use common::{args, argv, assert_same_iterations, binary, tmp};
use std::path::Path;

/// Four layers and four heads (so TP 4 and PP 4 fit), dropout off, a vocabulary padded to
/// the same 192 rows at TP 1, 2 and 4 (multiples of 16 × TP).
fn flags(tp: usize, pp: usize, world: usize) -> Vec<String> {
    [
        "--tensor-model-parallel-size",
        &tp.to_string(),
        "--pipeline-model-parallel-size",
        &pp.to_string(),
        "--world-size",
        &world.to_string(),
        "--num-layers",
        "4",
        "--num-attention-heads",
        "4",
        "--make-vocab-size-divisible-by",
        "16",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--use-fused-adam",
        "--train-iters",
        "20",
        "--eval-interval",
        "0",
    ]
    .map(String::from)
    .to_vec()
}

fn train(dir: &std::path::Path, f: Vec<String>, extra: &[&str]) -> Vec<IterationLog> {
    let mut all: Vec<&str> = f.iter().map(String::as_str).collect();
    all.extend_from_slice(extra);
    run(&args(&all, dir)).unwrap().log
}

#[test]
fn a_tp2_pp2_checkpoint_resumes_at_every_other_layout() {
    let dir = tmp("reshard");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let full = train(
        &dir,
        flags(2, 2, 4),
        &["--save", s, "--save-interval", "10"],
    );
    assert_eq!(full.len(), 20);
    let from_10 = |f: Vec<String>, extra: &[&str]| {
        std::fs::write(save.join("latest_checkpointed_iteration.txt"), "10").unwrap();
        train(&dir, f, &[&["--load", s][..], extra].concat())
    };
    // The same layout: bit for bit.
    assert_same_iterations(&from_10(flags(2, 2, 4), &[]), &full[10..]);
    for (tp, pp, world, extra) in [
        (1, 1, 1, &[][..]),
        (4, 1, 4, &[]),
        (1, 4, 4, &[]),
        (2, 1, 4, &["--use-distributed-optimizer"]),
        // Interleaved: two chunks of one layer per stage.
        (1, 2, 2, &["--num-layers-per-virtual-pipeline-stage", "1"]),
    ] {
        let what = format!("TP {tp} × PP {pp} × DP {} {extra:?}", world / (tp * pp));
        let resumed = from_10(flags(tp, pp, world), extra);
        assert_eq!(resumed.len(), 10, "{what}");
        let mut worst: f64 = 0.0;
        for (a, b) in resumed.iter().zip(&full[10..]) {
            assert_eq!(a.iteration, b.iteration, "{what}");
            for (x, y) in [(a.lm_loss, b.lm_loss), (a.sop_loss, b.sop_loss)] {
                worst = worst.max((x - y).abs());
                assert!(
                    (x - y).abs() < 1e-5,
                    "{what}, iteration {}: {x} vs {y}",
                    a.iteration
                );
            }
        }
        println!(
            "{what}: iterations 11–20 within {worst:.1e} of the uninterrupted TP 2 × PP 2 run"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint with the distributed optimizer's state (saved whole) resumes without it, at
/// another layout.
#[test]
fn a_distributed_optimizer_checkpoint_resumes_without_it_elsewhere() {
    let dir = tmp("reshard-zero");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let full = train(
        &dir,
        flags(1, 1, 2),
        &[
            "--use-distributed-optimizer",
            "--save",
            s,
            "--save-interval",
            "10",
        ],
    );
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "10").unwrap();
    let resumed = train(&dir, flags(2, 2, 4), &["--load", s]);
    assert_eq!(resumed.len(), 10);
    for (a, b) in resumed.iter().zip(&full[10..]) {
        assert!(
            (a.lm_loss - b.lm_loss).abs() < 1e-5,
            "iteration {}: {} vs {}",
            a.iteration,
            a.lm_loss,
            b.lm_loss
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// burn-optim's AdamW: its moments and step counters are stored by global name too.
#[test]
fn adamws_state_reshards_with_the_weights() {
    let dir = tmp("reshard-adamw");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    let adamw = |f: Vec<String>| -> Vec<String> {
        f.into_iter().filter(|a| a != "--use-fused-adam").collect()
    };
    let full = train(
        &dir,
        adamw(flags(2, 2, 4)),
        &["--save", s, "--save-interval", "10"],
    );
    for (tp, pp, world) in [(2, 2, 4), (1, 1, 1), (4, 1, 4)] {
        std::fs::write(save.join("latest_checkpointed_iteration.txt"), "10").unwrap();
        let resumed = train(&dir, adamw(flags(tp, pp, world)), &["--load", s]);
        assert_eq!(resumed.len(), 10);
        for (a, b) in resumed.iter().zip(&full[10..]) {
            let at = format!("TP {tp} × PP {pp}, iteration {}", a.iteration);
            assert!(
                (a.lm_loss - b.lm_loss).abs() < 1e-5,
                "{at}: {} vs {}",
                a.lm_loss,
                b.lm_loss
            );
            if (tp, pp) == (2, 2) {
                assert_eq!(a.lm_loss.to_bits(), b.lm_loss.to_bits(), "{at}: not exact");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The binary killed (SIGKILL, through the checkpoint code's test hook) at each step of the
/// save protocol of iteration 4 leaves a directory from which `--load` resumes the last
/// complete checkpoint and continues the uninterrupted run bit for bit. A re-save of an
/// iteration `latest` names, killed once the old copy is renamed aside, resumes from that
/// copy.
#[test]
fn a_run_killed_at_any_step_of_a_save_resumes_exactly() {
    let bin = binary();
    let dir = tmp("crash");
    let base = [
        "--world-size",
        "2",
        "--train-iters",
        "6",
        "--eval-interval",
        "0",
        "--save-interval",
        "2",
        "--log-interval",
        "1",
    ];
    let launch = |ckpt: &Path, extra: &[&str], crash: Option<&str>| {
        let log = dir.join("log.jsonl");
        let _ = std::fs::remove_file(&log);
        let (c, l) = (ckpt.to_str().unwrap(), log.to_str().unwrap());
        let all = argv(
            &[&base[..], &["--save", c, "--log-json", l], extra].concat(),
            &dir,
        );
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(&all[1..]).env_remove(CRASH_AT);
        if let Some(point) = crash {
            cmd.env(CRASH_AT, point);
        }
        let out = cmd.output().unwrap();
        (out, log)
    };
    let finished = |out: &std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let killed = |out: &std::process::Output, point: &str| {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(9), "{point}: {:?}", out.status);
    };
    let resume_and_compare = |ckpt: &Path, from: usize, reference: &[IterationLog], what: &str| {
        let (out, log) = launch(ckpt, &["--load", ckpt.to_str().unwrap()], None);
        finished(&out);
        let resumed = read_log_json(&log).unwrap();
        assert_eq!(
            resumed.first().map(|e| e.iteration),
            Some(from + 1),
            "{what}"
        );
        assert_same_iterations(&resumed, &reference[from..]);
        // The resumed run's own saves completed: every checkpoint verifies, none is aside.
        assert_eq!(read_latest(ckpt).unwrap(), Some(6), "{what}");
        for it in [2, 4, 6] {
            verify_checkpoint(ckpt, it).unwrap();
        }
        let left: Vec<String> = std::fs::read_dir(ckpt)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".old") || n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{what}: {left:?}");
    };
    let reference_ckpt = dir.join("reference");
    let (out, log) = launch(&reference_ckpt, &[], None);
    finished(&out);
    let reference = read_log_json(&log).unwrap();
    assert_eq!(reference.len(), 6);
    // Killed before `latest` names iteration 4, the run resumes from 2; after, from 4.
    for (point, from) in [
        ("shard", 2),
        ("saved", 2),
        ("sealed", 2),
        ("renamed", 2),
        ("latest", 2),
        ("committed", 4),
    ] {
        let ckpt = dir.join(point);
        let (out, _) = launch(&ckpt, &[], Some(&format!("{point}@4")));
        killed(&out, point);
        assert_eq!(read_latest(&ckpt).unwrap(), Some(from), "{point}");
        resume_and_compare(&ckpt, from, &reference, point);
    }
    // Iteration 4 re-saved while `latest` names it (a run restarted at --ckpt-step 2),
    // killed with the old copy renamed aside: only `iter_0000004.old` holds iteration 4.
    std::fs::write(
        reference_ckpt.join("latest_checkpointed_iteration.txt"),
        "4",
    )
    .unwrap();
    let c = reference_ckpt.to_str().unwrap();
    let (out, _) = launch(
        &reference_ckpt,
        &["--load", c, "--ckpt-step", "2"],
        Some("aside@4"),
    );
    killed(&out, "aside");
    assert!(!iteration_dir(&reference_ckpt, 4).exists());
    resume_and_compare(&reference_ckpt, 4, &reference, "aside");
    // A newest checkpoint that does not verify: `--load` falls back to the one before,
    // naming what failed; `--ckpt-step` to it is an error.
    let shard = iteration_dir(&reference_ckpt, 6).join("mp_rank_01/model.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let e = run(&args(
        &[&base[..], &["--load", c, "--ckpt-step", "6"]].concat(),
        &dir,
    ))
    .unwrap_err();
    assert!(
        e.contains("mp_rank_01/model.safetensors") && e.contains("corrupted"),
        "{e}"
    );
    std::fs::write(
        reference_ckpt.join("latest_checkpointed_iteration.txt"),
        "6",
    )
    .unwrap();
    let (out, log) = launch(&reference_ckpt, &["--load", c], None);
    finished(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("checkpoint iteration 6 does not verify")
            && stderr.contains("model.safetensors"),
        "{stderr}"
    );
    assert_same_iterations(&read_log_json(&log).unwrap(), &reference[4..]);
    verify_checkpoint(&reference_ckpt, 6).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
