//! Cost of `MegatronOptimizer::step` against a plain burn-optim AdamW step on the same model
//! and gradients, measured in the same run (fp32, TP = 1): wrapping AdamW (the inf check and
//! the global grad norm are the extra work), and the fused flat-buffer Adam
//! (`MegatronOptimizer::fused_adam`), which does the same work in a few launches.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example optimizer_bench
//! cargo run --release -p burn-megatron-examples --features burn-megatron/wgpu \
//!     --example optimizer_bench -- --wgpu    # the same on wgpu (lavapipe on a CPU machine)
//! ```
//!
//! On Flex the fused step runs the reference composition of Burn ops (the kernel is for
//! Cube backends), so there it is the slower choice.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::optimizer::{FusedAdamConfig, MegatronOptimizer, NormType};
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
    let device = if std::env::args().any(|a| a == "--wgpu") {
        match burn_megatron_kernels::device::wgpu_cpu_device() {
            Ok(device) => device.autodiff(),
            Err(e) => {
                eprintln!("--wgpu: no wgpu device: {e}");
                std::process::exit(2);
            }
        }
    } else {
        Device::flex().autodiff()
    };
    println!("device: {device:?}");
    let tp: Comm = Arc::new(
        LocalWorld::new(1)
            .communicator("tp", vec![0], 0)
            .expect("group of one"),
    );
    println!(
        "{:>6} {:>6} {:>10} {:>11} {:>15} {:>8} {:>12} {:>8}",
        "d", "ffn", "params", "AdamW (ms)", "wrapped (ms)", "ratio", "fused (ms)", "ratio"
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
        let (mut plain_model, mut mega_model, mut fused_model) = (build(), build(), build());
        let mut plain = AdamWConfig::new().init();
        let mut mega =
            MegatronOptimizer::new(AdamWConfig::new().init(), &mega_model, tp.clone(), 0)
                .with_clip_grad(1.0, NormType::L2);
        let adam = FusedAdamConfig::new().with_no_weight_decay_on_1d(false);
        let mut fused =
            MegatronOptimizer::fused_adam(adam.init().expect("valid"), &fused_model, tp.clone(), 0)
                .with_clip_grad(1.0, NormType::L2);
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        // One step of `step` on fresh gradients of `model`, timed until its work is done.
        let timed = |model: Mlp, times: &mut Vec<f64>, step: &mut dyn FnMut(Mlp, _) -> Mlp| {
            let g = grads_of(&model);
            let t = Instant::now();
            let model = step(model, g);
            drop(model.fc2.weight.val().into_data());
            device.sync().expect("device sync");
            times.push(t.elapsed().as_secs_f64());
            model
        };
        for _ in 0..21 {
            plain_model = timed(plain_model, &mut a, &mut |m, g| plain.step(1e-3, m, g));
            mega_model = timed(mega_model, &mut b, &mut |m, g| {
                mega.step(1e-3, m, g).expect("step").0
            });
            fused_model = timed(fused_model, &mut c, &mut |m, g| {
                fused.step(1e-3, m, g).expect("step").0
            });
        }
        // The first step of each allocates its state (and compiles kernels): not timed.
        for times in [&mut a, &mut b, &mut c] {
            times.remove(0);
        }
        let params = d * ffn * 2 + ffn + d;
        let (a, b, c) = (median(a), median(b), median(c));
        println!(
            "{d:>6} {ffn:>6} {params:>10} {:>11.3} {:>15.3} {:>8.3} {:>12.3} {:>8.3}",
            a * 1e3,
            b * 1e3,
            b / a,
            c * 1e3,
            c / a
        );
    }
}
