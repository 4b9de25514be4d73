use super::*;
use crate::checkpoint::read_latest;
use crate::launch::{LaunchOptions, threads};
use crate::tensor_parallel::{ColumnParallelLinear, ColumnParallelLinearConfig};
use crate::topology::ParallelConfig;
use burn::optim::SgdConfig;

fn names() -> GlobalNames {
    Arc::new(|p: &str| p.to_string())
}

/// TP 2 × DP 2: each rank saves under `root(rank)`; returns each rank's result as text.
fn save_with(root: impl Fn(usize) -> std::path::PathBuf + Sync) -> Vec<Result<(), String>> {
    threads(
        &ParallelConfig::new(4, 2, 1),
        LaunchOptions::default(),
        |ctx| {
            let chunk = ColumnParallelLinearConfig::new(4, 4)
                .init(&ctx.groups.tp, &ctx.device)
                .map_err(|e| e.to_string())?;
            let chunks: Vec<ColumnParallelLinear> = vec![chunk];
            let training = ParallelTrainingConfig::new()
                .with_use_distributed_optimizer(true)
                .init(&ctx, &chunks, names())
                .map_err(|e| e.to_string())?;
            let optim = training
                .optimizer(InnerOptimizer::from(SgdConfig::new().init()), &chunks)
                .map_err(|e| e.to_string())?;
            let root = root(ctx.state.global_rank());
            Ok::<_, String>(
                training
                    .save(&root, 3, &chunks, &optim, serde_json::Value::Null)
                    .map_err(|e| e.to_string()),
            )
        },
    )
    .unwrap()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bm-training-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// One call per rank saves, commits and makes the iteration `latest`.
#[test]
fn save_runs_the_whole_protocol() {
    let root = tmp("save");
    for r in save_with(|_| root.clone()) {
        r.unwrap();
    }
    assert_eq!(read_latest(&root).unwrap(), Some(3));
    std::fs::remove_dir_all(&root).unwrap();
}

/// A rank that cannot write fails the save on every rank, and nothing is committed.
#[test]
fn one_rank_failing_to_write_fails_the_save_everywhere() {
    let root = tmp("one-fails");
    // Global rank 1 (TP 1, DP 0: it writes) saves under a regular file: it cannot make its
    // directory.
    std::fs::create_dir_all(&root).unwrap();
    let blocker = root.join("file");
    std::fs::write(&blocker, b"not a directory").unwrap();
    let results = save_with(|rank| {
        if rank == 1 {
            blocker.clone()
        } else {
            root.clone()
        }
    });
    for (rank, r) in results.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        if rank == 1 {
            assert!(e.contains("file"), "rank {rank}: {e}");
        } else {
            assert!(
                e.contains("another rank failed while writing"),
                "rank {rank}: {e}"
            );
        }
    }
    assert_eq!(
        read_latest(&root).unwrap(),
        None,
        "committed without rank 1's shards"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
