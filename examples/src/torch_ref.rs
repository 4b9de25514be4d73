//! The benchmarks' PyTorch references (`--torch`): a Python script, run as a child process,
//! that times its own steps and prints `step_s <seconds>`.
//!
//! PyTorch on a CPU allocates through glibc's malloc, which returns every freed block above
//! 32 MiB to the kernel: each step then faults the pages of its large tensors (the logits)
//! in again, zeroed by the kernel. Our examples' allocator keeps freed memory (`alloc.rs`),
//! so a like-for-like comparison runs the reference with glibc told to keep it too
//! ([`KEEP_MEMORY`]); the benchmarks print both.

use std::path::Path;
use std::process::Command;

/// `GLIBC_TUNABLES` for glibc's malloc serving every size from its heap and never trimming
/// it: freed memory is kept for the next step. It reaches only the child (our binaries use
/// mimalloc).
pub const KEEP_MEMORY: &str = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184";

/// Seconds per step that `python3 script args…` reports, with glibc keeping freed memory
/// when `keep_memory`.
pub fn step_seconds(script: &Path, args: &[String], keep_memory: bool) -> Result<f64, String> {
    let mut cmd = Command::new("python3");
    if keep_memory {
        cmd.env("GLIBC_TUNABLES", KEEP_MEMORY);
    }
    let out = cmd
        .arg(script)
        .args(args)
        .output()
        .map_err(|e| format!("python3 {}: {e}", script.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "the PyTorch reference failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    text.split_whitespace()
        .skip_while(|w| *w != "step_s")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no step_s in the reference's output: {text}"))
}
