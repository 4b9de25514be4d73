use super::*;
use crate::comm::{CommunicatorExt, ReduceOp};
use std::time::Instant;

fn opts() -> LaunchOptions {
    LaunchOptions::default().with_timeout(Duration::from_secs(2))
}

#[test]
fn every_rank_runs_with_its_state_and_groups() {
    let config = ParallelConfig::new(8, 2, 2);
    let out = threads(&config, opts(), |ctx| {
        let s = &ctx.state;
        let mut tp = vec![s.global_rank() as i64];
        ctx.groups.tp.all_reduce_vec(&mut tp, ReduceOp::Sum)?;
        let dp = ctx.groups.dp.all_gather_vec(vec![s.global_rank() as i32])?;
        let pp = ctx.groups.pp.all_gather_vec(vec![s.global_rank() as i32])?;
        let embd = ctx.groups.embedding.is_some();
        Ok::<_, CommError>((s.global_rank(), tp[0], dp, pp, embd))
    })
    .unwrap();
    // world 8, tp 2, pp 2, dp 2: tp [[0,1],[2,3],..], dp [[0,2],[1,3],[4,6],[5,7]],
    // pp [[0,4],[1,5],[2,6],[3,7]]; with pp = 2 every rank is a first or last stage.
    let tp_sums = [1, 1, 5, 5, 9, 9, 13, 13];
    let dp = [
        [0, 2],
        [1, 3],
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [4, 6],
        [5, 7],
    ];
    let pp = [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ];
    for (rank, (g, tp, d, p, embd)) in out.into_iter().enumerate() {
        assert_eq!(g, rank);
        assert_eq!(tp, tp_sums[rank]);
        assert_eq!(d, dp[rank].to_vec());
        assert_eq!(p, pp[rank].to_vec());
        assert!(embd);
    }
}

#[test]
fn middle_pipeline_stages_have_no_embedding_group() {
    let out = threads(&ParallelConfig::new(4, 1, 4), opts(), |ctx| {
        Ok::<_, CommError>((
            ctx.groups.embedding.is_some(),
            ctx.groups.position_embedding.is_some(),
        ))
    })
    .unwrap();
    assert_eq!(
        out,
        vec![(true, true), (false, false), (false, false), (true, false)]
    );
}

#[test]
fn invalid_layout_is_rejected_before_any_rank_starts() {
    let started = std::sync::atomic::AtomicUsize::new(0);
    let err = threads(&ParallelConfig::new(6, 4, 1), opts(), |_| {
        started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, CommError>(())
    })
    .unwrap_err();
    assert!(matches!(err, LaunchError::Topology(_)));
    assert!(err.to_string().contains("world size 6"), "{err}");
    assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[test]
fn first_error_is_returned_with_its_rank_and_peers_do_not_hang() {
    let start = Instant::now();
    let config = ParallelConfig::new(4, 2, 1);
    let err = threads(
        &config,
        LaunchOptions::default().with_timeout(Duration::from_secs(60)),
        |ctx| {
            if ctx.state.global_rank() == 2 {
                return Err("bad batch".to_string());
            }
            ctx.groups.world.barrier().map_err(|e| e.to_string())
        },
    )
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    match err {
        LaunchError::Failed { rank, error } => {
            assert_eq!(rank, 2);
            assert_eq!(error, "bad batch");
        }
        e => panic!("unexpected {e}"),
    }
}

#[test]
fn panicking_rank_is_reported_and_peers_fail_promptly() {
    let start = Instant::now();
    let config = ParallelConfig::new(2, 2, 1);
    let err = threads(
        &config,
        LaunchOptions::default().with_timeout(Duration::from_secs(60)),
        |ctx| {
            if ctx.state.global_rank() == 1 {
                panic!("shape mismatch in layer 3");
            }
            let mut v = vec![1.0f32];
            ctx.groups.tp.all_reduce_vec(&mut v, ReduceOp::Sum)
        },
    )
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(
        matches!(&err, LaunchError::Panicked { rank: 1, message } if message.contains("layer 3")),
        "{err}"
    );
}

mod env;
