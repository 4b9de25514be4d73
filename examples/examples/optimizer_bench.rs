//! Overhead of `MegatronOptimizer::step` over a plain burn-optim AdamW step on the same
//! model and gradients, measured in the same run (fp32, TP = 1; the inf check and the global
//! grad norm are the extra work; with bf16 the master-weight copy too).
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example optimizer_bench
//! ```

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::optimizer::{MegatronOptimizer, NormType};
use burn_megatron::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
};
use burn_megatron_examples::median;
use std::sync::Arc;
use std::time::Instant;

#[derive(Module, Debug)]
struct Mlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}

fn main() {
    let device = Device::flex().autodiff();
    let tp: Comm = Arc::new(
        LocalWorld::new(1)
            .communicator("tp", vec![0], 0)
            .expect("group of one"),
    );
    println!(
        "{:>6} {:>6} {:>10} {:>14} {:>16} {:>8}",
        "d", "ffn", "params", "AdamW (ms)", "Megatron (ms)", "ratio"
    );
    for (d, ffn) in [(256, 1024), (512, 2048), (1024, 4096)] {
        let build = || Mlp {
            fc1: ColumnParallelLinearConfig::new(d, ffn)
                .with_seed(1)
                .init(&tp, &device)
                .expect("init"),
            fc2: RowParallelLinearConfig::new(ffn, d)
                .with_seed(2)
                .init(&tp, &device)
                .expect("init"),
        };
        let grads_of = |m: &Mlp| {
            let x: Vec<f32> = (0..32 * d)
                .map(|i| ((i % 101) as f32 / 50.0) - 1.0)
                .collect();
            let x = Tensor::<2>::from_data(TensorData::new(x, [32, d]), &device);
            GradientsParams::from_grads(m.fc2.forward(gelu(m.fc1.forward(x))).sum().backward(), m)
        };
        let (mut plain_model, mut mega_model) = (build(), build());
        let mut plain = AdamWConfig::new().init();
        let mut mega =
            MegatronOptimizer::new(AdamWConfig::new().init(), &mega_model, tp.clone(), 0)
                .with_clip_grad(1.0, NormType::L2);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for i in 0..21 {
            let g = grads_of(&plain_model);
            let t = Instant::now();
            plain_model = plain.step(1e-3, plain_model, g);
            let _ = plain_model.fc1.weight.val().into_data(); // wait for the work
            let ta = t.elapsed().as_secs_f64();
            let g = grads_of(&mega_model);
            let t = Instant::now();
            let (m, _) = mega.step(1e-3, mega_model, g).expect("step");
            mega_model = m;
            let _ = mega_model.fc1.weight.val().into_data();
            let tb = t.elapsed().as_secs_f64();
            if i > 0 {
                a.push(ta);
                b.push(tb);
            }
        }
        let params = d * ffn * 2 + ffn + d;
        let (a, b) = (median(a), median(b));
        println!(
            "{d:>6} {ffn:>6} {params:>10} {:>14.3} {:>16.3} {:>8.3}",
            a * 1e3,
            b * 1e3,
            b / a
        );
    }
}
