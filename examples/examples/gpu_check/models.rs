//! The model checks: BERT and the GPT model on each GPU device against the CPU, and a bf16
//! training step's achieved FLOP/s.

use super::{Report, gpu_devices};
use burn_megatron_examples::pretrain::{Args, GptArgs, IterationLog, LLAMA_STYLE, run, run_gpt};
use clap::Parser;
use std::path::Path;

/// The dense bf16 peak of one H200 (SXM), TFLOP/s.
const H200_BF16_PEAK: f64 = 989.0;

/// Steps of each bf16 model, and how many of them warm up before the timed ones.
const BF16_STEPS: usize = 7;
const BF16_WARMUP: usize = 2;

/// The device's memory in use after a run, as its driver counts it (CubeCL's pools keep what
/// they reserved, so this is the run's peak reservation), or why there is no count.
fn device_memory(device: &str) -> String {
    #[cfg(feature = "cuda")]
    if device == "cuda" {
        return match burn_megatron::cuda::device_memory(0) {
            Ok(m) => format!("device memory {m} (driver)"),
            Err(e) => format!("device memory unknown: {e}"),
        };
    }
    format!("device memory not counted on {device}")
}

/// Flags every run shares: one rank, no dropout (its masks are drawn per device), no
/// validation, quiet; the corpus is `documents` synthetic documents.
fn common(device: &str, iters: usize, documents: usize, plot: &Path) -> Vec<String> {
    let flags = [
        "--world-size",
        "1",
        "--tensor-model-parallel-size",
        "1",
        "--train-iters",
        &iters.to_string(),
        "--lr",
        "3e-3",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--eval-interval",
        "0",
        "--log-interval",
        "1000000",
        "--no-progress",
        "--device",
        device,
        "--loss-plot",
        &plot.display().to_string(),
        "--synthetic-documents",
        &documents.to_string(),
    ];
    flags.iter().map(|s| s.to_string()).collect()
}

/// `model`'s flags: (layers, hidden, heads, seq, micro-batch).
fn shape(layers: usize, hidden: usize, heads: usize, seq: usize, micro: usize) -> Vec<String> {
    [
        ("--num-layers", layers),
        ("--hidden-size", hidden),
        ("--num-attention-heads", heads),
        ("--seq-length", seq),
        ("--micro-batch-size", micro),
        ("--global-batch-size", micro * 2),
    ]
    .iter()
    .flat_map(|(k, v)| [k.to_string(), v.to_string()])
    .collect()
}

/// A Llama-style GPT's flags: GQA with `groups` query groups, RoPE, RMSNorm, SwiGLU, no
/// biases, untied, and the corpus's 400-token vocabulary (512 padded).
fn llama(groups: usize) -> Vec<String> {
    let groups = groups.to_string();
    let rest = [
        "--group-query-attention",
        "--num-query-groups",
        &groups,
        "--generate-tokens",
        "0",
        "--vocab-size",
        "400",
    ];
    [LLAMA_STYLE, &rest[..]]
        .concat()
        .into_iter()
        .map(String::from)
        .collect()
}

/// `family`'s lm losses over `iters` iterations on `device` with `--attention-backend
/// attention`.
fn train(
    family: &str,
    device: &str,
    attention: &str,
    iters: usize,
    out: &Path,
) -> Result<Vec<f64>, String> {
    let plot = out.join(format!("{family}-{device}-{attention}.png"));
    let mut argv = vec![format!("{family}_pretrain")];
    argv.extend(common(device, iters, 600, &plot));
    argv.extend(shape(2, 64, 4, 64, 4));
    argv.extend(["--attention-backend".to_string(), attention.to_string()]);
    let log: Vec<IterationLog> = if family == "gpt" {
        argv.extend(llama(2));
        run_gpt(&GptArgs::try_parse_from(argv).map_err(|e| e.to_string())?)?.log
    } else {
        run(&Args::try_parse_from(argv).map_err(|e| e.to_string())?)?.log
    };
    Ok(log.iter().map(|e| e.lm_loss).collect())
}

/// Each model on the CPU, then on every GPU device there is, with the unfused and the flash
/// attention (the Cube kernels), every iteration's loss within 1e-3 of the CPU's unfused run
/// (relative).
pub fn parity(report: &mut Report, iters: usize, out: &Path) {
    let devices = gpu_devices();
    for family in ["bert", "gpt"] {
        let name = format!("models {family} cpu");
        let cpu = match train(family, "cpu", "unfused", iters, out) {
            Ok(cpu) => cpu,
            Err(e) => {
                report.fail(&name, e);
                continue;
            }
        };
        let (first, last) = (cpu[0], cpu[cpu.len() - 1]);
        report.check(
            &name,
            cpu.len() == iters && last < first,
            format!("{} iterations, lm loss {first:.4} → {last:.4}", cpu.len()),
        );
        for ((device, available), attention) in
            devices.iter().flat_map(|d| [(d, "unfused"), (d, "flash")])
        {
            let name = format!("models {family} {device} ({attention} attention) vs cpu");
            if let Err(why) = available {
                report.skip(&name, why);
                continue;
            }
            match train(family, device, attention, iters, out) {
                Ok(gpu) if gpu.len() == cpu.len() => {
                    let worst = gpu
                        .iter()
                        .zip(&cpu)
                        .map(|(g, c)| (g - c).abs() / c.abs())
                        .fold(0.0, f64::max);
                    let detail = format!(
                        "{} iterations, largest relative difference {worst:.2e} (limit 1e-3)",
                        gpu.len()
                    );
                    report.check(&name, worst <= 1e-3, detail);
                }
                Ok(gpu) => report.fail(&name, format!("{} iterations, not {iters}", gpu.len())),
                Err(e) => report.fail(&name, e),
            }
        }
    }
}

/// Forward + backward FLOPs of one step: 6 per weight of the matmuls per token (`per_layer`
/// weights in each layer, and the `h·V` output layer), and the attention's two matmuls over
/// all `s²` pairs (12·b·s²·h per layer over forward and backward).
fn step_flops(layers: f64, per_layer: f64, hidden: f64, seq: f64, batch: f64, vocab: f64) -> f64 {
    let tokens = batch * seq;
    6.0 * tokens * (layers * per_layer + hidden * vocab)
        + 12.0 * layers * batch * seq * seq * hidden
}

/// A bf16 step's model: its name, the example that trains it (`gpt` or `bert`), (layers,
/// hidden, heads, seq, micro-batch), extra flags, the matmul weights per layer, the
/// vocabulary, and the synthetic documents that give it samples enough.
struct Bf16Model {
    name: &'static str,
    family: &'static str,
    shape: [usize; 5],
    flags: Vec<String>,
    per_layer: f64,
    vocab: usize,
    documents: usize,
}

/// The bf16 models by name: `bert` (BERT-large-sized), `gpt` (a Llama-style 12 × 2048) and
/// `llama1b` (issue 43's 1B-class target: TinyLlama-1.1B's shape, 22 × 2048, 32 heads in 4
/// query groups, SwiGLU 5632, vocab 32000, seq 2048, micro-batch 8); small stand-ins on the
/// CPU, so that the paths run there.
fn bf16_models(cuda: bool) -> Vec<Bf16Model> {
    let bert_vocab = burn_megatron::tensor_parallel::padded_vocab_size(
        burn_megatron::data::synthetic_vocabulary().len(),
        128,
        1,
    );
    let (bert, gpt, ffn, big, big_ffn, big_vocab) = if cuda {
        (
            [24, 1024, 16, 512, 8],
            [12, 2048, 16, 512, 16],
            5632,
            [22, 2048, 32, 2048, 8],
            5632,
            32000,
        )
    } else {
        let small = [2, 64, 4, 64, 4];
        (small, small, 176, [2, 64, 4, 256, 2], 176, 1024)
    };
    let per_layer = |[_, hidden, heads, _, _]: [usize; 5], groups: usize, ffn: usize| {
        let h = hidden as f64;
        2.0 * h * h + 2.0 * h * (h / heads as f64) * groups as f64 + 3.0 * h * ffn as f64
    };
    let llama_flags = |groups: usize, ffn: usize| {
        let mut flags = llama(groups);
        flags.extend(["--ffn-hidden-size".into(), ffn.to_string()]);
        flags
    };
    let mut big_flags = llama_flags(4, big_ffn);
    // The corpus's tokens, in an output layer padded to the vocabulary's size.
    big_flags.extend([
        "--make-vocab-size-divisible-by".into(),
        big_vocab.to_string(),
    ]);
    vec![
        Bf16Model {
            name: "bert",
            family: "bert",
            shape: bert,
            flags: vec![],
            per_layer: 12.0 * (bert[1] as f64).powi(2),
            vocab: bert_vocab,
            documents: 600,
        },
        Bf16Model {
            name: "gpt",
            family: "gpt",
            shape: gpt,
            flags: llama_flags(4, ffn),
            per_layer: per_layer(gpt, 4, ffn),
            // The corpus's 400-token vocabulary, padded to 128.
            vocab: 512,
            documents: 600,
        },
        Bf16Model {
            name: "llama1b",
            family: "gpt",
            shape: big,
            flags: big_flags,
            per_layer: per_layer(big, 4, big_ffn),
            vocab: big_vocab,
            // 600 make no sample of 2049 tokens; 4000 make 159.
            documents: 4000,
        },
    ]
}

/// One bf16 training step of each [`bf16_models`] on CUDA (on the CPU when there is none),
/// timed after two warm-up steps (which compile the kernels): TFLOP/s and the fraction of
/// the H200's dense bf16 peak.
pub fn bf16_step(report: &mut Report, out: &Path, families: &[String], variants: &[String]) {
    let known = [
        "default",
        "cublaslt",
        "chunked",
        "flash",
        "host-order",
        "cubecl",
    ];
    if let Some(bad) = variants.iter().find(|v| !known.contains(&v.as_str())) {
        report.fail(
            "bf16 variants",
            format!("{bad}: the variants are {known:?}"),
        );
        return;
    }
    for variant in variants {
        if !set_variant(variant) {
            report.skip(
                &format!("bf16 variant {variant}"),
                "built without the `cuda` feature",
            );
            continue;
        }
        bf16_variant(report, out, families, variant);
    }
    set_variant("default");
}

/// Sets the GEMM engine and stream order of `variant`; false without CUDA (only `default`
/// runs there).
fn set_variant(variant: &str) -> bool {
    #[cfg(feature = "cuda")]
    {
        use burn_megatron::cuda::order::{StreamOrder, set_stream_order};
        use burn_megatron::cuda::set_cublaslt;
        let (gemm, order) = match variant {
            "cublaslt" | "chunked" | "flash" => (Some(true), Some(StreamOrder::Device)),
            "host-order" => (Some(true), Some(StreamOrder::Host)),
            "cubecl" => (Some(false), None),
            _ => (None, None),
        };
        set_cublaslt(gemm);
        set_stream_order(order);
        true
    }
    #[cfg(not(feature = "cuda"))]
    {
        variant == "default"
    }
}

/// What the GEMMs and the stream ordering did since `before`, per step, and the engine.
#[cfg(feature = "cuda")]
fn per_step(
    before: &(
        burn_megatron::cuda::GemmStats,
        burn_megatron::cuda::order::OrderStats,
    ),
) -> String {
    use burn_megatron::cuda::{gemm_engine, gemm_stats, order::order_stats};
    let (g, o) = (gemm_stats(), order_stats());
    let n = BF16_STEPS as f64;
    let per = |a: u64, b: u64| (a - b) as f64 / n;
    format!(
        "GEMMs {:?}; per step: {:.0} by cuBLASLt, {:.0} failed over to cubek, {:.0} host syncs, \
         {:.0} device orderings{}",
        gemm_engine(),
        per(g.cublaslt, before.0.cublaslt),
        per(g.fallbacks, before.0.fallbacks),
        per(o.host_syncs, before.1.host_syncs),
        per(o.device_orders, before.1.device_orders),
        g.first_failure
            .map(|f| format!(" (first failure: {f})"))
            .unwrap_or_default()
    )
}

fn bf16_variant(report: &mut Report, out: &Path, families: &[String], variant: &str) {
    let cuda = gpu_devices().into_iter().find(|d| d.0 == "cuda");
    let device = match cuda {
        Some((_, Ok(()))) => "cuda",
        Some((_, Err(why))) => {
            report.skip("bf16 steps on cuda", why);
            "cpu"
        }
        None => unreachable!("gpu_devices lists cuda"),
    };
    let unknown: Vec<&String> = families
        .iter()
        .filter(|f| !["gpt", "bert", "llama1b"].contains(&f.as_str()))
        .collect();
    if !unknown.is_empty() {
        report.fail(
            "bf16 models",
            format!("{unknown:?}: the models are gpt, bert and llama1b"),
        );
        return;
    }
    let chosen = bf16_models(device == "cuda")
        .into_iter()
        .filter(|m| families.iter().any(|f| f == m.name));
    for m in chosen {
        let [layers, hidden, heads, seq, micro] = m.shape;
        let name = format!(
            "bf16 {} {layers}×{hidden} seq {seq} step on {device} ({variant})",
            m.name.to_uppercase()
        );
        #[cfg(feature = "cuda")]
        let before = (
            burn_megatron::cuda::gemm_stats(),
            burn_megatron::cuda::order::order_stats(),
        );
        let plot = out.join(format!("bf16-{}-{device}.png", m.name));
        let mut argv = vec![format!("{}_pretrain", m.family)];
        argv.extend(common(device, BF16_STEPS, m.documents, &plot));
        argv.extend(shape(layers, hidden, heads, seq, micro));
        argv.extend(m.flags.iter().cloned());
        if variant == "chunked" {
            // Blocks of 128 query rows: at seq 512 the causal GPT multiplies 5/8 of the
            // scores' keys, BERT all of them, and neither keeps its probabilities.
            argv.extend(["--attention-backend", "chunked"].map(String::from));
        }
        if variant == "flash" {
            argv.extend(["--attention-backend", "flash"].map(String::from));
        }
        argv.extend(
            [
                "--bf16",
                "--use-fused-adam",
                "--global-batch-size",
                &micro.to_string(),
            ]
            .map(String::from),
        );
        let log = if m.family == "gpt" {
            GptArgs::try_parse_from(argv)
                .map_err(|e| e.to_string())
                .and_then(|a| run_gpt(&a).map(|s| s.log))
        } else {
            Args::try_parse_from(argv)
                .map_err(|e| e.to_string())
                .and_then(|a| run(&a).map(|s| s.log))
        };
        match log {
            Ok(log) if log.len() == BF16_STEPS => {
                // The median of the steps after the warm-up (kernels compile, and autotune
                // times its candidates, in the first).
                let mut timed: Vec<f64> =
                    log[BF16_WARMUP..].iter().map(|e| e.ms_per_iter).collect();
                timed.sort_by(f64::total_cmp);
                let ms = timed[timed.len() / 2];
                let flops = step_flops(
                    layers as f64,
                    m.per_layer,
                    hidden as f64,
                    seq as f64,
                    micro as f64,
                    m.vocab as f64,
                );
                let tflops = flops / (ms / 1e3) / 1e12;
                let last = log[BF16_STEPS - 1].lm_loss;
                #[allow(unused_mut)]
                let mut detail = format!(
                    "{ms:.1} ms (median of {}), {tflops:.2} TFLOP/s = {:.2}% of the H200's \
                     dense bf16 peak ({H200_BF16_PEAK} TFLOP/s); lm loss {last:.4}; {}",
                    timed.len(),
                    100.0 * tflops / H200_BF16_PEAK,
                    device_memory(device)
                );
                #[cfg(feature = "cuda")]
                if device == "cuda" {
                    detail = format!("{detail}; {}", per_step(&before));
                }
                report.check(&name, last.is_finite(), detail);
            }
            Ok(log) => report.fail(&name, format!("{} iterations, not {BF16_STEPS}", log.len())),
            Err(e) => report.fail(&name, e),
        }
    }
}
