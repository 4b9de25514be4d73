//! Bus bandwidth of all-reduce, all-gather and reduce-scatter on f32 buffers: the `local`
//! backend (ranks as threads) and, with `--mpi 2,4`, the MPI backend (one process per rank, started here
//! through `mpirun`), beside a single-thread memcpy measured in the same run.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example comm_bench [-- --max-mib 256]
//! cargo run --release -p burn-megatron-examples --features mpi --example comm_bench -- --mpi 2,4
//! ```
//!
//! Bus bandwidth follows nccl-tests: all-reduce moves 2(n−1)/n of the buffer per rank,
//! all-gather (n−1)/n of the gathered output and reduce-scatter (n−1)/n of its input, so
//! the figures compare across world sizes. Each rank keeps its buffers from call to call,
//! as a training loop does (`all_gather_into`, `reduce_scatter_into`). `ag_in_place` is the
//! all-gather whose input already sits in its place in the output (`all_gather_in_place`,
//! nccl-tests' in-place column).
//!
//! As in nccl-tests, a measurement is a batch of calls issued back to back (a call returns
//! once every rank is done with the buffers lent to it, so the batch ends when the last
//! rank's work does), divided by its length. The memory bandwidth of this kind of machine
//! drifts by up to 2x within seconds, so a memcpy is timed right before each batch and a
//! cell's ratio is the median of the per-batch ratios. A last table shows how a copy
//! scales with threads on this machine: the ceiling on every collective at that size.

use burn_megatron::comm::{Buffer, Communicator, LocalWorld, ReduceOp, World};
use burn_megatron_examples::median;
use clap::Parser;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Largest buffer, in MiB (sizes go 1, 4, 16, ... up to this).
    #[arg(long, default_value_t = 256)]
    max_mib: usize,
    /// World sizes to measure on the local backend.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    worlds: Vec<usize>,
    /// Process counts to measure on the MPI backend, each through `mpirun -np N` (build with
    /// `--features mpi`).
    #[arg(long, value_delimiter = ',')]
    mpi: Vec<usize>,
    /// One rank of the MPI measurement (what this program runs under mpirun).
    #[arg(long, hide = true)]
    mpi_worker: bool,
}

#[derive(Clone, Copy)]
enum Op {
    AllReduce,
    AllGather,
    /// All-gather whose input is this rank's piece of the output (ZeRO's parameter gather).
    AllGatherInPlace,
    ReduceScatter,
}

const OPS: [(&str, Op); 4] = [
    ("all_reduce", Op::AllReduce),
    ("all_gather", Op::AllGather),
    ("ag_in_place", Op::AllGatherInPlace),
    ("reduce_scatter", Op::ReduceScatter),
];

/// Calls per batch: enough that a batch lasts milliseconds, so the barrier around it and
/// the wake-up of the ranks do not count.
fn batch(mib: usize) -> usize {
    (64 / mib).clamp(1, 64)
}

/// Batches per cell, each with its own memcpy baseline.
const ROUNDS: usize = 7;

/// One batch: seconds per call and the memcpy bandwidth (GB/s) rank 0 measured just before.
#[derive(Clone, Copy)]
struct Sample {
    secs: f64,
    memcpy: f64,
}

/// The cell's median seconds per call, median memcpy bandwidth and median per-batch ratio of
/// bus bandwidth to memcpy bandwidth.
fn summarize(samples: &[Sample], op: Op, n: usize, mib: usize) -> (f64, f64, f64) {
    let bus = |secs: f64| bus_gbps(op, n, mib, secs);
    let ratio = median(samples.iter().map(|s| bus(s.secs) / s.memcpy).collect());
    let secs = median(samples.iter().map(|s| s.secs).collect());
    let memcpy = median(samples.iter().map(|s| s.memcpy).collect());
    (secs, memcpy, ratio)
}

fn bus_gbps(op: Op, n: usize, mib: usize, secs: f64) -> f64 {
    let factor = match op {
        Op::AllReduce => 2.0 * (n - 1) as f64 / n as f64,
        Op::AllGather | Op::AllGatherInPlace | Op::ReduceScatter => (n - 1) as f64 / n as f64,
    };
    (mib << 20) as f64 / secs * factor / 1e9
}

fn sizes(max_mib: usize) -> Vec<usize> {
    std::iter::successors(Some(1), |m| Some(m * 4))
        .take_while(|&m| m <= max_mib)
        .collect()
}

/// `rounds` batches of `op` on `mib` MiB (the gathered output for all-gather, the input
/// for reduce-scatter) after an untimed one; every rank calls this, rank 0's samples count.
/// With `copy`, rank 0 times it before each batch (else the samples' `memcpy` is 0).
fn time_calls(
    comm: &dyn Communicator,
    op: Op,
    mib: usize,
    rounds: usize,
    mut copy: Option<Memcpy>,
) -> Vec<Sample> {
    let n = comm.group().size();
    let elems = mib * (1 << 20) / 4;
    let len = match op {
        Op::AllGather => elems / n,
        Op::AllReduce | Op::AllGatherInPlace | Op::ReduceScatter => elems,
    };
    // Not 0: a zeroed allocation comes as untouched pages, which would then be faulted in
    // inside the first timed call. One input and one output for every call.
    let mut buf = Buffer::F32(vec![comm.group().rank() as f32 + 1.0; len]);
    let mut out = Buffer::F32(Vec::new());
    let mut call = || match op {
        Op::AllReduce => comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap(),
        Op::AllGather => comm.all_gather_into(&buf, &mut out).unwrap(),
        Op::AllGatherInPlace => comm.all_gather_in_place(&mut buf).unwrap(),
        Op::ReduceScatter => comm
            .reduce_scatter_into(&mut buf, ReduceOp::Sum, &mut out)
            .unwrap(),
    };
    let k = batch(mib);
    // Faults the outputs in, and gives the scheduler time to spread the ranks over cores.
    (0..k).for_each(|_| call());
    (0..rounds)
        .map(|_| {
            // The other ranks wait here while rank 0 copies alone.
            let memcpy = copy.as_mut().map_or(0.0, |c| c.gbps(k.max(3)));
            comm.barrier().unwrap();
            let t = Instant::now();
            for _ in 0..k {
                call();
            }
            let secs = t.elapsed().as_secs_f64() / k as f64;
            comm.barrier().unwrap();
            Sample { secs, memcpy }
        })
        .collect()
}

/// A single-thread memcpy between two buffers kept from one measurement to the next.
struct Memcpy {
    src: Vec<f32>,
    dst: Vec<f32>,
}

impl Memcpy {
    fn new(mib: usize) -> Self {
        let src = vec![1.0f32; mib * (1 << 20) / 4];
        // Written once here, so that no timed copy faults pages in.
        let dst = src.clone();
        Self { src, dst }
    }

    fn copy(&mut self) {
        self.dst.copy_from_slice(std::hint::black_box(&self.src));
        std::hint::black_box(&mut self.dst);
    }

    /// GB/s: the median of `copies`.
    fn gbps(&mut self, copies: usize) -> f64 {
        let times = (0..copies)
            .map(|_| {
                let t = Instant::now();
                self.copy();
                t.elapsed().as_secs_f64()
            })
            .collect();
        (self.src.len() * 4) as f64 / median(times) / 1e9
    }
}

/// Rank 0's samples at world `n` of threads, a world of fresh threads per batch: the main
/// thread times the memcpy while no rank exists. (Ranks left waiting while rank 0 copied
/// would sleep, and the scheduler tends to wake a sleeper on its waker's core, where the
/// two then share one core for the batch.)
fn time_local(op: Op, n: usize, mib: usize) -> Vec<Sample> {
    let mut copy = Memcpy::new(mib);
    (0..ROUNDS)
        .map(|_| {
            let memcpy = copy.gbps(batch(mib).max(3));
            let world = LocalWorld::with_timeout(n, Duration::from_secs(600));
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let world = world.clone();
                    std::thread::spawn(move || {
                        let comm = world.new_group("bench", (0..n).collect(), rank).unwrap();
                        time_calls(comm.as_ref(), op, mib, 1, None)
                    })
                })
                .collect();
            let mut ranks: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            Sample {
                memcpy,
                ..ranks.swap_remove(0)[0]
            }
        })
        .collect()
}

/// Under mpirun: every size and op, rank 0 printing `op mib seconds memcpy` lines, one per
/// batch.
#[cfg(feature = "mpi")]
fn mpi_worker(max_mib: usize) {
    let world = burn_megatron::comm::mpi::MpiWorld::init(Duration::from_secs(600)).unwrap();
    let n = world.size();
    world.barrier();
    let comm = world
        .new_group("bench", (0..n).collect(), world.rank())
        .unwrap();
    for mib in sizes(max_mib) {
        for (name, op) in OPS {
            let copy = (world.rank() == 0).then(|| Memcpy::new(mib));
            for s in time_calls(comm.as_ref(), op, mib, ROUNDS, copy) {
                if world.rank() == 0 {
                    println!("{name} {mib} {} {}", s.secs, s.memcpy);
                }
            }
        }
    }
    drop(comm);
    world.finalize();
}

#[cfg(not(feature = "mpi"))]
fn mpi_worker(_: usize) {
    panic!("the MPI backend needs --features mpi");
}

/// The batches, by (op, MiB).
type Timings = HashMap<(String, usize), Vec<Sample>>;

/// Runs the MPI measurement at `n` processes.
fn time_mpi(n: usize, max_mib: usize) -> Result<Timings, String> {
    if !cfg!(feature = "mpi") {
        return Err("--mpi needs the example built with --features mpi".into());
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new("mpirun")
        .args(["-np", &n.to_string()])
        .arg(exe)
        .args(["--mpi-worker", "--max-mib", &max_mib.to_string()])
        // Allowed to run as root, and more processes than cores.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .output()
        .map_err(|e| format!("mpirun: {e} (Debian: openmpi-bin)"))?;
    if !out.status.success() {
        return Err(format!(
            "mpirun -np {n} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut times = Timings::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [op, mib, secs, memcpy] = f[..] {
            let parse = |s: &str| s.parse::<f64>().map_err(|e| format!("{line:?}: {e}"));
            let sample = Sample {
                secs: parse(secs)?,
                memcpy: parse(memcpy)?,
            };
            let key = (op.to_string(), parse(mib)? as usize);
            times.entry(key).or_default().push(sample);
        }
    }
    Ok(times)
}

/// Aggregate GB/s of `threads` threads each copying its own `mib` MiB [`batch`] times at
/// once (from the first start to the last finish, so that threads sharing a core count as
/// they run), over a single thread's; medians of [`ROUNDS`].
fn copy_scaling(threads: usize, mib: usize) -> f64 {
    let run = |threads: usize| {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let mut copy = Memcpy::new(mib);
                    copy.gbps(1);
                    (0..ROUNDS)
                        .map(|_| {
                            barrier.wait();
                            let start = Instant::now();
                            (0..batch(mib)).for_each(|_| copy.copy());
                            (start, Instant::now())
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let spans: Vec<Vec<(Instant, Instant)>> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        let bytes = (threads * batch(mib) * (mib << 20)) as f64;
        median(
            (0..ROUNDS)
                .map(|r| {
                    let first = spans.iter().map(|t| t[r].0).min().unwrap();
                    let last = spans.iter().map(|t| t[r].1).max().unwrap();
                    bytes / (last - first).as_secs_f64() / 1e9
                })
                .collect(),
        )
    };
    run(threads) / run(1)
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    if args.mpi_worker {
        mpi_worker(args.max_mib);
        return Ok(());
    }
    let mpi: Vec<(usize, Timings)> = args
        .mpi
        .iter()
        .map(|&n| time_mpi(n, args.max_mib).map(|t| (n, t)))
        .collect::<Result<_, _>>()?;
    println!("bus bandwidth (GB/s), f32; ratio = bus bw / single-thread memcpy bw just before");
    println!(
        "{:>14} {:>8} {:>6} {:>10} {:>12} {:>12} {:>9} {:>12}",
        "op", "backend", "world", "size", "time", "bus bw", "ratio", "memcpy bw"
    );
    for mib in sizes(args.max_mib) {
        for (name, op) in OPS {
            let local = args
                .worlds
                .iter()
                .map(|&n| ("threads", n, time_local(op, n, mib)));
            let processes = mpi.iter().filter_map(|(n, t)| {
                t.get(&(name.to_string(), mib))
                    .map(|s| ("mpi", *n, s.clone()))
            });
            for (backend, n, samples) in local.collect::<Vec<_>>().into_iter().chain(processes) {
                let (secs, memcpy, ratio) = summarize(&samples, op, n, mib);
                let bus = bus_gbps(op, n, mib, secs);
                println!(
                    "{name:>14} {backend:>8} {n:>6} {mib:>6} MiB {:>9.3} ms {bus:>12.2} {ratio:>9.3} {memcpy:>12.2}",
                    secs * 1e3,
                );
            }
        }
    }
    println!("\ncopy scaling: aggregate memcpy bandwidth of n threads / one thread's");
    let counts: Vec<usize> = args.worlds.iter().copied().filter(|&n| n > 1).collect();
    print!("{:>10}", "size");
    for n in &counts {
        print!(" {:>9}", format!("{n} thr"));
    }
    println!();
    for mib in sizes(args.max_mib) {
        print!("{:>6} MiB", mib);
        for &n in &counts {
            print!(" {:>9.3}", copy_scaling(n, mib));
        }
        println!();
    }
    Ok(())
}
