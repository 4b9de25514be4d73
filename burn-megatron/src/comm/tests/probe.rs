//! `Probed` passes every call on unchanged and shows each one, once, with what this member
//! hands to it.

use super::super::*;
use super::{T2, all, run};
use std::sync::{Arc, Mutex};

#[test]
fn a_probed_group_computes_what_its_inner_one_does_and_shows_each_call() {
    let out = run(2, T2, |rank, world| {
        let inner: Comm = Arc::new(world.communicator("tp", all(2), rank).unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let comm = Probed::new(inner, move |call| {
            let entry = (call.op, call.elements, call.bytes, call.peer);
            log.lock().unwrap().push(entry)
        });
        let mut sum = Buffer::from(vec![rank as f32 + 1.0; 3]);
        comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        let gathered = comm.all_gather(Buffer::from(vec![rank as i64])).unwrap();
        let mut in_place = Buffer::from(vec![rank as f32; 4]);
        comm.all_gather_in_place(&mut in_place).unwrap();
        let mut input = Buffer::from(vec![1.0f32; 4]);
        let mut chunk = Buffer::from(Vec::<f32>::new());
        comm.reduce_scatter_into(&mut input, ReduceOp::Sum, &mut chunk)
            .unwrap();
        let mut got = Buffer::from(vec![0.0f32; 2]);
        let peer = 1 - rank;
        comm.connect(&[peer]).unwrap();
        comm.send_recv(Buffer::from(vec![rank as f32; 2]), peer, &mut got, peer)
            .unwrap();
        let moved = comm
            .all_to_all_v(Buffer::from(vec![rank as f32; 2]), &[1, 1], &[1, 1])
            .unwrap();
        comm.barrier().unwrap();
        let results = (sum, gathered, in_place, chunk, got, moved);
        (results, seen.lock().unwrap().clone())
    });
    for (rank, ((sum, gathered, in_place, chunk, got, moved), seen)) in out.into_iter().enumerate()
    {
        let other = (1 - rank) as f32;
        assert_eq!(sum, Buffer::from(vec![3.0f32; 3]));
        assert_eq!(gathered, Buffer::from(vec![0i64, 1]));
        assert_eq!(in_place, Buffer::from(vec![0.0f32, 0.0, 1.0, 1.0]));
        assert_eq!(chunk, Buffer::from(vec![2.0f32; 2]));
        assert_eq!(got, Buffer::from(vec![other; 2]));
        assert_eq!(moved, Buffer::from(vec![0.0f32, 1.0]));
        assert_eq!(
            seen,
            [
                ("all_reduce", 3, 12, None),
                ("all_gather", 1, 8, None),
                ("all_gather", 2, 8, None),
                ("reduce_scatter", 4, 16, None),
                ("connect", 0, 0, Some(1 - rank)),
                ("send", 2, 8, Some(1 - rank)),
                ("recv", 2, 8, Some(1 - rank)),
                ("all_to_all_v", 2, 8, None),
                ("barrier", 0, 0, None),
            ],
            "rank {rank}"
        );
    }
}
