use crate::comm::{Buffer, Communicator, LocalWorld};
use std::time::Duration;

fn run<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize, LocalWorld) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let world = LocalWorld::with_timeout(n, Duration::from_secs(5));
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (world, f) = (world.clone(), f.clone());
            std::thread::spawn(move || f(rank, world))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Member `i` sends `i + j` elements (valued 100·i + j) to member `j`.
#[test]
fn each_member_receives_its_pieces_in_group_order() {
    for n in [1, 2, 3, 4] {
        let out = run(n, move |rank, world| {
            let comm = world.communicator("ep", (0..n).collect(), rank).unwrap();
            let send: Vec<usize> = (0..n).map(|j| rank + j).collect();
            let recv: Vec<usize> = (0..n).map(|i| i + rank).collect();
            let input: Vec<f32> = (0..n)
                .flat_map(|j| std::iter::repeat_n((100 * rank + j) as f32, rank + j))
                .collect();
            comm.all_to_all_v(Buffer::from(input), &send, &recv)
                .unwrap()
        });
        for (rank, got) in out.into_iter().enumerate() {
            let expected: Vec<f32> = (0..n)
                .flat_map(|i| std::iter::repeat_n((100 * i + rank) as f32, i + rank))
                .collect();
            assert_eq!(got, Buffer::from(expected), "rank {rank} of {n}");
        }
    }
}

#[test]
fn disagreeing_counts_and_dtypes_fail_on_every_member() {
    let out = run(2, |rank, world| {
        let comm = world.communicator("ep", vec![0, 1], rank).unwrap();
        // Rank 0 sends 2 to rank 1, which expects 3.
        let (input, recv) = if rank == 0 { (3, [1, 1]) } else { (2, [3, 1]) };
        let send = if rank == 0 { [1, 2] } else { [1, 1] };
        comm.all_to_all_v(Buffer::from(vec![0.0f32; input]), &send, &recv)
            .map(|_| ())
    });
    for r in &out {
        let msg = r.as_ref().unwrap_err().to_string();
        assert!(
            msg.contains("global rank 0 sends 2 elements to global rank 1, which expects 3"),
            "{msg}"
        );
    }
    let out = run(2, |rank, world| {
        let comm = world.communicator("ep", vec![0, 1], rank).unwrap();
        let input = if rank == 0 {
            Buffer::from(vec![0.0f32; 2])
        } else {
            Buffer::from(vec![0i64; 2])
        };
        comm.all_to_all_v(input, &[1, 1], &[1, 1]).map(|_| ())
    });
    assert!(
        out.iter()
            .all(|r| r.as_ref().unwrap_err().to_string().contains("sends"))
    );
    let solo = LocalWorld::new(1);
    let comm = solo.communicator("ep", vec![0], 0).unwrap();
    let err = comm
        .all_to_all_v(Buffer::from(vec![0.0f32; 3]), &[2], &[2])
        .unwrap_err();
    assert!(
        err.to_string().contains("add up to 2, the input holds 3"),
        "{err}"
    );
    let err = comm
        .all_to_all_v(Buffer::from(vec![0.0f32; 3]), &[3, 0], &[3])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("2 send and 1 receive counts for a group of 1"),
        "{err}"
    );
}

/// An empty piece travels as no message, so that members taking the host path and members
/// taking the device path (which skips empty pieces) stay in step: rank 1 here takes the
/// device path's steps by hand (the count agreement, then only its non-empty pieces), and
/// after an all-to-all in which rank 0 sends it nothing, the next message it takes from rank 0
/// is the one sent after it.
#[test]
fn empty_pieces_send_no_message() {
    use super::{agree, starts};
    use crate::comm::CommDType;
    let out = run(2, |rank, world| {
        let comm = world.communicator("ep", vec![0, 1], rank).unwrap();
        if rank == 0 {
            let got = comm
                .all_to_all_v(Buffer::from(vec![0.0f32]), &[1, 0], &[1, 2])
                .unwrap();
            comm.send(Buffer::from(vec![42.0f32]), 1).unwrap();
            return got;
        }
        let (send, recv) = ([2, 0], [0, 0]);
        agree(&comm, CommDType::F32, &send, &recv).unwrap();
        assert_eq!(starts(&send), [0, 2]);
        comm.send(Buffer::from(vec![1.0f32; 2]), 0).unwrap();
        let mut next = Buffer::from(vec![0.0f32]);
        comm.recv(&mut next, 0).unwrap();
        next
    });
    assert_eq!(out[0], Buffer::from(vec![0.0f32, 1.0, 1.0]));
    assert_eq!(out[1], Buffer::from(vec![42.0f32]));
}
