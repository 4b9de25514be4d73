//! Checkpoints that load at any layout: a run saved at TP 2 × PP 2 at iteration 10 resumes at
//! other tensor, pipeline (interleaved too) and data-parallel sizes (with and without the
//! distributed optimizer)
//! and continues the uninterrupted run's losses.

mod common;

use burn_megatron_examples::pretrain::{IterationLog, run};
use common::{args, assert_same_iterations, tmp};

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
