//! A plain Burn MLP made tensor-parallel by swapping its layers.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example tp_mlp [-- --tp 2 --steps 10]
//! ```
//!
//! The model is built once as ordinary `burn::nn::Linear` layers. Each rank (a thread)
//! rebuilds it from the plain weight data — ranks must never share autodiff-tracked tensors —
//! and swaps `Linear` for `ColumnParallelLinear` / `RowParallelLinear`, which keep the rank's
//! shard. Trained at TP = 1 and at the requested TP, the losses are the same.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpError,
};
use burn_megatron::topology::ParallelConfig;
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Tensor-parallel size to compare with TP = 1.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Training steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
}

const D: usize = 32;
const FFN: usize = 128;
const TOKENS: usize = 64;

// ANCHOR: models
/// The user's model, in plain Burn.
#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

/// The same model, tensor-parallel: only the layer types changed.
#[derive(Module, Debug)]
struct ParallelMlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}
// ANCHOR_END: models

/// Plain weight data of a `Linear`: safe to share between rank threads.
type LinearData = (TensorData, TensorData);

fn linear_from(data: &LinearData, device: &Device) -> Linear {
    Linear {
        weight: Param::from_tensor(Tensor::from_data(data.0.clone(), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            data.1.clone(),
            device,
        ))),
    }
}

/// A fixed regression task: y = sin(x · A) for a fixed A.
fn batch(step: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (0..TOKENS * D)
        .map(|i| (((i * 31 + step * 7) % 97) as f32 / 48.5) - 1.0)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [TOKENS, D]), device);
    let a: Vec<f32> = (0..D * D)
        .map(|i| (((i * 13) % 17) as f32 - 8.0) / 8.0)
        .collect();
    let y = x
        .clone()
        .matmul(Tensor::from_data(TensorData::new(a, [D, D]), device))
        .sin();
    (x, y)
}

fn train(
    tp: usize,
    steps: usize,
    weights: &(LinearData, LinearData),
) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    let losses = launch::threads(
        &ParallelConfig::new(tp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let plain = Mlp {
                fc1: linear_from(&weights.0, &ctx.device),
                fc2: linear_from(&weights.1, &ctx.device),
            };
            // ANCHOR: swap
            // The swap: each parallel layer takes this rank's shard of the plain one.
            let mut model = ParallelMlp {
                fc1: ColumnParallelLinear::from_linear(
                    &plain.fc1,
                    &ColumnParallelLinearConfig::new(D, FFN),
                    &ctx.groups.tp,
                )?,
                fc2: RowParallelLinear::from_linear(
                    &plain.fc2,
                    &RowParallelLinearConfig::new(FFN, D),
                    &ctx.groups.tp,
                )?,
            };
            let mut optim = AdamConfig::new().init();
            let mut losses = Vec::new();
            for step in 0..steps {
                let (x, y) = batch(step, &ctx.device);
                let out = model.fc2.forward(gelu(model.fc1.forward(x)));
                let loss = (out - y).powi_scalar(2).mean();
                losses.push(loss.clone().into_scalar::<f32>());
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-2, model, grads);
            }
            // ANCHOR_END: swap
            Ok::<_, TpError>(losses)
        },
    )?;
    Ok(losses.into_iter().next().expect("at least one rank"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // Build the plain model once, off the autodiff device, and keep only its data.
    let device = Device::flex();
    device.seed(42);
    let fc1 = LinearConfig::new(D, FFN).init(&device);
    let fc2 = LinearConfig::new(FFN, D).init(&device);
    let data = |l: Linear| {
        (
            l.weight.val().into_data(),
            l.bias.expect("bias").val().into_data(),
        )
    };
    let weights = (data(fc1), data(fc2));

    let single = train(1, args.steps, &weights)?;
    let parallel = train(args.tp, args.steps, &weights)?;
    println!(
        "{:>5} {:>12} {:>12} {:>10}",
        "step",
        "TP=1 loss",
        format!("TP={} loss", args.tp),
        "|diff|"
    );
    let mut worst = 0.0f32;
    for (step, (a, b)) in single.iter().zip(&parallel).enumerate() {
        worst = worst.max((a - b).abs());
        println!("{step:>5} {a:>12.6} {b:>12.6} {:>10.2e}", (a - b).abs());
    }
    println!("largest difference: {worst:.2e}");
    Ok(())
}
