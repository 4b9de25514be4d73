//! Cost of `MegatronOptimizer::step` against burn-optim AdamW steps on the same model and
//! gradients, measured in the same run (fp32, TP = 1):
//!
//! - **wrapped**: `MegatronOptimizer` around AdamW with a clipping threshold above the
//!   gradient norm, so its extra work is the overflow check and the global norm (one
//!   sum-of-squares pass and one read-back), against a plain AdamW step;
//! - **wrapped, clipping**: threshold 1, below the norm, so every gradient is also scaled,
//!   against AdamW clipping each gradient by its own norm (burn-optim's
//!   `GradientClippingConfig::Norm(1.0)`, the nearest it has to the same work);
//! - **fused**: the flat-buffer Adam (`MegatronOptimizer::new` with a `FusedAdam`, clipping at 1), whose
//!   one pass per parameter unscales, clips, checks and updates, against plain AdamW.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example optimizer_bench
//! cargo run --release -p burn-megatron-examples --features burn-megatron/wgpu \
//!     --example optimizer_bench -- --wgpu    # the same on wgpu (lavapipe on a CPU machine)
//! ```

use burn::module::Module;
use burn::optim::grad_clipping::GradientClippingConfig;
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
        "{:>6} {:>6} {:>9} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "d",
        "ffn",
        "params",
        "AdamW",
        "wrapped",
        "ratio",
        "+clip",
        "wrapped",
        "ratio",
        "fused",
        "ratio"
    );
    println!(
        "{:>6} {:>6} {:>9} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6} | {:>8} {:>6}",
        "", "", "", "(ms)", "(ms)", "", "(ms)", "+clip", "", "(ms)", ""
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
        let models: [Mlp; 5] = std::array::from_fn(|_| build());
        let mut plain = AdamWConfig::new().init();
        let mut plain_clip = AdamWConfig::new()
            .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
            .init();
        // Far above these gradients' norm (~10³): the coefficient is 1, nothing is scaled.
        let mut mega = MegatronOptimizer::new(AdamWConfig::new().init(), &models[1], tp.clone(), 0)
            .with_clip_grad(1e30, NormType::L2);
        let mut mega_clip =
            MegatronOptimizer::new(AdamWConfig::new().init(), &models[3], tp.clone(), 0)
                .with_clip_grad(1.0, NormType::L2);
        let adam = FusedAdamConfig::new().with_no_weight_decay_on_1d(false);
        let mut fused =
            MegatronOptimizer::new(adam.init().expect("valid"), &models[4], tp.clone(), 0)
                .with_clip_grad(1.0, NormType::L2);
        let mut models = models.map(Some);
        let mut times: [Vec<f64>; 5] = Default::default();
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
        let mut steppers: [&mut dyn FnMut(Mlp, GradientsParams) -> Mlp; 5] = [
            &mut |m, g| plain.step(1e-3, m, g),
            &mut |m, g| mega.step(1e-3, m, g).expect("step").0,
            &mut |m, g| plain_clip.step(1e-3, m, g),
            &mut |m, g| mega_clip.step(1e-3, m, g).expect("step").0,
            &mut |m, g| fused.step(1e-3, m, g).expect("step").0,
        ];
        for _ in 0..41 {
            for (i, step) in steppers.iter_mut().enumerate() {
                let model = models[i].take().expect("put back after each step");
                models[i] = Some(timed(model, &mut times[i], *step));
            }
        }
        // The first step of each allocates its state (and compiles kernels): not timed.
        let [a, b, c, e, f] = times.map(|mut t| {
            t.remove(0);
            median(t) * 1e3
        });
        let params = d * ffn * 2 + ffn + d;
        println!(
            "{d:>6} {ffn:>6} {params:>9} | {a:>8.3} {b:>8.3} {:>6.3} | {c:>8.3} {e:>8.3} {:>6.3} | {f:>8.3} {:>6.3}",
            b / a,
            e / c,
            f / a
        );
    }
}
