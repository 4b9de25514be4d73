//! Bus bandwidth of the `local` backend's all-reduce and all-gather on f32 buffers,
//! beside a single-thread memcpy measured in the same run.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example comm_bench [-- --max-mib 256]
//! ```
//!
//! Bus bandwidth follows nccl-tests: all-reduce moves 2(n−1)/n of the buffer per rank,
//! all-gather (n−1)/n of the gathered output, so the figures compare across world sizes.

use burn_megatron::comm::{Buffer, Communicator, LocalWorld, ReduceOp};
use burn_megatron_examples::median;
use clap::Parser;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Largest buffer, in MiB (sizes go 1, 4, 16, ... up to this).
    #[arg(long, default_value_t = 256)]
    max_mib: usize,
    /// World sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    worlds: Vec<usize>,
}

#[derive(Clone, Copy)]
enum Op {
    AllReduce,
    AllGather,
}

/// Median seconds per call of `op` on `mib` MiB per rank at world `n`.
fn time_op(op: Op, n: usize, mib: usize, iters: usize) -> f64 {
    let world = LocalWorld::with_timeout(n, Duration::from_secs(600));
    let elems = mib * (1 << 20) / 4;
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let world = world.clone();
            std::thread::spawn(move || {
                let comm = world.communicator("bench", (0..n).collect(), rank).unwrap();
                let mut times = Vec::new();
                for i in 0..iters + 1 {
                    // All-gather: each rank contributes 1/n so the gathered output is `mib`.
                    let len = if matches!(op, Op::AllGather) {
                        elems / n
                    } else {
                        elems
                    };
                    let mut buf = Buffer::F32(vec![rank as f32; len]);
                    comm.barrier().unwrap();
                    let t = Instant::now();
                    match op {
                        Op::AllReduce => comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap(),
                        Op::AllGather => drop(comm.all_gather(buf).unwrap()),
                    }
                    comm.barrier().unwrap();
                    if i > 0 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                times
            })
        })
        .collect();
    median(handles.into_iter().next().unwrap().join().unwrap())
}

fn memcpy_gbps(mib: usize) -> f64 {
    let src = vec![1.0f32; mib * (1 << 20) / 4];
    let mut dst = vec![0.0f32; src.len()];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (mib << 20) as f64 / best / 1e9
}

fn main() {
    let args = Args::parse();
    println!("local backend bus bandwidth (GB/s), f32; ratio = bus bw / single-thread memcpy bw");
    println!(
        "{:>10} {:>6} {:>10} {:>12} {:>12} {:>9} {:>12}",
        "op", "world", "size", "time", "bus bw", "ratio", "memcpy bw"
    );
    let mut mib = 1;
    while mib <= args.max_mib {
        let memcpy = memcpy_gbps(mib);
        for &n in &args.worlds {
            let iters = (64 / mib).clamp(3, 20);
            for (name, op) in [("all_reduce", Op::AllReduce), ("all_gather", Op::AllGather)] {
                let secs = time_op(op, n, mib, iters);
                let bytes = (mib << 20) as f64;
                let factor = match op {
                    Op::AllReduce => 2.0 * (n - 1) as f64 / n as f64,
                    Op::AllGather => (n - 1) as f64 / n as f64,
                };
                let bus = bytes / secs * factor / 1e9;
                println!(
                    "{name:>10} {n:>6} {mib:>6} MiB {:>9.2} ms {bus:>12.2} {:>9.3} {memcpy:>12.2}",
                    secs * 1e3,
                    bus / memcpy,
                );
            }
        }
        mib *= 4;
    }
}
