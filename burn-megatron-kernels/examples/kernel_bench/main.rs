//! Each fused kernel against the composition of Burn ops it replaces, on the same wgpu
//! device (lavapipe on a CPU machine; LayerNorm on Flex too): median time of each and their ratio, forward and
//! forward + backward. Ratios below 1 mean the fused kernel is faster.
//!
//! ```text
//! cargo run -p burn-megatron-kernels --features wgpu --example kernel_bench [OP...]
//! ```
//!
//! With arguments, only the benchmark modules whose names contain one of them run (e.g.
//! `dropout`, `optim`).

mod bias_dropout_add;
mod bias_gelu;
mod cross_entropy;
mod grad_accum;
mod layer_norm;
mod optim;
mod softmax;

use burn::tensor::{Device, Tensor, TensorData};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of `f` over 15 runs after 3 warm-ups (which also compile the kernels); each run
/// waits for the device to finish everything `f` queued.
fn time(device: &Device, mut f: impl FnMut()) -> f64 {
    let mut run = || {
        let t = Instant::now();
        f();
        device.sync().expect("device sync");
        t.elapsed().as_secs_f64() * 1e3
    };
    for _ in 0..3 {
        run();
    }
    median((0..15).map(|_| run()).collect())
}

/// Times `fused` and `reference` on `device` and prints one report line.
pub fn compare(
    device: &Device,
    op: &str,
    case: &str,
    fused: impl FnMut(),
    reference: impl FnMut(),
) {
    let (f, r) = (time(device, fused), time(device, reference));
    println!(
        "{op:<22} {case:<28} fused {f:>9.3} ms   reference {r:>9.3} ms   ratio {:.3}",
        f / r
    );
}

/// A `[rows, cols]` tensor of deterministic values in about [-2.4, 2.4].
pub fn matrix(device: &Device, rows: usize, cols: usize) -> Tensor<2> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| (i % 97) as f32 / 20.0 - 2.4)
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, cols]), device)
}

/// One op's benchmark cases.
type Bench = fn(&Device);

fn main() {
    let device = match burn_megatron_kernels::device::wgpu_cpu_device() {
        Ok(d) => d.autodiff(),
        Err(e) => {
            eprintln!("no wgpu adapter ({e}): install mesa-vulkan-drivers");
            std::process::exit(1);
        }
    };
    println!("fused kernel vs Burn composition on {device:?}");
    let filters: Vec<String> = std::env::args().skip(1).collect();
    let benches: [(&str, Bench); 7] = [
        ("bias_gelu", bias_gelu::bench),
        ("cross_entropy", cross_entropy::bench),
        ("grad_accum", grad_accum::bench),
        ("bias_dropout_add", bias_dropout_add::bench),
        ("softmax", softmax::bench),
        ("layer_norm", layer_norm::bench),
        ("optim", optim::bench),
    ];
    for (name, bench) in benches {
        if filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())) {
            bench(&device);
        }
    }
}
