//! What the pretraining tests share: small models' flags and exact comparisons.

pub use burn_megatron_examples::pretrain::LLAMA_STYLE;
use burn_megatron_examples::pretrain::{Args, GptArgs, IterationLog};
use clap::Parser;
use std::path::Path;
use std::path::PathBuf;

/// A fresh directory for one test.
pub fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bm-pretrain-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The command line of a small model that trains in seconds in the dev profile.
pub fn argv(extra: &[&str], dir: &std::path::Path) -> Vec<String> {
    let plot = dir.join("loss.png");
    let mut argv = vec![
        "bert_pretrain",
        "--tensor-model-parallel-size",
        "2",
        "--world-size",
        "2",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        "40",
        "--lr",
        "3e-3",
        "--synthetic-documents",
        "600",
        "--log-interval",
        "10",
        "--eval-interval",
        "20",
        "--eval-iters",
        "2",
        "--no-progress",
        "--loss-plot",
        plot.to_str().unwrap(),
    ];
    argv.extend_from_slice(extra);
    argv.into_iter().map(String::from).collect()
}

/// A tiny Llama-style model (GQA, RoPE, RMSNorm, SwiGLU, no biases, untied) at TP 2.
pub fn gpt_argv(extra: &[&str], dir: &Path) -> Vec<String> {
    let plot = dir.join("loss.png");
    let mut v = vec![
        "gpt_pretrain",
        "--tensor-model-parallel-size",
        "2",
        "--world-size",
        "2",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        "40",
        "--lr",
        "3e-3",
        "--synthetic-documents",
        "600",
        "--vocab-size",
        "400",
        "--log-interval",
        "10",
        "--eval-interval",
        "20",
        "--eval-iters",
        "2",
        "--generate-tokens",
        "8",
        "--no-progress",
        "--loss-plot",
        plot.to_str().unwrap(),
    ];
    v.extend_from_slice(LLAMA_STYLE);
    v.extend_from_slice(extra);
    v.into_iter().map(String::from).collect()
}

/// [`gpt_argv`], parsed.
pub fn gpt_args(extra: &[&str], dir: &Path) -> GptArgs {
    GptArgs::try_parse_from(gpt_argv(extra, dir)).unwrap()
}

/// [`argv`], parsed.
pub fn args(extra: &[&str], dir: &std::path::Path) -> Args {
    Args::try_parse_from(argv(extra, dir)).unwrap()
}

/// Two runs that must agree bit for bit: the same iterations with the same learning rate,
/// losses and grad norm.
pub fn assert_same_iterations(a: &[IterationLog], b: &[IterationLog]) {
    assert_eq!(a.len(), b.len(), "iteration counts differ");
    for (x, y) in a.iter().zip(b) {
        let at = format!("iteration {}", x.iteration);
        assert_eq!((x.iteration, x.lr), (y.iteration, y.lr), "{at}");
        assert_eq!((x.lm_loss, x.sop_loss), (y.lm_loss, y.sop_loss), "{at}");
        assert_eq!(x.grad_norm, y.grad_norm, "{at}");
    }
}

/// Two runs that must agree up to the order of sums: the same iterations, each lm loss and
/// grad norm within `tol` of the other's (relative).
pub fn assert_close_losses(what: &str, a: &[IterationLog], b: &[IterationLog], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: iteration counts differ");
    for (x, y) in a.iter().zip(b) {
        let relative = |p: f64, q: f64| (p - q).abs() / q.abs().max(1e-12);
        let at = format!("{what} iteration {}", x.iteration);
        let d = relative(x.lm_loss, y.lm_loss);
        assert!(d < tol, "{at}: lm loss {} vs {}", x.lm_loss, y.lm_loss);
        // Adam's update hardly changes when every gradient is off by one factor, so the
        // losses alone would not show a wrong reduction; the norm does.
        match (x.grad_norm, y.grad_norm) {
            (Some(p), Some(q)) => {
                assert!(relative(p, q) < tol, "{at}: grad norm {p} vs {q}")
            }
            (p, q) => assert_eq!(p.is_some(), q.is_some(), "{at}: one step skipped"),
        }
    }
}

/// The example binary, built by `cargo test --workspace` (or `-p burn-megatron-examples`)
/// with this crate's features.
pub fn binary() -> PathBuf {
    example_binary("bert_pretrain")
}

/// The example binary `name` (`target/<profile>/examples/<name>`).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.is_file(),
        "{} not built: run `cargo test --workspace` or `-p burn-megatron-examples`, which build examples",
        bin.display()
    );
    bin
}

/// BERT's sentence-order loss, which every BERT iteration logs.
pub fn sop(e: &IterationLog) -> f64 {
    e.sop_loss.expect("BERT logs the sentence-order loss")
}
