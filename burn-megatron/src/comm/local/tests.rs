//! The threaded backend's own defences: one communicator per member, no memory freed while
//! a peer may still use it, and deadlines that cannot overflow.

use super::*;
use crate::comm::reduce::ReduceOp;
use crate::comm::{CHECKPOINT_BARRIER_TIMEOUT, Communicator};
use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize};

/// The system allocator, noting whether the allocation at `WATCHED` was freed: how the
/// test of a panicking member tells a leaked buffer from a freed one without reading freed
/// memory.
struct Watching;

static WATCHED: AtomicUsize = AtomicUsize::new(0);
static FREED: AtomicBool = AtomicBool::new(false);

impl Watching {
    fn note(ptr: *mut u8) {
        let watched = WATCHED.load(Ordering::Relaxed);
        if watched != 0 && ptr as usize == watched {
            FREED.store(true, Ordering::SeqCst);
        }
    }
}

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Watching {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        Self::note(ptr);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::note(ptr);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Watching = Watching;

const T2: Duration = Duration::from_secs(2);

/// Runs `f(rank)` on one thread per rank and returns the results in rank order.
fn on_threads<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                s.spawn({
                    let f = &f;
                    move || f(r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_second_communicator_for_a_live_member_is_refused_until_the_first_is_dropped() {
    let world = LocalWorld::with_timeout(2, T2);
    let first = world.communicator("dp", vec![0, 1], 0).unwrap();
    let err = world.communicator("dp", vec![0, 1], 0).unwrap_err();
    assert!(
        matches!(&err, CommError::InvalidArgument { op: "new_group", reason, .. }
            if reason.contains("global rank 0 already has a live communicator")),
        "{err}"
    );
    // Another member, or another group over the same ranks, is no conflict.
    let other = world.communicator("dp", vec![0, 1], 1).unwrap();
    let _tp = world.communicator("tp", vec![0, 1], 0).unwrap();
    drop((first, other));

    // Once dropped, a member's communicator can be made again, and carries on in step with
    // a peer that kept its own.
    let out = on_threads(2, |rank| {
        let world = world.clone();
        let comm = world.communicator("g", vec![0, 1], rank).unwrap();
        comm.barrier().unwrap();
        let comm = if rank == 0 {
            drop(comm);
            world.communicator("g", vec![0, 1], 0).unwrap()
        } else {
            comm
        };
        let mut buf = Buffer::from(vec![rank as f32 + 1.0; 3]);
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        buf
    });
    assert_eq!(out, vec![Buffer::from(vec![3.0f32; 3]); 2]);
}

/// The claim aside, the slot itself refuses a member arriving twice: without that check
/// both arrivals of member 0 count, and the barrier passes with member 1 absent.
#[test]
fn a_member_arriving_twice_at_one_call_poisons_the_group() {
    let world = LocalWorld::with_timeout(2, T2);
    let twins = [
        world.unclaimed("g", vec![0, 1], 0).unwrap(),
        world.unclaimed("g", vec![0, 1], 0).unwrap(),
    ];
    let out = on_threads(2, |i| twins[i].barrier());
    for r in &out {
        assert!(
            matches!(r, Err(CommError::Mismatch { detail, .. })
                if detail.contains("global rank 0 arrived twice")),
            "{r:?}"
        );
    }
    // The group stays poisoned for the real members too.
    let one = world.communicator("g", vec![0, 1], 1).unwrap();
    assert!(matches!(one.barrier(), Err(CommError::Mismatch { .. })));
}

/// Member 0's work panics while member 1 still reads member 0's lent buffer. The buffer must
/// not be freed during the unwind (member 1 reads it afterwards and finds it intact), and
/// member 1 must fail promptly, not wait for a release that never comes.
#[test]
fn a_member_that_panics_with_its_buffer_lent_leaks_it_and_fails_its_peers() {
    const N: usize = 1 << 16;
    let world = LocalWorld::with_timeout(2, Duration::from_secs(20));
    let unwound = AtomicBool::new(false);
    let pattern: Vec<u8> = bytemuck::cast_slice(&vec![1.5f32; N]).to_vec();
    let desc = |buf: &Buffer| OpDesc {
        reduce: Some(ReduceOp::Sum),
        ..OpDesc::data("all_reduce", buf)
    };
    let (panicker, reader) = std::thread::scope(|s| {
        let panicker = s.spawn(|| {
            let comm = world.communicator("g", vec![0, 1], 0).unwrap();
            let mut buf = Buffer::from(vec![1.5f32; N]);
            WATCHED.store(buf.bytes().as_ptr() as usize, Ordering::SeqCst);
            let d = desc(&buf);
            let panicked = catch_unwind(AssertUnwindSafe(|| {
                comm.lend(d, &mut buf, |_| panic!("injected"))
            }))
            .is_err();
            unwound.store(true, Ordering::SeqCst);
            (panicked, comm.barrier())
        });
        let reader = s.spawn(|| {
            let comm = world.communicator("g", vec![0, 1], 1).unwrap();
            let mut buf = Buffer::from(vec![0.0f32; N]);
            let start = Instant::now();
            let mut seen = None;
            let d = desc(&buf);
            let result = comm.lend(d, &mut buf, |lent| {
                while !unwound.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
                    std::thread::yield_now();
                }
                let freed = FREED.load(Ordering::SeqCst);
                // Read only what was not freed: reading freed memory is what this test
                // guards against.
                // SAFETY: member 0's buffer, lent for this call and not freed.
                let intact = !freed && unsafe { lent[0].bytes(0, N * 4) } == &pattern[..];
                seen = Some((freed, intact));
            });
            (seen, result, start.elapsed())
        });
        (panicker.join().unwrap(), reader.join().unwrap())
    });
    WATCHED.store(0, Ordering::SeqCst);
    assert!(panicker.0, "the injected panic propagates to its caller");
    let (seen, result, waited) = reader;
    assert_eq!(
        seen,
        Some((false, true)),
        "(freed, intact) of the panicking member's buffer, seen after it unwound"
    );
    assert!(
        matches!(&result, Err(CommError::PeerFailed { rank: 0, reason, .. })
            if reason.contains("panicked")),
        "{result:?}"
    );
    assert!(waited < Duration::from_secs(15), "failed after {waited:?}");
    assert!(matches!(panicker.1, Err(CommError::PeerFailed { .. })));
}

/// A timeout too large for an `Instant` is no deadline, not an overflow panic.
#[test]
fn a_world_with_duration_max_timeout_works_and_still_fails_on_a_failed_peer() {
    let world = LocalWorld::with_timeout(2, Duration::MAX);
    let out = on_threads(2, |rank| {
        let comm = world.communicator("g", vec![0, 1], rank).unwrap();
        comm.barrier().unwrap();
        comm.barrier_with_timeout(Duration::MAX).unwrap();
        let mut buf = Buffer::from(vec![rank as i64; 4]);
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        comm.send(Buffer::from(vec![rank as f32]), 1 - rank)
            .unwrap();
        let mut got = Buffer::from(vec![0.0f32]);
        comm.recv(&mut got, 1 - rank).unwrap();
        (buf, got)
    });
    assert_eq!(
        out[0],
        (Buffer::from(vec![1i64; 4]), Buffer::from(vec![1.0f32]))
    );
    assert_eq!(
        out[1],
        (Buffer::from(vec![1i64; 4]), Buffer::from(vec![0.0f32]))
    );

    let start = Instant::now();
    let out = on_threads(2, |rank| {
        let comm = world.communicator("h", vec![0, 1], rank).unwrap();
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(100));
            world.abort(1, "gave up");
            return Ok(());
        }
        comm.barrier()
    });
    assert!(
        matches!(out[0], Err(CommError::PeerFailed { rank: 1, .. })),
        "{:?}",
        out[0]
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// A checkpoint barrier outlasts the collective timeout, and is bounded by its own.
#[test]
fn barrier_with_timeout_replaces_the_collective_timeout() {
    let world = LocalWorld::with_timeout(2, Duration::from_millis(100));
    let out = on_threads(2, |rank| {
        let comm = world.communicator("g", vec![0, 1], rank).unwrap();
        if rank == 1 {
            // A slow save, well past the collective timeout.
            std::thread::sleep(Duration::from_millis(600));
        }
        comm.barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT)
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");

    let world = LocalWorld::with_timeout(2, Duration::from_secs(60));
    let comm = world.communicator("g", vec![0, 1], 0).unwrap();
    let start = Instant::now();
    let err = comm
        .barrier_with_timeout(Duration::from_millis(100))
        .unwrap_err();
    assert!(
        matches!(&err, CommError::Timeout { op: "barrier", missing, .. } if missing == &[1]),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}
