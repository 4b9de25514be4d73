//! The MPI backend under `mpirun`, one process per rank: the collective suite at 2, 3 and 4
//! processes, and the failures that must end the whole job quickly with a message naming
//! the group and the op. Compiled only with the `mpi` feature; it then needs `mpirun`.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `mpirun -np n comm_suite case mpi`, as root too, with more processes than cores allowed.
fn mpirun(n: usize, case: &str, timeout_s: u64) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new("mpirun")
        .args([
            "-np",
            &n.to_string(),
            env!("CARGO_BIN_EXE_comm_suite"),
            case,
            "mpi",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("COMM_SUITE_TIMEOUT_S", timeout_s.to_string())
        .output()
        .expect("mpirun runs (Debian: openmpi-bin)");
    (out, start.elapsed())
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_op_and_dtype_equals_the_local_backend_at_2_3_and_4_processes() {
    for n in [2, 3, 4] {
        let (out, _) = mpirun(n, "collectives", 60);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "np {n}: {stdout}\n{stderr}");
        for rank in 0..n {
            assert!(
                stdout.contains(&format!("rank {rank}: "))
                    && stdout.contains("equal the local backend's"),
                "np {n}, rank {rank} did not report: {stdout}"
            );
        }
    }
}

/// The `tensors` case on CPU tensors (no GPU here: both sides take the host path), which
/// checks the case's own arithmetic before it runs on GPUs under NCCL: the messages against
/// their senders' values, the all-to-all's splits with empty pieces.
#[test]
fn the_tensor_case_agrees_with_itself_on_the_host_path() {
    for n in [2, 3] {
        let (out, _) = mpirun(n, "tensors", 60);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "np {n}: {stdout}\n{stderr}");
        for rank in 0..n {
            assert!(
                stdout.contains(&format!("rank {rank}: 27 tensor ops on the host")),
                "np {n}, rank {rank} did not report: {stdout}"
            );
        }
    }
}

/// 64 MiB buffers, the size of a bucket of gradients, at 3 processes (uneven gather parts
/// would show).
#[test]
fn sixty_four_mib_collectives_are_exact() {
    let (out, _) = mpirun(3, "large", 120);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..3 {
        assert!(
            stdout.contains(&format!(
                "rank {rank}: 64 MiB all_reduce (f32, bf16) and all_gather exact"
            )),
            "rank {rank} did not report: {stdout}"
        );
    }
}

#[test]
fn a_mismatched_collective_ends_the_job_naming_group_and_op() {
    let (out, took) = mpirun(3, "mismatch", 60);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        stderr.contains("collective mismatch on group 'tp' [0, 1, 2]"),
        "{stderr}"
    );
    assert!(
        stderr.contains("global rank 0: all_reduce(sum, f32 × 4)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("global rank 1: all_gather(f32 × 4)"),
        "{stderr}"
    );
}

/// With the default-sized timeout (60 s): the exit notice, not the timeout, ends the job.
#[test]
fn a_rank_that_exits_early_ends_the_job_naming_group_op_and_rank() {
    let (out, took) = mpirun(3, "early-exit", 60);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        stderr.contains(
            "all_reduce on group 'dp' [0, 1, 2] cannot complete: global rank 2 has already exited"
        ),
        "{stderr}"
    );
}

/// Group creation (`MPI_Comm_create_group`, which has no deadline) is bounded by the
/// timeout: a member that does not come ends the job naming it, not at its arrival.
#[test]
fn a_group_a_member_does_not_create_ends_the_job_within_the_timeout() {
    let (out, took) = mpirun(2, "late-group", 2);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert!(
        stderr.contains("new_group #0 on group 'late' [0, 1] timed out")
            && stderr.contains("global rank(s) [1] did not take part"),
        "{stderr}"
    );
}

/// A barrier given its own bound outlasts the collective timeout (a slow checkpoint save).
#[test]
fn a_barrier_with_its_own_timeout_outlasts_the_collective_timeout() {
    let (out, _) = mpirun(2, "slow-barrier", 1);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("rank {rank}: past the slow barrier")),
            "{stdout}"
        );
    }
}
