//! `bert_pretrain` (and `gpt_pretrain`) under `mpirun`, one process per rank: the same run as
//! the threaded one, checkpoints per rank, an exact resume, and launch errors before any
//! work. Compiled only with the `mpi` feature; it then needs `mpirun`.

use crate::common::{
    args, argv, assert_same_iterations, binary, example_binary, gpt_args, gpt_argv, tmp,
};
use burn_megatron_examples::pretrain::{read_log_json, run, run_gpt};
use std::path::Path;
use std::process::{Command, Output};

/// The launchers' variables: none may leak into a run from the test's own environment.
const LAUNCH_VARS: [&str; 12] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
];

fn command(program: &Path) -> Command {
    let mut c = Command::new(program);
    for var in LAUNCH_VARS {
        c.env_remove(var);
    }
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    c
}

/// `mpirun -np n bert_pretrain <argv> --distributed-backend mpi`.
fn mpirun(n: usize, flags: &[&str], dir: &Path) -> Output {
    let mut argv = argv(flags, dir);
    argv.remove(0);
    command(Path::new("mpirun"))
        .args(["-np", &n.to_string()])
        .arg(binary())
        .args(argv)
        .args(["--distributed-backend", "mpi"])
        .output()
        .expect("mpirun runs (Debian: openmpi-bin)")
}

fn succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// TP 2 × DP 2, 10 iterations with checkpoints at 5 and 10.
#[test]
fn tp2_dp2_under_mpirun_is_the_threaded_run_and_resumes_exactly() {
    let dir = tmp("mpi");
    let (save, full, resumed) = (
        dir.join("ck"),
        dir.join("full.jsonl"),
        dir.join("resumed.jsonl"),
    );
    let layout = [
        "--world-size",
        "4",
        "--train-iters",
        "10",
        "--eval-interval",
        "0",
    ];
    let threaded = run(&args(&layout, &dir)).unwrap().log;
    let save_flags = ["--save", save.to_str().unwrap(), "--save-interval", "5"];
    let out = mpirun(
        4,
        &[
            &layout[..],
            &save_flags,
            &["--log-json", full.to_str().unwrap()],
        ]
        .concat(),
        &dir,
    );
    succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("> BERT").count(),
        1,
        "only rank 0 logs: {stdout}"
    );
    let mpi = read_log_json(&full).unwrap();
    // Bit for bit: the MPI backend reduces in the local backend's order.
    assert_same_iterations(&threaded, &mpi);
    for it in [5, 10] {
        for tp in 0..2 {
            let shard = save.join(format!("iter_{it:07}/mp_rank_{tp:02}"));
            assert!(shard.is_dir(), "{} missing", shard.display());
        }
    }
    let latest = std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(latest.trim(), "10");
    // Resume from iteration 5, as if the run had stopped there.
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), "5").unwrap();
    let load = ["--load", save.to_str().unwrap()];
    let out = mpirun(
        4,
        &[
            &layout[..],
            &load,
            &["--log-json", resumed.to_str().unwrap()],
        ]
        .concat(),
        &dir,
    );
    succeeded(&out);
    assert_same_iterations(&mpi[5..], &read_log_json(&resumed).unwrap());
}

/// Pipelines too: p2p between stage processes, the tied embedding over the embedding group,
/// one DP communicator per chunk; and the timeline, gathered to rank 0.
#[test]
fn interleaved_pipeline_under_mpirun_is_the_threaded_run() {
    let dir = tmp("mpi-pp");
    let log = dir.join("pp.jsonl");
    let layout = [
        "--world-size",
        "4",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers",
        "4",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--micro-batch-size",
        "1",
        "--overlap-grad-reduce",
        "--train-iters",
        "4",
        "--eval-interval",
        "0",
    ];
    let threaded = run(&args(&layout, &dir)).unwrap().log;
    let trace = dir.join("trace.json");
    let flags = [
        "--log-json",
        log.to_str().unwrap(),
        "--timeline",
        trace.to_str().unwrap(),
    ];
    let out = mpirun(4, &[&layout[..], &flags].concat(), &dir);
    succeeded(&out);
    assert_same_iterations(&threaded, &read_log_json(&log).unwrap());
    // Rank 0 drew every process's spans on one time axis.
    let events: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let span = |tid: u64, name: &str| {
        let e = events
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["tid"].as_u64() == Some(tid) && e["name"] == name)
            .unwrap_or_else(|| panic!("{name} of rank {tid} missing from the trace"));
        let ts = e["ts"].as_f64().unwrap();
        (ts, ts + e["dur"].as_f64().unwrap())
    };
    for tid in 0..4 {
        span(tid, "F3.1");
        span(tid, "B0.0");
    }
    // Global ranks 0 and 2 are stages 0 and 1 of one pipeline: stage 1 starts microbatch 0
    // after stage 0 sent it (1 ms of clock skew allowed, in µs).
    assert!(span(2, "F0.0").0 >= span(0, "F0.0").1 - 1000.0);
    assert_eq!(&std::fs::read(dir.join("trace.png")).unwrap()[1..4], b"PNG");
}

/// BERT under context parallelism between processes: TP 2 × CP 2 with sequence
/// parallelism, bidirectional attention over K/V passed around the ring (`p2p`) or
/// all-gathered, is the threaded run, bit for bit.
#[test]
fn a_context_parallel_bert_under_mpirun_is_the_threaded_run() {
    for comm_type in ["p2p", "all_gather"] {
        let dir = tmp(&format!("mpi-bert-cp-{comm_type}"));
        let log = dir.join("cp.jsonl");
        let layout = [
            "--world-size",
            "4",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            comm_type,
            "--sequence-parallel",
            "--train-iters",
            "4",
            "--eval-interval",
            "0",
        ];
        let threaded = run(&args(&layout, &dir)).unwrap().log;
        let out = mpirun(
            4,
            &[&layout[..], &["--log-json", log.to_str().unwrap()]].concat(),
            &dir,
        );
        succeeded(&out);
        assert_same_iterations(&threaded, &read_log_json(&log).unwrap());
    }
}

/// `gpt_pretrain` with `layout` under `mpirun -np 4`, against the threaded run: every
/// iteration equal.
fn gpt_under_mpirun_is_the_threaded_run(layout: &[&str], dir: &Path) {
    let log = dir.join("gpt.jsonl");
    let threaded = run_gpt(&gpt_args(layout, dir)).unwrap().log;
    let mut argv = gpt_argv(
        &[layout, &["--log-json", log.to_str().unwrap()]].concat(),
        dir,
    );
    argv.remove(0);
    let out = command(Path::new("mpirun"))
        .args(["-np", "4"])
        .arg(example_binary("gpt_pretrain"))
        .args(argv)
        .args(["--distributed-backend", "mpi"])
        .output()
        .expect("mpirun runs (Debian: openmpi-bin)");
    succeeded(&out);
    assert_same_iterations(&threaded, &read_log_json(&log).unwrap());
}

/// A Llama-style GPT at TP 2 × PP 2 with sequence parallelism: each process trains the same
/// byte-level BPE on the built-in corpus, and the run is the threaded one, bit for bit.
#[test]
fn a_llama_style_gpt_pipeline_under_mpirun_is_the_threaded_run() {
    let dir = tmp("mpi-gpt");
    let layout = [
        "--world-size",
        "4",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--train-iters",
        "4",
        "--eval-interval",
        "0",
        "--generate-tokens",
        "0",
    ];
    gpt_under_mpirun_is_the_threaded_run(&layout, &dir);
}

/// Context parallelism under mpirun: TP 2 × CP 2 with sequence parallelism, K and V
/// all-gathered (`all_gather`), passed around the ring (`p2p`, send/recv between
/// processes) or traded for heads (`a2a`, all-to-alls), is the threaded run, bit for bit.
#[test]
fn a_context_parallel_gpt_under_mpirun_is_the_threaded_run() {
    for comm_type in ["all_gather", "p2p", "a2a"] {
        let dir = tmp(&format!("mpi-gpt-cp-{comm_type}"));
        let layout = [
            "--world-size",
            "4",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            comm_type,
            "--sequence-parallel",
            "--train-iters",
            "4",
            "--eval-interval",
            "0",
            "--generate-tokens",
            "0",
        ];
        gpt_under_mpirun_is_the_threaded_run(&layout, &dir);
    }
}

/// Mixture of experts under mpirun: TP 2 × EP 2 × DP 2 with sequence parallelism, tokens
/// exchanged between processes by the variable-size all-to-all (`alltoall`) or gathered
/// (`allgather`), and with each expert split over the TP ranks (expert TP 2), is the
/// threaded run, bit for bit.
#[test]
fn an_expert_parallel_gpt_under_mpirun_is_the_threaded_run() {
    for (dispatcher, etp) in [("alltoall", "1"), ("allgather", "1"), ("alltoall", "2")] {
        let dir = tmp(&format!("mpi-gpt-moe-{dispatcher}-{etp}"));
        let layout = [
            "--expert-tensor-parallel-size",
            etp,
            "--world-size",
            "4",
            "--num-experts",
            "4",
            "--expert-model-parallel-size",
            "2",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--moe-token-dispatcher-type",
            dispatcher,
            "--sequence-parallel",
            "--train-iters",
            "4",
            "--eval-interval",
            "0",
            "--generate-tokens",
            "0",
        ];
        gpt_under_mpirun_is_the_threaded_run(&layout, &dir);
    }
}

#[test]
fn bad_launch_environments_stop_before_any_work() {
    let dir = tmp("mpi-env");
    // Not started by a launcher at all.
    let mut a = argv(&["--world-size", "4"], &dir);
    a.remove(0);
    let out = command(&binary())
        .args(&a)
        .args(["--distributed-backend", "mpi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no launcher found"), "{stderr}");
    assert!(out.stdout.is_empty(), "no work may start");
    // Two processes for a layout of four.
    let out = mpirun(2, &["--world-size", "4"], &dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Open MPI started 2 processes but --world-size is 4"),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("iteration"),
        "no work may start"
    );
}
