//! Calls that cannot complete: mismatched operations, counts, dtypes and roots, a missing
//! peer, a failed one. Each is an error on every member within its deadline, never a hang.

use super::*;

/// A timeout far above what detecting a mismatch takes, even on a loaded machine: a call
/// that returns before half of it did not wait for it.
const LONG: Duration = Duration::from_secs(60);

#[test]
fn mismatched_ops_fail_on_every_member() {
    let start = Instant::now();
    let out = run(3, LONG, |rank, world| {
        let comm = world.communicator("tp", all(3), rank).unwrap();
        match rank {
            0 => comm.all_reduce(&mut Buffer::from(vec![1.0f32; 4]), ReduceOp::Sum),
            1 => comm.all_gather(Buffer::from(vec![1.0f32; 4])).map(|_| ()),
            _ => comm.all_reduce(&mut Buffer::from(vec![1.0f32; 4]), ReduceOp::Sum),
        }
    });
    assert!(
        start.elapsed() < LONG / 2,
        "mismatch must not wait for the timeout"
    );
    for r in out {
        let err = r.unwrap_err();
        assert!(matches!(err, CommError::Mismatch { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("'tp' [0, 1, 2]") && msg.contains("all_gather"),
            "{msg}"
        );
    }
}

#[test]
fn mismatched_count_dtype_and_root_are_errors() {
    type Case = fn(usize, &LocalCommunicator) -> Result<(), CommError>;
    let cases: [(Case, &str); 3] = [
        (
            |rank, c| c.all_reduce(&mut Buffer::zeros(CommDType::F32, 4 + rank), ReduceOp::Sum),
            "f32 × 5",
        ),
        (
            |rank, c| {
                let dtype = if rank == 0 {
                    CommDType::F16
                } else {
                    CommDType::BF16
                };
                c.all_gather(Buffer::zeros(dtype, 2)).map(|_| ())
            },
            "bf16 × 2",
        ),
        (
            |rank, c| c.broadcast(&mut Buffer::zeros(CommDType::I32, 1), rank),
            "root 1",
        ),
    ];
    for (case, needle) in cases {
        let start = Instant::now();
        let out = run(2, LONG, move |rank, world| {
            let comm = world.communicator("dp", all(2), rank).unwrap();
            case(rank, &comm)
        });
        assert!(
            start.elapsed() < LONG / 2,
            "mismatch must not wait for the timeout"
        );
        for r in out {
            let msg = r.unwrap_err().to_string();
            assert!(msg.contains("mismatch") && msg.contains(needle), "{msg}");
        }
    }
}

#[test]
fn missing_peer_times_out_naming_it() {
    let start = Instant::now();
    let out = run(3, Duration::from_millis(300), |rank, world| {
        let comm = world.communicator("dp", all(3), rank).unwrap();
        if rank == 2 {
            return Ok(()); // never joins, never reports exiting
        }
        comm.barrier()
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    for r in &out[..2] {
        match r.as_ref().unwrap_err() {
            CommError::Timeout { missing, op, .. } => {
                assert_eq!(*op, "barrier");
                assert_eq!(*missing, vec![2]);
            }
            e => panic!("expected a timeout, got {e}"),
        }
    }
}

#[test]
fn failed_peer_aborts_waiting_ranks_promptly() {
    let start = Instant::now();
    let out = run(4, Duration::from_secs(30), |rank, world| {
        let comm = world.communicator("tp", all(4), rank).unwrap();
        if rank == 3 {
            std::thread::sleep(Duration::from_millis(50));
            world.abort(3, "out of memory");
            return None;
        }
        Some(comm.all_reduce(&mut Buffer::zeros(CommDType::F32, 8), ReduceOp::Sum))
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "must not wait for the 30 s timeout"
    );
    for r in out.into_iter().flatten() {
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("global rank 3 failed: out of memory"), "{msg}");
    }
}

#[test]
fn exited_peer_fails_collectives_and_receives() {
    let start = Instant::now();
    let out = run(2, Duration::from_secs(30), |rank, world| {
        let comm = world.communicator("pp", all(2), rank).unwrap();
        if rank == 1 {
            world.mark_exited(1);
            return None;
        }
        let r1 = comm.recv(&mut Buffer::zeros(CommDType::I64, 1), 1);
        let r2 = comm.barrier();
        Some((r1, r2))
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let (r1, r2) = out[0].clone().unwrap();
    for r in [r1, r2] {
        assert!(
            matches!(r, Err(CommError::PeerExited { rank: 1, .. })),
            "{r:?}"
        );
    }
}

#[test]
fn recv_of_wrong_shape_is_a_mismatch() {
    let out = run(2, T2, |rank, world| {
        let comm = world.communicator("pp", all(2), rank).unwrap();
        if rank == 0 {
            comm.send(Buffer::from(vec![1.0f32; 3]), 1)
        } else {
            comm.recv(&mut Buffer::zeros(CommDType::F32, 4), 0)
        }
    });
    let msg = out[1].clone().unwrap_err().to_string();
    assert!(
        msg.contains("sent f32 × 3") && msg.contains("expected f32 × 4"),
        "{msg}"
    );
}

#[test]
fn invalid_groups_and_peers_are_rejected() {
    let world = LocalWorld::new(2);
    let e = world
        .communicator("g", vec![0, 0], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("distinct"), "{e}");
    let e = world
        .communicator("g", vec![0, 1], 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 5 is not a member"), "{e}");
    let e = world
        .communicator("g", vec![0, 2], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the world of 2"), "{e}");
    let comm = world.communicator("g", vec![0, 1], 0).unwrap();
    let e = comm
        .send(Buffer::zeros(CommDType::F32, 1), 7)
        .unwrap_err()
        .to_string();
    assert!(e.contains("peer 7"), "{e}");
}
