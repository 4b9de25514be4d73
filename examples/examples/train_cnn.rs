//! Your own Burn CNN, trained data-parallel: a small ResNet (convolutions, `BatchNorm`, a
//! residual block, pooling) written with Burn's layers, at DP 2 (two ranks as threads of this
//! process) through `ParallelTraining`, with the distributed optimizer and synchronised
//! `BatchNorm`, then saved as a checkpoint and evaluated on held-out images. No flags.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example train_cnn [-- CHECKPOINT_DIR]
//! ```
//!
//! A model with nothing to split needs no plan: Burn's initializers draw apart on every rank,
//! so the replicas take the first rank's weights (`broadcast_params`), and each `BatchNorm`
//! normalises over both ranks' images together (`sync_batch_norm`, PyTorch's
//! `SyncBatchNorm`). The model imports `dropin::nn`, which is all of `burn::nn`.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::data::BatchLayout;
use burn_megatron::dropin::nn::PaddingConfig2d;
use burn_megatron::dropin::nn::conv::{Conv2d, Conv2dConfig};
use burn_megatron::dropin::nn::loss::CrossEntropyLossConfig;
use burn_megatron::dropin::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn_megatron::dropin::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn_megatron::launch::{self, LaunchOptions, RankContext};
use burn_megatron::topology::ParallelConfig;
use burn_megatron::training::ParallelTrainingConfig;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

const DP: usize = 2;
const CLASSES: usize = 4;
const SIDE: usize = 16; // 3 × 16 × 16 images
const WIDTH: usize = 16; // channels
const GLOBAL_BATCH: usize = 16; // 8 images per data-parallel rank and step
const TRAIN_ITERS: usize = 30;
const LR: f64 = 3e-3;

/// Convolution, `BatchNorm`, ReLU, twice, around a residual connection.
#[derive(Module, Debug)]
struct Block {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
}

/// A Burn user's CNN. Nothing in it knows about parallelism.
#[derive(Module, Debug)]
struct ResNet {
    stem: Conv2d,
    bn: BatchNorm,
    block: Block,
    pool: AdaptiveAvgPool2d,
    head: Linear,
}

fn conv(channels: [usize; 2], device: &Device) -> Conv2d {
    Conv2dConfig::new(channels, [3, 3])
        .with_padding(PaddingConfig2d::Same)
        .init(device)
}

impl ResNet {
    fn new(device: &Device) -> Self {
        let bn = || BatchNormConfig::new(WIDTH).init(device);
        Self {
            stem: conv([3, WIDTH], device),
            bn: bn(),
            block: Block {
                conv1: conv([WIDTH, WIDTH], device),
                bn1: bn(),
                conv2: conv([WIDTH, WIDTH], device),
                bn2: bn(),
            },
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            head: LinearConfig::new(WIDTH, CLASSES).init(device),
        }
    }

    /// Each image's class scores, `[n, CLASSES]`.
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let n = images.dims()[0];
        let x = relu(self.bn.forward(self.stem.forward(images)));
        let b = &self.block;
        let y = relu(b.bn1.forward(b.conv1.forward(x.clone())));
        let x = relu(x + b.bn2.forward(b.conv2.forward(y)));
        self.head.forward(self.pool.forward(x).reshape([n, WIDTH]))
    }
}

/// Images `samples` of a synthetic set: each class a stripe pattern (horizontal, vertical,
/// diagonal, checkered) under noise; sample `i` is of class `i mod 4`.
fn images(samples: impl Iterator<Item = usize>, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for i in samples {
        let class = i % CLASSES;
        for channel in 0..3 {
            for y in 0..SIDE {
                for x in 0..SIDE {
                    let stripe = match class {
                        0 => y / 2 % 2,
                        1 => x / 2 % 2,
                        2 => (x + y) / 2 % 2,
                        _ => (x / 4 + y / 4) % 2,
                    };
                    let hash = (i * 7919 + channel * 104_729 + y * 1031 + x * 613) % 9973;
                    let noise = hash as f32 / 9973.0 - 0.5;
                    pixels.push(stripe as f32 + noise);
                }
            }
        }
        labels.push(class as i64);
    }
    let n = labels.len();
    let images = TensorData::new(pixels, [n, 3, SIDE, SIDE]);
    (
        Tensor::from_data(images, device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

/// One rank's training: returns the losses, averaged over the data-parallel ranks.
fn train(ctx: RankContext, root: &Path) -> Result<Vec<f32>> {
    let device = &ctx.device;
    // ANCHOR: setup
    let chunks = vec![ResNet::new(device)];
    // How checkpoints name each parameter: a model in one stage, by its own module path.
    let names = Arc::new(|path: &str| path.to_string());
    let training = ParallelTrainingConfig::new()
        .with_use_distributed_optimizer(true) // ZeRO-1: AdamW's state sharded over DP
        .init(&ctx, &chunks, names)?;
    // Burn drew each rank's weights apart: every replica takes the first one's.
    let chunks = training.broadcast_params(chunks)?;
    // Each BatchNorm's statistics over both ranks' images, as one rank over the whole batch.
    let mut chunks = training.sync_batch_norm(chunks)?;
    let mut optimizer = training.optimizer(AdamWConfig::new().init(), &chunks)?;
    // ANCHOR_END: setup
    let batches = BatchLayout::new(GLOBAL_BATCH, GLOBAL_BATCH / DP, DP)?;
    let dp_rank = ctx.state.data_parallel_rank();
    let logs = ctx.state.global_rank() == 0;
    let cross_entropy = CrossEntropyLossConfig::new().init(device);
    let mut losses = Vec::new();
    for iteration in 0..TRAIN_ITERS {
        // This data-parallel rank's share of the global batch.
        let (x, labels) = images(batches.micro_batch(iteration, dp_rank, 0), device);
        let loss = cross_entropy.forward(chunks[0].forward(x), labels);
        let mut value = vec![loss.clone().into_scalar::<f32>()];
        let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
        training.finalize(&chunks, &mut grads)?;
        (chunks, _) = optimizer.step(LR, chunks, grads)?;
        ctx.groups.dp.all_reduce_vec(&mut value, ReduceOp::Avg)?;
        losses.push(value[0]);
        if logs {
            println!("iteration {:>3} | loss {:.4}", iteration + 1, value[0]);
        }
    }
    // Collective: every rank saves its shards of one checkpoint.
    training.save(
        root,
        TRAIN_ITERS,
        &chunks,
        &optimizer,
        serde_json::json!({}),
    )?;
    if logs {
        println!("saved iteration {TRAIN_ITERS} under {}", root.display());
        // Inference: `valid()` leaves autodiff, and each BatchNorm normalises with its
        // running statistics, the same on every rank.
        let model = chunks[0].valid();
        let first = TRAIN_ITERS * GLOBAL_BATCH;
        let (x, labels) = images(first..first + 64, &device.clone().without_autodiff());
        let predicted = model.forward(x).argmax(1).reshape([64]);
        let right = predicted.equal(labels).int().sum().into_scalar::<i64>();
        println!("held-out accuracy {right}/64");
    }
    Ok(losses)
}

fn main() -> Result<()> {
    let root = match std::env::args_os().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir().join("burn_megatron_train_cnn"),
    };
    println!("ResNet {WIDTH} channels | DP {DP} on threads | {CLASSES} classes of {SIDE}×{SIDE}");
    let layout = ParallelConfig::new(DP, 1, 1);
    let losses = launch::threads(&layout, LaunchOptions::default(), |ctx| train(ctx, &root))
        .map_err(|e| e.to_string())?;
    match (losses[0].first(), losses[0].last()) {
        (Some(first), Some(last)) => println!("loss {first:.4} → {last:.4}"),
        _ => return Err("no loss".into()),
    }
    Ok(())
}
