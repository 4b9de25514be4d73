//! The `train_minimal` example, as a newcomer runs it: it trains (the loss falls from the
//! uniform guess over its byte vocabulary) and its checkpoint, saved at TP 2 × PP 2 × DP 2
//! with the distributed optimizer, verifies and names the layout it was saved at.

use crate::common::{example_binary, tmp};
use burn_megatron::checkpoint::{read_latest, verify_checkpoint};

#[test]
fn train_minimal_trains_and_saves_a_checkpoint_that_verifies() {
    let dir = tmp("train-minimal");
    let out = std::process::Command::new(example_binary("train_minimal"))
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
        .filter_map(|l| l.split("lm loss ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(losses.len(), 30, "{stdout}");
    let uniform = 256f64.ln();
    assert!(
        (losses[0] - uniform).abs() < 0.3,
        "first loss {} vs ln 256",
        losses[0]
    );
    assert!(
        losses[29] < losses[0] - 2.0,
        "the loss did not fall: {losses:?}"
    );
    assert_eq!(read_latest(&dir).unwrap(), Some(30));
    let index = verify_checkpoint(&dir, 30).unwrap();
    // One directory per model-parallel rank: TP 2 × PP 2.
    assert_eq!(index.ranks.len(), 4, "{:?}", index.dir);
    let layout = index.ranks[0].1.layout;
    assert_eq!(layout.tensor_model_parallel_size, 2, "{layout:?}");
    assert_eq!(layout.pipeline_model_parallel_size, 2);
    assert_eq!(layout.data_parallel_size, 2);
    assert!(layout.distributed_optimizer);
    std::fs::remove_dir_all(&dir).unwrap();
}
