//! Bus bandwidth of all-reduce, all-gather and reduce-scatter on f32 buffers: the `local` backend (ranks as
//! threads) and, with `--mpi 2,4`, the MPI backend (one process per rank, started here
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
//! as a training loop does (`all_gather_into`, `reduce_scatter_into`).

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
    ReduceScatter,
}

const OPS: [(&str, Op); 3] = [
    ("all_reduce", Op::AllReduce),
    ("all_gather", Op::AllGather),
    ("reduce_scatter", Op::ReduceScatter),
];

/// Calls per measurement: the median of this many, on a machine whose memory bandwidth
/// varies from second to second.
fn iters(mib: usize) -> usize {
    (256 / mib).clamp(7, 40)
}

fn sizes(max_mib: usize) -> Vec<usize> {
    std::iter::successors(Some(1), |m| Some(m * 4))
        .take_while(|&m| m <= max_mib)
        .collect()
}

/// Seconds of each of `iters` calls of `op` on `mib` MiB (the gathered output for
/// all-gather, the input for reduce-scatter), the first call not counted; every rank calls
/// this.
fn time_calls(comm: &dyn Communicator, op: Op, mib: usize, iters: usize) -> Vec<f64> {
    let n = comm.group().size();
    let elems = mib * (1 << 20) / 4;
    let len = match op {
        Op::AllGather => elems / n,
        Op::AllReduce | Op::ReduceScatter => elems,
    };
    let mut times = Vec::new();
    // Not 0: a zeroed allocation comes as untouched pages, which would then be faulted in
    // inside the first timed call. One input and one output for every call.
    let mut buf = Buffer::F32(vec![comm.group().rank() as f32 + 1.0; len]);
    let mut out = Buffer::F32(Vec::new());
    for i in 0..iters + 1 {
        comm.barrier().unwrap();
        let t = Instant::now();
        match op {
            Op::AllReduce => comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap(),
            Op::AllGather => comm.all_gather_into(&buf, &mut out).unwrap(),
            Op::ReduceScatter => comm
                .reduce_scatter_into(&mut buf, ReduceOp::Sum, &mut out)
                .unwrap(),
        }
        comm.barrier().unwrap();
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times
}

/// Median seconds per call at world `n` of threads.
fn time_local(op: Op, n: usize, mib: usize) -> f64 {
    let world = LocalWorld::with_timeout(n, Duration::from_secs(600));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let world = world.clone();
            std::thread::spawn(move || {
                let comm = world.new_group("bench", (0..n).collect(), rank).unwrap();
                time_calls(comm.as_ref(), op, mib, iters(mib))
            })
        })
        .collect();
    let mut times: Vec<Vec<f64>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    median(times.swap_remove(0))
}

/// Under mpirun: every size and op, rank 0 printing `op mib seconds` lines.
#[cfg(feature = "mpi")]
fn mpi_worker(max_mib: usize) {
    let world = burn_megatron::comm::MpiWorld::init(Duration::from_secs(600)).unwrap();
    let n = world.size();
    world.barrier();
    let comm = world
        .new_group("bench", (0..n).collect(), world.rank())
        .unwrap();
    for mib in sizes(max_mib) {
        for (name, op) in OPS {
            let secs = median(time_calls(comm.as_ref(), op, mib, iters(mib)));
            if world.rank() == 0 {
                println!("{name} {mib} {secs}");
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

/// Median seconds per call, by (op, MiB).
type Timings = HashMap<(String, usize), f64>;

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
    let mut times = HashMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [op, mib, secs] = f[..] {
            let parse = |s: &str| s.parse::<f64>().map_err(|e| format!("{line:?}: {e}"));
            times.insert((op.to_string(), parse(mib)? as usize), parse(secs)?);
        }
    }
    Ok(times)
}

fn memcpy_gbps(mib: usize) -> f64 {
    let src = vec![1.0f32; mib * (1 << 20) / 4];
    let mut dst = vec![0.0f32; src.len()];
    // The first copy faults the destination in; then the median, as for the collectives.
    let times: Vec<f64> = (0..=iters(mib))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    (mib << 20) as f64 / median(times) / 1e9
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
    println!("bus bandwidth (GB/s), f32; ratio = bus bw / single-thread memcpy bw");
    println!(
        "{:>14} {:>8} {:>6} {:>10} {:>12} {:>12} {:>9} {:>12}",
        "op", "backend", "world", "size", "time", "bus bw", "ratio", "memcpy bw"
    );
    for mib in sizes(args.max_mib) {
        let memcpy = memcpy_gbps(mib);
        let bytes = (mib << 20) as f64;
        for (name, op) in OPS {
            let local = args
                .worlds
                .iter()
                .map(|&n| ("threads", n, time_local(op, n, mib)));
            let processes = mpi
                .iter()
                .filter_map(|(n, t)| t.get(&(name.to_string(), mib)).map(|&s| ("mpi", *n, s)));
            for (backend, n, secs) in local.collect::<Vec<_>>().into_iter().chain(processes) {
                let factor = match op {
                    Op::AllReduce => 2.0 * (n - 1) as f64 / n as f64,
                    Op::AllGather | Op::ReduceScatter => (n - 1) as f64 / n as f64,
                };
                let bus = bytes / secs * factor / 1e9;
                println!(
                    "{name:>14} {backend:>8} {n:>6} {mib:>6} MiB {:>9.2} ms {bus:>12.2} {:>9.3} {memcpy:>12.2}",
                    secs * 1e3,
                    bus / memcpy,
                );
            }
        }
    }
    Ok(())
}
