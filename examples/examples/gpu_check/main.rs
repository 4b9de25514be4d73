//! The GPU check: everything a lent GPU machine should confirm, in one binary that
//! `scripts/gpu_check.sh` runs (with the kernel test binary) in a few minutes. Each check
//! prints one line, `PASS`, `FAIL` or `SKIP` (with why), and the numbers:
//!
//! - `libraries`: libcuda, libnvrtc, libnccl; Vulkan GPU through wgpu.
//! - `models`: BERT and the GPT model (Llama-style) for `--iters` iterations on each GPU
//!   device, with the unfused and the flash attention, against the same run on the CPU
//!   (unfused), every iteration's loss within 1e-3 (relative, f32, no dropout). The CPU runs
//!   always happen.
//! - `bf16`: bf16 training steps (the median of five after two of warm-up) of a BERT-large-sized model (24 layers, hidden 1024,
//!   seq 512) and of a Llama-style GPT (12 layers, hidden 2048, GQA, SwiGLU) on CUDA:
//!   TFLOP/s, the fraction of the H200's dense bf16 peak and the device memory in use; on the
//!   CPU small models' bf16 steps, so that the paths run here too. `--bf16-models gpt` runs
//!   one; `--bf16-variants cublaslt,chunked,flash,cubecl,host-order` times each GEMM engine,
//!   attention backend and stream order, with the GEMMs and synchronisations per step.
//! - `nccl`: a one-rank NCCL world: its collectives against their closed forms.
//! - `nvrtc`: the flash attention kernels' CUDA C++ for sm_90a compiled by NVRTC (no GPU
//!   needed), with ptxas's registers and spills per kernel.
//!
//! ```text
//! cargo build --release -p burn-megatron-examples --features cuda,wgpu --example gpu_check
//! target/release/examples/gpu_check                  # every check
//! target/release/examples/gpu_check models bf16      # some
//! ```
//!
//! The exit status is 1 when any check failed (a skipped one is not a failure).

mod models;
mod nccl;
mod nvrtc;

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
struct Args {
    /// Checks to run (default: all): libraries, models, bf16, nccl, nvrtc.
    checks: Vec<String>,
    /// Iterations of each model run.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Where the runs write their loss plots.
    #[arg(long, default_value = "target/gpu_check")]
    out: std::path::PathBuf,
    /// The bf16 check's models (gpt, bert, llama1b; default gpt and bert): one alone for a
    /// per-kernel profile of its steps.
    #[arg(long, value_delimiter = ',', default_values_t = ["bert".to_string(), "gpt".to_string()])]
    bf16_models: Vec<String>,
    /// The bf16 check's GEMM engines and stream orders on CUDA, each timed in turn in this
    /// process: `default` (as the environment says), `cublaslt` (cuBLASLt, ordered on the
    /// device), `chunked` and `flash` (that, with `--attention-backend chunked` or `flash`),
    /// `host-order` (cuBLASLt, ordered by host synchronisations), `cubecl` (cubek's matmul,
    /// as Burn runs it).
    #[arg(long, value_delimiter = ',', default_values_t = ["default".to_string()])]
    bf16_variants: Vec<String>,
}

/// The lines printed so far, and whether any failed.
#[derive(Default)]
pub struct Report {
    failed: usize,
}

impl Report {
    fn line(&mut self, verdict: &str, name: &str, detail: &str) {
        println!("{verdict} {name}: {detail}");
    }

    /// A check that held.
    pub fn pass(&mut self, name: &str, detail: impl AsRef<str>) {
        self.line("PASS", name, detail.as_ref());
    }

    /// A check that did not.
    pub fn fail(&mut self, name: &str, detail: impl AsRef<str>) {
        self.failed += 1;
        self.line("FAIL", name, detail.as_ref());
    }

    /// A check this machine cannot run, and why.
    pub fn skip(&mut self, name: &str, why: impl AsRef<str>) {
        self.line("SKIP", name, why.as_ref());
    }

    /// `pass` or `fail` by `ok`.
    pub fn check(&mut self, name: &str, ok: bool, detail: impl AsRef<str>) {
        if ok {
            self.pass(name, detail)
        } else {
            self.fail(name, detail)
        }
    }
}

/// The GPU devices this build and machine have, by name, or why each is missing.
pub fn gpu_devices() -> Vec<(&'static str, Result<(), String>)> {
    use burn_megatron_kernels::device::{cuda_device, wgpu_gpu_device};
    vec![
        ("cuda", cuda_device(0).map(|_| ())),
        ("wgpu", wgpu_gpu_device().map(|_| ())),
    ]
}

fn libraries(report: &mut Report) {
    #[cfg(feature = "cuda")]
    report.pass(
        "libraries",
        format!(
            "{}; {}",
            burn_megatron::cuda::cuda_libraries(),
            burn_megatron::comm::nccl::loaded_library().unwrap_or_else(|e| e)
        ),
    );
    #[cfg(not(feature = "cuda"))]
    report.skip("libraries", "built without the `cuda` feature");
    for (name, device) in gpu_devices() {
        match device {
            Ok(()) => report.pass(&format!("device {name}"), "opened"),
            Err(why) => report.skip(&format!("device {name}"), why),
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let all = ["libraries", "models", "bf16", "nccl", "nvrtc"];
    let checks: Vec<&str> = if args.checks.is_empty() {
        all.to_vec()
    } else {
        args.checks.iter().map(String::as_str).collect()
    };
    if let Some(bad) = checks.iter().find(|c| !all.contains(c)) {
        eprintln!("gpu_check: unknown check {bad}; the checks are {all:?}");
        return ExitCode::from(2);
    }
    let _ = std::fs::create_dir_all(&args.out);
    let mut report = Report::default();
    for check in checks {
        let start = std::time::Instant::now();
        match check {
            "libraries" => libraries(&mut report),
            "models" => models::parity(&mut report, args.iters, &args.out),
            "bf16" => models::bf16_step(
                &mut report,
                &args.out,
                &args.bf16_models,
                &args.bf16_variants,
            ),
            "nvrtc" => nvrtc::flash(&mut report, &args.out),
            _ => nccl::one_rank(&mut report),
        }
        println!("      ({check}: {:.1} s)", start.elapsed().as_secs_f64());
    }
    if report.failed > 0 {
        println!("gpu_check: {} check(s) failed", report.failed);
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
