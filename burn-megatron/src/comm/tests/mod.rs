use super::*;
use half::{bf16, f16};
use std::time::{Duration, Instant};

/// Runs `f(rank, world)` on `n` threads of one world and returns the results in rank order.
fn run<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(usize, LocalWorld) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let world = LocalWorld::with_timeout(n, timeout);
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (world, f) = (world.clone(), f.clone());
            std::thread::spawn(move || f(rank, world))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

const T2: Duration = Duration::from_secs(2);

fn all(n: usize) -> Vec<usize> {
    (0..n).collect()
}

fn typed<T: CommElement>(vals: &[f64], conv: impl Fn(f64) -> T) -> Buffer {
    T::into_buffer(vals.iter().map(|&x| conv(x)).collect())
}

/// The same f64 values as a buffer of each dtype.
fn as_dtype(dtype: CommDType, vals: &[f64]) -> Buffer {
    match dtype {
        CommDType::F32 => typed(vals, |x| x as f32),
        CommDType::F16 => typed(vals, f16::from_f64),
        CommDType::BF16 => typed(vals, bf16::from_f64),
        CommDType::I32 => typed(vals, |x| x as i32),
        CommDType::I64 => typed(vals, |x| x as i64),
    }
}

/// Rank-valued inputs: rank r holds [r, 2r + 1, 10 - r, 4r, -r].
fn rank_values(r: usize) -> Vec<f64> {
    let r = r as f64;
    vec![r, 2.0 * r + 1.0, 10.0 - r, 4.0 * r, -r]
}

#[test]
fn all_reduce_every_op_dtype_and_world_size() {
    for n in [1, 2, 3, 4, 8] {
        for dtype in CommDType::ALL {
            for op in ReduceOp::ALL {
                let out = run(n, T2, move |rank, world| {
                    let comm = world.communicator("g", all(n), rank).unwrap();
                    let mut buf = as_dtype(dtype, &rank_values(rank));
                    comm.all_reduce(&mut buf, op).unwrap();
                    buf
                });
                let cols: Vec<Vec<f64>> = (0..5)
                    .map(|i| (0..n).map(|r| rank_values(r)[i]).collect())
                    .collect();
                let expect: Vec<f64> = cols
                    .iter()
                    .map(|c| match op {
                        ReduceOp::Sum => c.iter().sum(),
                        ReduceOp::Avg => {
                            let s: f64 = c.iter().sum();
                            let is_int = matches!(dtype, CommDType::I32 | CommDType::I64);
                            if is_int {
                                (s / n as f64).trunc()
                            } else {
                                s / n as f64
                            }
                        }
                        ReduceOp::Max => c.iter().cloned().fold(f64::MIN, f64::max),
                        ReduceOp::Min => c.iter().cloned().fold(f64::MAX, f64::min),
                    })
                    .collect();
                for (rank, got) in out.into_iter().enumerate() {
                    assert_eq!(
                        got,
                        as_dtype(dtype, &expect),
                        "world {n}, {dtype}, {op}, rank {rank}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_gather_concatenates_in_group_order() {
    for n in [1, 2, 3, 4, 8] {
        for dtype in CommDType::ALL {
            let out = run(n, T2, move |rank, world| {
                // Group order deliberately reversed: the result follows it.
                let ranks: Vec<usize> = (0..n).rev().collect();
                let comm = world.communicator("g", ranks, rank).unwrap();
                comm.all_gather(as_dtype(dtype, &[rank as f64, 100.0 + rank as f64]))
                    .unwrap()
            });
            let expect: Vec<f64> = (0..n)
                .rev()
                .flat_map(|r| [r as f64, 100.0 + r as f64])
                .collect();
            for got in out {
                assert_eq!(got, as_dtype(dtype, &expect), "world {n}, {dtype}");
            }
        }
    }
}

/// `all_gather_into` gives `all_gather`'s result and, called again with the same buffer,
/// writes into the allocation it already has (and into a buffer of another dtype too).
#[test]
fn all_gather_into_reuses_the_output_buffer() {
    let out = run(3, T2, move |rank, world| {
        let comm = world.communicator("g", vec![0, 1, 2], rank).unwrap();
        let input = |k: usize| Buffer::F32(vec![(rank * 10 + k) as f32; 1000]);
        let mut out = Buffer::I64(vec![7; 5]);
        comm.all_gather_into(&input(0), &mut out).unwrap();
        let first = out.clone();
        let Buffer::F32(v) = &out else {
            panic!("gathered f32, got {}", out.dtype())
        };
        let at = v.as_ptr();
        comm.all_gather_into(&input(1), &mut out).unwrap();
        let Buffer::F32(v) = &out else {
            panic!("gathered f32, got {}", out.dtype())
        };
        let reused = v.as_ptr() == at;
        (first, comm.all_gather(input(1)).unwrap(), out, reused)
    });
    for (first, plain, into, reused) in out {
        let expect = |k: usize| -> Vec<f32> {
            (0..3)
                .flat_map(|r| vec![(r * 10 + k) as f32; 1000])
                .collect()
        };
        assert_eq!(first, Buffer::F32(expect(0)));
        assert_eq!(into, plain);
        assert_eq!(into, Buffer::F32(expect(1)));
        assert!(
            reused,
            "the second gather wrote into the first one's allocation"
        );
    }
}

/// `all_gather_in_place` fills every other member's piece of a buffer that holds only this
/// member's (the rest poisoned with -1), for every dtype and world size, small and
/// streamed; a member may gather into a separate output in the same call; and a length
/// the group does not divide is an error on every member.
#[test]
fn all_gather_in_place_fills_the_other_pieces() {
    for n in [1, 2, 3, 4] {
        for dtype in CommDType::ALL {
            for piece in [3, 1 << 20] {
                let out = run(n, T2, move |rank, world| {
                    let comm = world.communicator("g", all(n), rank).unwrap();
                    let value = |r: usize, i: usize| (r * 7 + i % 50) as f64;
                    let mut vals = vec![-1.0; n * piece];
                    for i in 0..piece {
                        vals[rank * piece + i] = value(rank, i);
                    }
                    let mut buf = as_dtype(dtype, &vals);
                    if rank == 1 {
                        // Gathers its piece into a separate output instead.
                        let mine = buf.slice(piece..2 * piece);
                        comm.all_gather_into(&mine, &mut buf).unwrap();
                    } else {
                        comm.all_gather_in_place(&mut buf).unwrap();
                    }
                    let expect: Vec<f64> = (0..n * piece)
                        .map(|j| value(j / piece, j % piece))
                        .collect();
                    (buf, as_dtype(dtype, &expect))
                });
                for (rank, (got, expect)) in out.into_iter().enumerate() {
                    assert!(
                        got == expect,
                        "world {n}, {dtype}, piece {piece}, rank {rank}"
                    );
                }
            }
        }
    }
    let errors = run(2, T2, |rank, world| {
        let comm = world.communicator("g", all(2), rank).unwrap();
        comm.all_gather_in_place(&mut Buffer::F32(vec![0.0; 5]))
    });
    for e in errors {
        let e = e.unwrap_err().to_string();
        assert!(e.contains("do not split evenly over 2 ranks"), "{e}");
    }
}

/// Sums are folded in group order on every rank, whichever chunk it folds: with 1e8, -1e8
/// and 1 that order gives 1 and any order that adds the 1 before the cancellation gives 0
/// (f32 has no room for 1e8 + 1; nor has the f32 accumulator of bf16).
#[test]
fn sums_fold_in_group_order_on_every_rank() {
    for dtype in [CommDType::F32, CommDType::BF16] {
        let out = run(3, T2, move |rank, world| {
            let comm = world.communicator("g", all(3), rank).unwrap();
            let x = [1e8, -1e8, 1.0][rank];
            let mut buf = as_dtype(dtype, &vec![x; 3000]);
            let mut part = Buffer::F32(Vec::new());
            comm.reduce_scatter_into(&mut buf, ReduceOp::Sum, &mut part)
                .unwrap();
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            (buf, part)
        });
        for (rank, (sum, part)) in out.into_iter().enumerate() {
            assert_eq!(sum, as_dtype(dtype, &[1.0; 3000]), "{dtype}, rank {rank}");
            assert_eq!(part, as_dtype(dtype, &[1.0; 1000]), "{dtype}, rank {rank}");
        }
    }
}

#[test]
fn reduce_scatter_returns_each_rank_its_chunk() {
    for n in [1, 2, 3, 4, 8] {
        for dtype in CommDType::ALL {
            let out = run(n, T2, move |rank, world| {
                let comm = world.communicator("g", all(n), rank).unwrap();
                // Element i of rank r is i + r; 2 elements per rank.
                let vals: Vec<f64> = (0..2 * n).map(|i| (i + rank) as f64).collect();
                comm.reduce_scatter(as_dtype(dtype, &vals), ReduceOp::Sum)
                    .unwrap()
            });
            let ranks_sum: f64 = (0..n).map(|r| r as f64).sum();
            for (rank, got) in out.into_iter().enumerate() {
                let expect: Vec<f64> = (2 * rank..2 * rank + 2)
                    .map(|i| i as f64 * n as f64 + ranks_sum)
                    .collect();
                assert_eq!(
                    got,
                    as_dtype(dtype, &expect),
                    "world {n}, {dtype}, rank {rank}"
                );
            }
        }
    }
}

/// `reduce_scatter_into` gives `reduce_scatter`'s chunk, hands the input back unchanged,
/// and writes a second call into the first one's output allocation.
#[test]
fn reduce_scatter_into_keeps_the_input_and_reuses_the_output() {
    let out = run(3, T2, move |rank, world| {
        let comm = world.communicator("g", vec![0, 1, 2], rank).unwrap();
        let values: Vec<f32> = (0..3000).map(|i| (i % 7 + rank) as f32).collect();
        let mut input = Buffer::F32(values.clone());
        let mut out = Buffer::F32(Vec::new());
        comm.reduce_scatter_into(&mut input, ReduceOp::Sum, &mut out)
            .unwrap();
        let Buffer::F32(v) = &out else {
            panic!("reduced f32, got {}", out.dtype())
        };
        let at = v.as_ptr();
        comm.reduce_scatter_into(&mut input, ReduceOp::Max, &mut out)
            .unwrap();
        let Buffer::F32(v) = &out else {
            panic!("reduced f32, got {}", out.dtype())
        };
        let reused = v.as_ptr() == at;
        let plain = comm.reduce_scatter(input.clone(), ReduceOp::Max).unwrap();
        (rank, input == Buffer::F32(values), out, plain, reused)
    });
    for (rank, unchanged, into, plain, reused) in out {
        assert!(unchanged, "rank {rank}: the input came back changed");
        let expect: Vec<f32> = (rank * 1000..(rank + 1) * 1000)
            .map(|i| (i % 7 + 2) as f32)
            .collect();
        assert_eq!(into, Buffer::F32(expect), "rank {rank}: max over ranks");
        assert_eq!(into, plain);
        assert!(
            reused,
            "rank {rank}: the second call wrote into the first one's output"
        );
    }
}

/// Above `lend::STREAM_FROM` the gathered and reduced pieces are written by non-temporal
/// stores: the same results, at offsets that are not 16-byte aligned too.
#[test]
fn large_gathers_and_reductions_stream_the_same_values() {
    let len = 1_500_001; // 6 MB per rank: a 12 MB gather, a 3-float unaligned tail
    assert!(2 * len * 4 >= super::lend::STREAM_FROM);
    let out = run(2, T2, move |rank, world| {
        let comm = world.communicator("g", all(2), rank).unwrap();
        let piece = |r: usize| -> Vec<f32> { (0..len).map(|i| (i % 1000 + r) as f32).collect() };
        let mut gathered = Buffer::F32(Vec::new());
        comm.all_gather_into(&Buffer::F32(piece(rank)), &mut gathered)
            .unwrap();
        let mut input = Buffer::F32([piece(rank), piece(rank + 2)].concat());
        let mut reduced = Buffer::F32(Vec::new());
        comm.reduce_scatter_into(&mut input, ReduceOp::Sum, &mut reduced)
            .unwrap();
        (rank, gathered, reduced)
    });
    let piece = |r: usize| -> Vec<f32> { (0..len).map(|i| (i % 1000 + r) as f32).collect() };
    for (rank, gathered, reduced) in out {
        assert_eq!(
            gathered,
            Buffer::F32([piece(0), piece(1)].concat()),
            "rank {rank}"
        );
        // Chunk `rank` of [piece(r), piece(r + 2)] summed over r = 0, 1.
        let sum: Vec<f32> = (0..len)
            .map(|i| (2 * (i % 1000) + 1 + 4 * rank) as f32)
            .collect();
        assert_eq!(reduced, Buffer::F32(sum), "rank {rank}");
    }
}

#[test]
fn reduce_scatter_avg_and_indivisible_length() {
    let out = run(2, T2, |rank, world| {
        let comm = world.communicator("g", all(2), rank).unwrap();
        let avg = comm
            .reduce_scatter_vec(vec![rank as f32 * 2.0; 4], ReduceOp::Avg)
            .unwrap();
        let bad = comm.reduce_scatter_vec(vec![1.0f32; 3], ReduceOp::Sum);
        (avg, bad)
    });
    for (avg, bad) in out {
        assert_eq!(avg, vec![1.0, 1.0]);
        let msg = bad.unwrap_err().to_string();
        assert!(
            msg.contains("3 elements do not split evenly over 2 ranks"),
            "{msg}"
        );
    }
}

#[test]
fn uneven_all_reduce_chunks() {
    // 7 elements over 3 ranks: chunks of 3, 2, 2 reduced by different ranks.
    let out = run(3, T2, |rank, world| {
        let comm = world.communicator("g", all(3), rank).unwrap();
        let mut v: Vec<i64> = (0..7).map(|i| i * 10 + rank as i64).collect();
        comm.all_reduce_vec(&mut v, ReduceOp::Sum).unwrap();
        v
    });
    let expect: Vec<i64> = (0..7).map(|i| i * 30 + 3).collect();
    assert!(out.iter().all(|v| *v == expect));
}

#[test]
fn broadcast_from_every_root() {
    for n in [1, 2, 3, 4, 8] {
        for root in 0..n {
            let out = run(n, T2, move |rank, world| {
                let comm = world.communicator("g", all(n), rank).unwrap();
                let mut buf = Buffer::from(vec![rank as i32; 3]);
                comm.broadcast(&mut buf, root).unwrap();
                buf
            });
            assert!(out.iter().all(|b| *b == Buffer::from(vec![root as i32; 3])));
        }
    }
}

#[test]
fn send_recv_is_ordered_per_pair_and_ring_cannot_deadlock() {
    let n = 4;
    let out = run(n, T2, move |rank, world| {
        let comm = world.communicator("pp", all(n), rank).unwrap();
        let next = (rank + 1) % n;
        let prev = (rank + n - 1) % n;
        let mut got = Vec::new();
        // Every rank sends first: would deadlock with blocking sends.
        for step in 0..3 {
            let mut buf = Buffer::zeros(CommDType::F32, 2);
            comm.send_recv(
                Buffer::from(vec![rank as f32, step as f32]),
                next,
                &mut buf,
                prev,
            )
            .unwrap();
            got.push(buf);
        }
        got
    });
    for (rank, got) in out.into_iter().enumerate() {
        let prev = ((rank + n - 1) % n) as f32;
        let expect: Vec<Buffer> = (0..3).map(|s| Buffer::from(vec![prev, s as f32])).collect();
        assert_eq!(got, expect);
    }
}

#[test]
fn barrier_and_subgroup_world_one() {
    let out = run(1, T2, |rank, world| {
        let comm = world.communicator("solo", vec![0], rank).unwrap();
        comm.barrier().unwrap();
        let mut v = vec![bf16::from_f32(1.5)];
        comm.all_reduce_vec(&mut v, ReduceOp::Sum).unwrap();
        v
    });
    assert_eq!(out[0], vec![bf16::from_f32(1.5)]);
}

#[test]
fn concurrent_groups_do_not_cross_talk() {
    // World 4 as tp = 2 × dp = 2: tp groups {0,1},{2,3}, dp groups {0,2},{1,3}. Each rank
    // alternates between them many times; a group with the same members but another name
    // ("mp" = tp here) must stay separate too.
    let n = 4;
    let out = run(n, T2, move |rank, world| {
        let tp_ranks = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        let dp_ranks = if rank % 2 == 0 {
            vec![0, 2]
        } else {
            vec![1, 3]
        };
        let tp = world.communicator("tp", tp_ranks.clone(), rank).unwrap();
        let mp = world.communicator("mp", tp_ranks, rank).unwrap();
        let dp = world.communicator("dp", dp_ranks, rank).unwrap();
        let mut sums = Vec::new();
        for i in 0..200i64 {
            let mut a = vec![rank as i64 + i];
            tp.all_reduce_vec(&mut a, ReduceOp::Sum).unwrap();
            let mut b = vec![10 * rank as i64];
            dp.all_reduce_vec(&mut b, ReduceOp::Sum).unwrap();
            let c = mp.all_gather_vec(vec![rank as i64]).unwrap();
            sums.push((a[0], b[0], c));
        }
        sums
    });
    for (rank, sums) in out.into_iter().enumerate() {
        let tp_base: i64 = if rank < 2 { 1 } else { 5 };
        let dp_sum: i64 = if rank % 2 == 0 { 20 } else { 40 };
        let mp: Vec<i64> = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
        for (i, (a, b, c)) in sums.into_iter().enumerate() {
            assert_eq!(a, tp_base + 2 * i as i64);
            assert_eq!(b, dp_sum);
            assert_eq!(c, mp);
        }
    }
}

mod errors;
mod probe;
mod tensor;
