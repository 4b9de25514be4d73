//! The smallest training loops, as a newcomer runs them: `train_minimal` (the built-in GPT at
//! TP 2 × PP 2 × DP 2), `train_dropin` (a Burn user's language model at TP 2 × DP 2) and
//! `train_cnn` (a Burn user's CNN at DP 2). Each trains (the loss falls from the uniform guess
//! over its byte vocabulary or its classes) and its checkpoint, saved with the distributed
//! optimizer, verifies and names the layout it was saved at.

use crate::common::{example_binary, tmp};
use burn_megatron::checkpoint::{read_latest, verify_checkpoint};

/// Runs `example` with a checkpoint directory and checks its 30 iterations and checkpoint:
/// `tp` × `pp` × `dp`, the loss starting at the uniform guess over `classes` and down by
/// `fall` at least. Returns what it printed.
fn trains_and_saves(
    example: &str,
    (tp, pp, dp): (usize, usize, usize),
    classes: usize,
    fall: f64,
) -> String {
    let dir = tmp(example);
    let out = std::process::Command::new(example_binary(example))
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "iteration   1 | lm loss 5.5265 | grad norm 2.929"
    let losses: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with("iteration"))
        .filter_map(|l| l.split("loss ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(losses.len(), 30, "{stdout}");
    let uniform = (classes as f64).ln();
    assert!(
        (losses[0] - uniform).abs() < 0.3,
        "{example}: first loss {} vs ln {classes}",
        losses[0]
    );
    assert!(
        losses[29] < losses[0] - fall,
        "{example}: the loss did not fall: {losses:?}"
    );
    assert_eq!(read_latest(&dir).unwrap(), Some(30));
    let index = verify_checkpoint(&dir, 30).unwrap();
    // One directory per model-parallel rank.
    assert_eq!(index.ranks.len(), tp * pp, "{:?}", index.dir);
    let layout = index.ranks[0].1.layout;
    assert_eq!(layout.tensor_model_parallel_size, tp, "{layout:?}");
    assert_eq!(layout.pipeline_model_parallel_size, pp);
    assert_eq!(layout.data_parallel_size, dp);
    assert!(layout.distributed_optimizer);
    std::fs::remove_dir_all(&dir).unwrap();
    stdout.into_owned()
}

#[test]
fn train_minimal_trains_and_saves_a_checkpoint_that_verifies() {
    trains_and_saves("train_minimal", (2, 2, 2), 256, 2.0);
}

#[test]
fn train_dropin_trains_and_saves_a_checkpoint_that_verifies() {
    trains_and_saves("train_dropin", (2, 1, 2), 256, 2.0);
}

#[test]
fn train_cnn_trains_and_saves_a_checkpoint_that_verifies() {
    let stdout = trains_and_saves("train_cnn", (1, 1, 2), 4, 0.5);
    // "held-out accuracy 64/64": evaluated with the synchronised running statistics.
    let right: usize = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("held-out accuracy ")?
                .split('/')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no accuracy in {stdout}"));
    assert!(right >= 48, "{right}/64 right: {stdout}");
}
