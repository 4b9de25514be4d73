//! Checkpoints that load at any layout: a run saved at TP 2 × PP 2 at iteration 10 resumes at
//! other tensor, pipeline (interleaved too) and data-parallel sizes (with and without the
//! distributed optimizer)
//! and continues the uninterrupted run's losses; and a run killed at any step of a save
//! resumes the last complete checkpoint exactly.

use crate::common::{args, argv, assert_same_iterations, binary, sop, tmp};
use burn_megatron::checkpoint::{
    CRASH_AT, CheckpointIndex, iteration_dir, read_latest, verify_checkpoint,
};
use burn_megatron_examples::pretrain::{IterationLog, read_log_json, run};
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
            for (x, y) in [(a.lm_loss, b.lm_loss), (sop(a), sop(b))] {
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

/// Every global tensor of every state set of two checkpoints, compared bit for bit, and
/// their training states. A checkpoint of an FP32 model around burn-optim without the
/// distributed optimizer keeps no master weights: its weights stand for them.
fn assert_same_state(what: &str, a: &Path, b: &Path) {
    let (a, b) = (
        CheckpointIndex::read(a).unwrap(),
        CheckpointIndex::read(b).unwrap(),
    );
    let (sa, sb) = (a.state(), b.state());
    assert_eq!(
        (
            sa.iteration,
            &sa.grad_scaler,
            sa.fused_adam_steps,
            &sa.extra
        ),
        (
            sb.iteration,
            &sb.grad_scaler,
            sb.fused_adam_steps,
            &sb.extra
        ),
        "{what}: training state"
    );
    let scalars = |i: &CheckpointIndex| {
        let mut all = std::collections::BTreeMap::new();
        for (_, r) in &i.ranks {
            all.extend(r.optimizer_scalars.clone());
        }
        all
    };
    assert_eq!(scalars(&a), scalars(&b), "{what}: optimizer scalars");
    // A checkpoint without master weights has its weights stand for them.
    let (own_a, own_b) = (a.sets(), b.sets());
    let with_master = |own: &[String]| {
        let mut sets = own.to_vec();
        if !sets.iter().any(|s| s == "master") {
            sets.push("master".into());
            sets.sort();
        }
        sets
    };
    let sets = with_master(&own_a);
    assert_eq!(sets, with_master(&own_b), "{what}: state sets");
    let source = |own: &[String], set: &str| -> String {
        if own.iter().any(|s| s == set) {
            set.to_string()
        } else {
            "model".to_string()
        }
    };
    let mut tensors = 0;
    for set in &sets {
        let (from_a, from_b) = (source(&own_a, set), source(&own_b, set));
        let names = a.tensor_names(&from_a);
        assert_eq!(names, b.tensor_names(&from_b), "{what}: {set} names");
        for name in &names {
            let x = a.read_tensor(&from_a, name).unwrap();
            let y = b.read_tensor(&from_b, name).unwrap();
            assert_eq!(
                (x.dtype(), x.shape().to_vec()),
                (y.dtype(), y.shape().to_vec()),
                "{what}: {set} {name}"
            );
            assert!(x.as_bytes() == y.as_bytes(), "{what}: {set} {name} differs");
            tensors += 1;
        }
    }
    assert!(tensors > 30, "{what}: only {tensors} tensors compared");
}

/// Both optimizers, with and without the distributed optimizer on either side, in f32 and
/// bf16: a checkpoint saved at one layout loads at another with its whole state (weights,
/// master weights, moments, step counters) bit for bit — loaded and saved again at the new
/// layout it holds the same global tensors — and training continues the uninterrupted run.
#[test]
fn every_optimizer_state_reshards_exactly_across_layouts() {
    let dir = tmp("reshard-matrix");
    // Save at TP 2 × PP 2 (or × DP 2 sharded), load at TP 1 × PP 2 (or × DP 2 sharded).
    let at = |tp: usize, pp: usize, world: usize, fused: bool, bf16: bool, zero: bool| {
        let mut f: Vec<String> = flags(tp, pp, world)
            .into_iter()
            .filter(|a| fused || a != "--use-fused-adam")
            .collect();
        if bf16 {
            f.push("--bf16".into());
        }
        if zero {
            f.push("--use-distributed-optimizer".into());
        }
        f
    };
    let mut report = Vec::new();
    for fused in [true, false] {
        for bf16 in [false, true] {
            for save_zero in [false, true] {
                let save = dir.join(format!("save-{fused}-{bf16}-{save_zero}"));
                let s = save.to_str().unwrap();
                let (tp, pp) = if save_zero { (2, 1) } else { (2, 2) };
                let full = train(
                    &dir,
                    at(tp, pp, 4, fused, bf16, save_zero),
                    &["--save", s, "--save-interval", "10"],
                );
                for load_zero in [false, true] {
                    let (tp2, pp2) = if load_zero { (1, 1) } else { (1, 2) };
                    let what = format!(
                        "{} {} TP {tp} × PP {pp}{} → TP {tp2} × PP {pp2}{}",
                        if fused { "fused Adam" } else { "AdamW" },
                        if bf16 { "bf16" } else { "f32" },
                        if save_zero { " ZeRO-1" } else { "" },
                        if load_zero { " ZeRO-1" } else { "" },
                    );
                    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "10").unwrap();
                    let again = dir.join(format!("again-{fused}-{bf16}-{save_zero}-{load_zero}"));
                    let a = again.to_str().unwrap();
                    let f = at(tp2, pp2, 2, fused, bf16, load_zero);
                    let none = train(
                        &dir,
                        f.clone(),
                        &["--load", s, "--train-iters", "10", "--save", a],
                    );
                    assert!(none.is_empty(), "{what}: trained while resharding");
                    assert_same_state(&what, &iteration_dir(&save, 10), &iteration_dir(&again, 10));
                    let resumed = train(&dir, f, &["--load", s]);
                    assert_eq!(resumed.len(), 10, "{what}");
                    let worst = resumed
                        .iter()
                        .zip(&full[10..])
                        .flat_map(|(x, y)| [(x.lm_loss - y.lm_loss).abs(), (sop(x) - sop(y)).abs()])
                        .fold(0.0, f64::max);
                    report.push((what, bf16, worst));
                }
            }
        }
    }
    for (what, bf16, worst) in &report {
        println!(
            "{what}: state bit-identical; iterations 11–20 within {worst:.1e} of the uninterrupted run"
        );
        // The new layout sums in another order from the first step on (f32: up to 4.8e-7
        // measured); in bf16 a flipped rounding of a weight is carried by the later steps
        // (up to 5.9e-4 measured). The state itself is exact, above.
        let bound = if *bf16 { 2e-3 } else { 2e-6 };
        assert!(*worst < bound, "{what}: {worst}");
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
