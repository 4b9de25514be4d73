//! Overhead of the tensor-parallel layers at TP = 1: a Column → GeLU → Row MLP against the
//! same MLP from `burn::nn::Linear`, forward + backward, timed in the same run.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example tp_mlp_bench
//! ```
//!
//! At TP = 1 the mappings return their input untouched (no op recorded, no host copy), so the
//! ratio should be ~1.

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::tensor_parallel::{ColumnParallelLinearConfig, RowParallelLinearConfig};
use burn_megatron_examples::median;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let device = Device::flex().autodiff();
    let tp: Comm = Arc::new(
        LocalWorld::new(1)
            .communicator("tp", vec![0], 0)
            .expect("group of one"),
    );
    let iters = 30;
    println!(
        "{:>6} {:>6} {:>7} {:>12} {:>12} {:>8}",
        "d", "ffn", "tokens", "burn (ms)", "tp=1 (ms)", "ratio"
    );
    for (d, ffn, tokens) in [(256, 1024, 256), (512, 2048, 256), (1024, 4096, 128)] {
        let col = ColumnParallelLinearConfig::new(d, ffn)
            .with_seed(1)
            .init(&tp, &device)
            .expect("init");
        let row = RowParallelLinearConfig::new(ffn, d)
            .with_seed(2)
            .init(&tp, &device)
            .expect("init");
        let plain = |w: &Param<Tensor<2>>, b: &Option<Param<Tensor<1>>>| Linear {
            weight: Param::from_tensor(w.val().detach().require_grad()),
            bias: b
                .as_ref()
                .map(|b| Param::from_tensor(b.val().detach().require_grad())),
        };
        let (fc1, fc2) = (plain(&col.weight, &col.bias), plain(&row.weight, &row.bias));
        let x: Vec<f32> = (0..tokens * d)
            .map(|i| ((i % 101) as f32 / 50.0) - 1.0)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [tokens, d]), &device);

        let run_plain = |x: Tensor<2>| {
            let _ = fc2.forward(gelu(fc1.forward(x))).sum().backward();
        };
        let run_tp = |x: Tensor<2>| {
            let _ = row.forward(gelu(col.forward(x))).sum().backward();
        };
        // Warm up, then alternate so drift affects both alike.
        run_plain(x.clone());
        run_tp(x.clone());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            let t = Instant::now();
            run_plain(x.clone());
            a.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            run_tp(x.clone());
            b.push(t.elapsed().as_secs_f64());
        }
        let (a, b) = (median(a), median(b));
        println!(
            "{d:>6} {ffn:>6} {tokens:>7} {:>12.3} {:>12.3} {:>8.3}",
            a * 1e3,
            b * 1e3,
            b / a
        );
    }
}
