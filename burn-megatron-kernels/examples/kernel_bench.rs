//! Each fused kernel against the composition of Burn ops it replaces, on the same wgpu
//! device (lavapipe on a CPU machine): median time and ratio, forward and forward+backward.
//!
//! ```text
//! cargo run --release -p burn-megatron-kernels --features wgpu --example kernel_bench
//! ```

use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron_kernels::bias_gelu;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of `f` (which must wait for its result) over 15 runs after 3 warm-ups.
fn time(mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    median(
        (0..15)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn bench_bias_gelu(device: &Device, rows: usize, cols: usize) {
    let x = Tensor::<2>::from_data(
        TensorData::new(
            (0..rows * cols)
                .map(|i| (i % 97) as f32 / 20.0 - 2.4)
                .collect::<Vec<_>>(),
            [rows, cols],
        ),
        device,
    );
    let b = Tensor::<1>::from_data(
        TensorData::new(
            (0..cols)
                .map(|i| (i % 13) as f32 / 10.0 - 0.6)
                .collect::<Vec<_>>(),
            [cols],
        ),
        device,
    );
    let forward = |fused: bool| {
        let (x, b) = (x.clone(), b.clone());
        time(move || {
            let y = if fused {
                bias_gelu(x.clone(), b.clone())
            } else {
                gelu(x.clone() + b.clone().unsqueeze())
            };
            let _ = y.sum().into_data();
        })
    };
    let both = |fused: bool| {
        let (x, b) = (x.clone(), b.clone());
        time(move || {
            let (x, b) = (x.clone().require_grad(), b.clone().require_grad());
            let y = if fused {
                bias_gelu(x.clone(), b.clone())
            } else {
                gelu(x.clone() + b.clone().unsqueeze())
            };
            let grads = y.sum().backward();
            let _ = x.grad(&grads).map(|g| g.sum().into_data());
        })
    };
    let (f1, f0) = (forward(true), forward(false));
    let (b1, b0) = (both(true), both(false));
    println!(
        "bias_gelu [{rows}, {cols}]  fwd: fused {f1:.2} ms, composed {f0:.2} ms, ratio {:.3} | fwd+bwd: fused {b1:.2} ms, composed {b0:.2} ms, ratio {:.3}",
        f1 / f0,
        b1 / b0
    );
}

fn main() {
    let device = match burn_megatron_kernels::device::wgpu_cpu_device() {
        Ok(d) => d.autodiff(),
        Err(e) => {
            eprintln!("no wgpu adapter ({e}): install mesa-vulkan-drivers");
            std::process::exit(1);
        }
    };
    for (rows, cols) in [(512, 1024), (2048, 4096)] {
        bench_bias_gelu(&device, rows, cols);
    }
}
