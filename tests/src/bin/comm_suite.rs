//! The collective suite with one process per rank, on the backend its second argument
//! names (`mpi`, the default, or `nccl`). Run under mpirun by `tests/tests/mpi.rs`; on GPUs
//! by `scripts/nccl_check.sh`; by hand:
//!
//! ```text
//! mpirun -np 4 target/debug/comm_suite collectives mpi
//! ```
//!
//! Cases:
//! - `collectives`: every op and dtype on the world and on subgroups, each result checked
//!   against the local backend (threads in this process, same inputs) and the integer sums
//!   against their closed form; two groups driven from two threads at once. MPI must match
//!   the local backend bit for bit; NCCL reduces floats in its own order, so its float
//!   reductions must match to a tolerance, everything else exactly.
//! - `mismatch`: rank 0 calls all_reduce while the others call all_gather on group "tp".
//! - `early-exit`: the last rank returns at once while the others all-reduce on "dp".
//! - `late-group`: the last rank sleeps 20 s while the others create group "late".
//! - `slow-barrier`: the last rank sleeps 3 s, then every rank calls a barrier bounded by
//!   30 s (run with a shorter collective timeout: the barrier's own bound holds).
//! - `large`: 64 MiB all-reduces in f32 and bf16 and a 64 MiB all-gather, against their
//!   closed forms (small integers: exact in any order of summation), with their time.
//! - `killed-peer`: after one all-reduce, the last rank sends itself SIGKILL; the others'
//!   next all-reduce must fail within the collective timeout.
//! - `tensors`: the tensor-level collectives (`comm::tensor`) and the all-to-all mapping on
//!   the rank's GPU (CUDA tensors: device memory under NCCL) against the same calls on CPU
//!   tensors (host memory) over the same communicator, exactly (small integers), in f32,
//!   bf16 and f16: all-reduce, all-gather along both dims, reduce-scatter, messages sent on
//!   one path and received on the other, and an all-to-all with empty pieces whose members
//!   take the device path, the host path, or a mix. Without a CUDA device (MPI on a CPU
//!   machine) both sides are CPU tensors, which checks the case itself, and it says so.

use burn_megatron::comm::{
    Buffer, Comm, CommDType, CommError, CommunicatorExt, LocalWorld, ReduceOp, World,
};
use burn_megatron::launch::{DistributedBackend, LaunchEnv, LaunchOptions, from_env};
use burn_megatron::topology::ParallelConfig;
use half::{bf16, f16};
use std::sync::Arc;
use std::time::Duration;

/// `len` values of rank `r` in `dtype`: fractions whose sums round differently in each
/// order, so a result reduced in another order than the local backend's shows.
fn values(dtype: CommDType, r: usize, len: usize, salt: usize) -> Buffer {
    let x = |i: usize| ((r * 7 + i * 3 + salt) % 11) as f64 * 0.37 - 1.3 + r as f64 * 0.011;
    let n = |i: usize| ((r * 7 + i * 3 + salt) % 11) as i64 - 4;
    match dtype {
        CommDType::F32 => Buffer::from((0..len).map(|i| x(i) as f32).collect::<Vec<_>>()),
        CommDType::F16 => Buffer::from((0..len).map(|i| f16::from_f64(x(i))).collect::<Vec<_>>()),
        CommDType::BF16 => Buffer::from((0..len).map(|i| bf16::from_f64(x(i))).collect::<Vec<_>>()),
        CommDType::I32 => Buffer::from((0..len).map(|i| n(i) as i32).collect::<Vec<_>>()),
        CommDType::I64 => Buffer::from((0..len).map(n).collect::<Vec<_>>()),
    }
}

/// Element bits, so that the comparison is exact (and -0.0 differs from 0.0).
fn bits(b: &Buffer) -> Vec<u64> {
    match b {
        Buffer::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        Buffer::F16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        Buffer::BF16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
        Buffer::I32(v) => v.iter().map(|&x| x as u32 as u64).collect(),
        Buffer::I64(v) => v.iter().map(|&x| x as u64).collect(),
    }
}

type Results = Vec<(String, Buffer)>;

/// Every collective this rank takes part in, on groups made by `world`, with named results.
fn suite(world: &dyn World, rank: usize) -> Result<Results, CommError> {
    let n = world.size();
    let mut out = Vec::new();
    let all = world.new_group("all", (0..n).collect(), rank)?;
    // Every second rank, in reverse order (group index ≠ global rank).
    let evens: Vec<usize> = (0..n).filter(|r| r % 2 == 0).rev().collect();
    let sub = evens
        .contains(&rank)
        .then(|| world.new_group("evens", evens.clone(), rank))
        .transpose()?;
    for (name, comm) in [("all", Some(&all)), ("evens", sub.as_ref())] {
        let Some(comm) = comm else { continue };
        let (g, me) = (comm.group().size(), comm.group().rank());
        for dtype in CommDType::ALL {
            for op in ReduceOp::ALL {
                // 7 elements: uneven chunks over 2, 3 and 4 ranks.
                let mut buf = values(dtype, rank, 7, 0);
                comm.all_reduce(&mut buf, op)?;
                out.push((format!("{name} all_reduce {op} {dtype}"), buf));
                let input = values(dtype, rank, 3 * g, 1);
                let part = comm.reduce_scatter(input, op)?;
                out.push((format!("{name} reduce_scatter {op} {dtype}"), part));
            }
            let gathered = comm.all_gather(values(dtype, rank, 5, 2))?;
            out.push((format!("{name} all_gather {dtype}"), gathered));
            // Every piece holds this rank's values; the others' are overwritten.
            let mut buf = values(dtype, rank, 5 * g, 2);
            comm.all_gather_in_place(&mut buf)?;
            out.push((format!("{name} all_gather_in_place {dtype}"), buf));
            for root in 0..g {
                let mut buf = values(dtype, rank, 4, 3);
                comm.broadcast(&mut buf, root)?;
                out.push((format!("{name} broadcast root {root} {dtype}"), buf));
            }
            let (next, prev) = ((me + 1) % g, (me + g - 1) % g);
            for step in 0..3 {
                let mut got = Buffer::zeros(dtype, 6);
                comm.send_recv(values(dtype, rank, 6, step), next, &mut got, prev)?;
                out.push((format!("{name} send_recv step {step} {dtype}"), got));
            }
            // Member i sends i + j + 1 elements to member j: every count differs.
            let send: Vec<usize> = (0..g).map(|j| me + j + 1).collect();
            let recv: Vec<usize> = (0..g).map(|i| i + me + 1).collect();
            let input = values(dtype, rank, send.iter().sum(), 5);
            let exchanged = comm.all_to_all_v(input, &send, &recv)?;
            out.push((format!("{name} all_to_all_v {dtype}"), exchanged));
            comm.barrier()?;
        }
        // Empty and one-element buffers and a group of one rank are fine too.
        let mut empty = Buffer::zeros(CommDType::F32, 0);
        comm.all_reduce(&mut empty, ReduceOp::Sum)?;
        out.push((format!("{name} empty all_reduce"), empty));
        for dtype in CommDType::ALL {
            let mut one = values(dtype, rank, 1, 6);
            comm.all_reduce(&mut one, ReduceOp::Sum)?;
            out.push((format!("{name} one-element all_reduce {dtype}"), one));
            let gathered = comm.all_gather(values(dtype, rank, 1, 6))?;
            out.push((format!("{name} one-element all_gather {dtype}"), gathered));
        }
    }
    let solo = world.new_group("solo", vec![rank], rank)?;
    let mut one = values(CommDType::BF16, rank, 3, 4);
    solo.all_reduce(&mut one, ReduceOp::Avg)?;
    out.push(("solo all_reduce".into(), one));
    Ok(out)
}

/// The same suite on the local backend: one thread per rank.
fn local_reference(n: usize) -> Vec<Results> {
    let world = LocalWorld::new(n);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let world = world.clone();
            std::thread::spawn(move || suite(&world, rank).expect("local suite"))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Two groups with the same members, each driven by its own thread, many calls each: every
/// result must be its own group's.
fn concurrent_groups(world: &dyn World, rank: usize) -> Result<(), String> {
    let n = world.size();
    let a = world
        .new_group("a", (0..n).collect(), rank)
        .map_err(|e| e.to_string())?;
    let b = world
        .new_group("b", (0..n).collect(), rank)
        .map_err(|e| e.to_string())?;
    let drive = |comm: Comm, base: i64| {
        std::thread::spawn(move || {
            for i in 0..100i64 {
                let mut v = vec![base + i + rank as i64];
                comm.all_reduce_vec(&mut v, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                let want = n as i64 * (base + i) + (n * (n - 1) / 2) as i64;
                if v[0] != want {
                    return Err(format!(
                        "call {i} of base {base}: {} instead of {want}",
                        v[0]
                    ));
                }
            }
            Ok(())
        })
    };
    let (ta, tb) = (drive(a, 0), drive(b, 1_000_000));
    ta.join().expect("group a's thread")?;
    tb.join().expect("group b's thread")
}

/// Float results within what reducing in another order can change: a few units in the last
/// place of the dtype, relative to the magnitude of the summands.
fn close(got: &Buffer, want: &Buffer) -> bool {
    let (g, w, eps) = match (got, want) {
        (Buffer::F32(g), Buffer::F32(w)) => (
            g.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
            w.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
            1e-5,
        ),
        (Buffer::F16(g), Buffer::F16(w)) => (
            g.iter().map(|x| x.to_f64()).collect(),
            w.iter().map(|x| x.to_f64()).collect(),
            4e-3,
        ),
        (Buffer::BF16(g), Buffer::BF16(w)) => (
            g.iter().map(|x| x.to_f64()).collect(),
            w.iter().map(|x| x.to_f64()).collect(),
            3e-2,
        ),
        _ => return false,
    };
    g.len() == w.len()
        && g.iter()
            .zip(&w)
            .all(|(a, b)| (a - b).abs() <= eps * (1.0 + b.abs()) * 4.0)
}

fn collectives(world: &dyn World, rank: usize, exact: bool) -> Result<(), String> {
    let n = world.size();
    let mine = suite(world, rank).map_err(|e| e.to_string())?;
    let reference = local_reference(n).swap_remove(rank);
    if mine.len() != reference.len() {
        return Err(format!(
            "{} results, the local backend has {}",
            mine.len(),
            reference.len()
        ));
    }
    for ((name, got), (ref_name, want)) in mine.iter().zip(&reference) {
        assert_eq!(name, ref_name);
        let reduced_float = !matches!(got, Buffer::I32(_) | Buffer::I64(_))
            && (name.contains("reduce") && !name.contains("max") && !name.contains("min"));
        let equal = got.dtype() == want.dtype()
            && if exact || !reduced_float {
                bits(got) == bits(want)
            } else {
                close(got, want)
            };
        if !equal {
            return Err(format!("{name}: {got:?}, the local backend gives {want:?}"));
        }
    }
    // An independent check of the integer sums: Σ_r values(r).
    let sum = |i: usize| {
        (0..n)
            .map(|r| ((r * 7 + i * 3) % 11) as i64 - 4)
            .sum::<i64>()
    };
    let want: Vec<i64> = (0..7).map(sum).collect();
    let got = &mine
        .iter()
        .find(|(k, _)| k == "all all_reduce sum i64")
        .expect("in the suite")
        .1;
    if *got != Buffer::from(want.clone()) {
        return Err(format!("sum of i64: {got:?} instead of {want:?}"));
    }
    concurrent_groups(world, rank)?;
    println!(
        "rank {rank}: {} results equal the local backend's",
        mine.len()
    );
    Ok(())
}

/// The `tensors` case (see the module docs): the number of checks, and the path.
fn tensors(world: &dyn World, rank: usize) -> Result<String, String> {
    use burn::tensor::{DType, Device, Tensor, TensorData};
    use burn_megatron::comm::tensor;
    use burn_megatron::tensor_parallel::mappings::all_to_all;
    let n = world.size();
    let comm = world
        .new_group("tensors", (0..n).collect(), rank)
        .map_err(|e| e.to_string())?;
    let cpu = Device::flex();
    // The GPU the communicator's NCCL runs on (GPU 0 where it has no device collectives).
    let ordinal = comm.device_collectives().map_or(0, |d| d.ordinal());
    let (gpu, path) = match burn_megatron_kernels::device::cuda_device(ordinal) {
        Ok(d) if comm.device_collectives().is_some() => (d, "device".to_string()),
        Ok(_) => (cpu.clone(), "host (no device collectives)".to_string()),
        Err(e) => (cpu.clone(), format!("host (no CUDA device: {e})")),
    };
    #[cfg(feature = "cuda")]
    let before = burn_megatron::comm::p2p_stats().device;
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    // `rows × cols` small integers of member `owner`: exact in every dtype and every order.
    let values = |owner: usize, rows: usize, cols: usize, salt: usize| -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((owner * 5 + i * 3 + salt) % 9) as f32 - 4.0)
            .collect()
    };
    let make = |dev: &Device, dtype: DType, rows: usize, cols: usize, salt: usize| {
        let v = values(rank, rows, cols, salt);
        Tensor::<2>::from_data(TensorData::new(v, [rows, cols]), dev).cast(dtype)
    };
    let read = |t: Tensor<2>| -> Vec<f32> {
        let t = t.cast(DType::F32).into_data();
        t.try_to_vec::<f32>().expect("f32 after the cast")
    };
    let mut checks = 0;
    let mut same = |what: String, device: Vec<f32>, host: Vec<f32>| {
        checks += 1;
        match device == host {
            true => Ok(()),
            false => Err(format!(
                "{what}: {device:?} on the {path} path, {host:?} on the host"
            )),
        }
    };
    let e = |e: CommError| e.to_string();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let sum =
            |dev: &Device| tensor::all_reduce(&*comm, make(dev, dtype, 3, 5, 0), ReduceOp::Sum);
        same(
            format!("all_reduce {dtype:?}"),
            read(sum(&gpu).map_err(e)?),
            read(sum(&cpu).map_err(e)?),
        )?;
        for dim in [0, 1] {
            let gather = |dev: &Device| tensor::all_gather(&*comm, make(dev, dtype, 2, 3, 1), dim);
            let (d, h) = (gather(&gpu).map_err(e)?, gather(&cpu).map_err(e)?);
            same(format!("all_gather dim {dim} {dtype:?}"), read(d), read(h))?;
        }
        let scatter = |dev: &Device| {
            tensor::reduce_scatter(&*comm, make(dev, dtype, 2 * n, 3, 2), 0, ReduceOp::Sum)
        };
        let (d, h) = (scatter(&gpu).map_err(e)?, scatter(&cpu).map_err(e)?);
        same(format!("reduce_scatter {dtype:?}"), read(d), read(h))?;
        // Each message in the ring sent on one path and received on the other (or the same).
        // A ring opens its pairs first (in the group's order), as ring code must: opened at
        // each first send, the pairs of a ring of four would wait on each other.
        comm.connect(&[next, prev]).map_err(e)?;
        for (from, to, what) in [
            (&gpu, &cpu, "gpu → cpu"),
            (&cpu, &gpu, "cpu → gpu"),
            (&gpu, &gpu, "gpu → gpu"),
        ] {
            tensor::send(&*comm, make(from, dtype, 2, 3, 3), next).map_err(e)?;
            let got: Tensor<2> = tensor::recv(&*comm, [2, 3], dtype, to, prev).map_err(e)?;
            same(
                format!("send/recv {what} {dtype:?}"),
                read(got),
                values(prev, 2, 3, 3),
            )?;
        }
        // Member i sends (i + j) mod 3 rows to member j: empty pieces among them.
        let send: Vec<usize> = (0..n).map(|j| (rank + j) % 3).collect();
        let recv: Vec<usize> = (0..n).map(|i| (i + rank) % 3).collect();
        let rows = send.iter().sum();
        let exchange = |dev: &Device| {
            all_to_all(make(dev, dtype, rows, 4, 4), &send, &recv, &comm).map_err(|e| e.to_string())
        };
        let host = read(exchange(&cpu)?);
        same(
            format!("all_to_all {dtype:?}"),
            read(exchange(&gpu)?),
            host.clone(),
        )?;
        // Rank 0 on the host path, the others on the device path.
        let mixed = exchange(if rank == 0 { &cpu } else { &gpu })?;
        same(
            format!("all_to_all, rank 0 on the host path, {dtype:?}"),
            read(mixed),
            host,
        )?;
    }
    #[cfg(feature = "cuda")]
    if path == "device" && burn_megatron::comm::p2p_stats().device == before {
        return Err("no message took the device path".into());
    }
    Ok(format!(
        "{checks} tensor ops on the {path} path equal the host path's"
    ))
}

/// 64 MiB collectives against their closed forms (see the module docs).
fn large(world: &dyn World, rank: usize) -> Result<(), String> {
    let n = world.size();
    let err = |e: CommError| e.to_string();
    let all = world
        .new_group("large", (0..n).collect(), rank)
        .map_err(err)?;
    let len = 64 << 18; // 64 MiB of f32
    let v = |r: usize, i: usize| ((r * 7 + i) % 13) as f32 - 6.0;
    let sum = |i: usize| (0..n).map(|r| v(r, i)).sum::<f32>();
    let mut x: Vec<f32> = (0..len).map(|i| v(rank, i)).collect();
    let start = std::time::Instant::now();
    all.all_reduce_vec(&mut x, ReduceOp::Sum).map_err(err)?;
    let f32_s = start.elapsed().as_secs_f64();
    if let Some(i) = (0..len).find(|&i| x[i] != sum(i)) {
        return Err(format!(
            "f32 all_reduce: element {i} is {}, not {}",
            x[i],
            sum(i)
        ));
    }
    let mut y: Vec<bf16> = (0..2 * len).map(|i| bf16::from_f32(v(rank, i))).collect();
    all.all_reduce_vec(&mut y, ReduceOp::Sum).map_err(err)?;
    if let Some(i) = (0..2 * len).find(|&i| y[i].to_f32() != sum(i)) {
        return Err(format!(
            "bf16 all_reduce: element {i} is {}, not {}",
            y[i],
            sum(i)
        ));
    }
    let part = len / n;
    let start = std::time::Instant::now();
    let gathered = all
        .all_gather_vec((0..part).map(|i| v(rank, i)).collect::<Vec<f32>>())
        .map_err(err)?;
    let gather_s = start.elapsed().as_secs_f64();
    if let Some(k) = (0..n * part).find(|&k| gathered[k] != v(k / part, k % part)) {
        return Err(format!("all_gather: element {k} is {}", gathered[k]));
    }
    let gb = (len * 4) as f64 / 1e9;
    println!(
        "rank {rank}: 64 MiB all_reduce (f32, bf16) and all_gather exact; f32 all_reduce \
         {:.0} ms ({:.2} GB/s of buffer), all_gather {:.0} ms",
        f32_s * 1e3,
        gb / f32_s,
        gather_s * 1e3
    );
    Ok(())
}

/// One all-reduce, then the last rank dies by SIGKILL and the others all-reduce again.
fn killed_peer(world: &dyn World, rank: usize) -> Result<(), String> {
    let n = world.size();
    let dp = world
        .new_group("dp", (0..n).collect(), rank)
        .map_err(|e| e.to_string())?;
    let mut v = vec![1i64];
    dp.all_reduce_vec(&mut v, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if rank == n - 1 {
        println!("rank {rank}: killing myself");
        // SAFETY: signals this process; nothing runs after it.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    std::thread::sleep(Duration::from_secs(1));
    let start = std::time::Instant::now();
    let result = dp.all_reduce_vec(&mut v, ReduceOp::Sum);
    match result {
        Ok(()) => Err("an all-reduce with a killed member succeeded".into()),
        Err(e) => {
            println!(
                "rank {rank}: the all-reduce failed after {:.1} s: {e}",
                start.elapsed().as_secs_f64()
            );
            Err(e.to_string())
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let case = args.next().unwrap_or_default();
    let backend: DistributedBackend = match args.next().as_deref().unwrap_or("mpi").parse() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let timeout = std::env::var("COMM_SUITE_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(60), Duration::from_secs);
    let n = LaunchEnv::from_env().map_or(1, |env| env.world_size);
    let options = LaunchOptions::default()
        .with_backend(backend)
        .with_timeout(timeout);
    let exact = backend != DistributedBackend::Nccl;
    let result = from_env(&ParallelConfig::new(n, 1, 1), options, |ctx| {
        let rank = ctx.state.global_rank();
        let world: Arc<dyn World> = ctx.world.clone();
        match case.as_str() {
            "collectives" => collectives(world.as_ref(), rank, exact),
            "large" => large(world.as_ref(), rank),
            "killed-peer" => killed_peer(world.as_ref(), rank),
            "tensors" => tensors(world.as_ref(), rank).map(|done| println!("rank {rank}: {done}")),
            "mismatch" => {
                let tp = world
                    .new_group("tp", (0..n).collect(), rank)
                    .map_err(|e| e.to_string())?;
                let result = if rank == 0 {
                    tp.all_reduce(&mut Buffer::zeros(CommDType::F32, 4), ReduceOp::Sum)
                } else {
                    tp.all_gather(Buffer::zeros(CommDType::F32, 4)).map(|_| ())
                };
                result.map_err(|e| e.to_string())
            }
            "early-exit" => {
                if rank == n - 1 {
                    return Ok(());
                }
                let dp = ctx.groups.dp.clone();
                let mut buf = Buffer::zeros(CommDType::F32, 4);
                dp.all_reduce(&mut buf, ReduceOp::Sum)
                    .map_err(|e| e.to_string())
            }
            "late-group" => {
                if rank == n - 1 {
                    std::thread::sleep(Duration::from_secs(20));
                }
                world
                    .new_group("late", (0..n).collect(), rank)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            "slow-barrier" => {
                if rank == n - 1 {
                    std::thread::sleep(Duration::from_secs(3));
                }
                ctx.groups
                    .world
                    .barrier_with_timeout(Duration::from_secs(30))
                    .map_err(|e| e.to_string())?;
                println!("rank {rank}: past the slow barrier");
                Ok(())
            }
            other => Err(format!(
                "unknown case {other:?}: collectives, large, killed-peer, mismatch, early-exit, \
                 late-group, slow-barrier, tensors"
            )),
        }
    });
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
