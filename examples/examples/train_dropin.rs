//! Your own Burn model, trained tensor-parallel × data-parallel: a small language model
//! written with Burn's layers, split by a `TpPlan`, trained through `ParallelTraining` at
//! TP 2 × DP 2 (four ranks as threads of this process) with the distributed optimizer and
//! gradient clipping, then saved as a checkpoint. No flags.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example train_dropin [-- CHECKPOINT_DIR]
//! ```
//!
//! The model imports `dropin::nn`, which is all of `burn::nn` (a model written against
//! `burn::nn` swaps that one import). `train_minimal` is the same loop for a model in pipeline
//! stages; `tp_llama_dropin` trains a drop-in model with Burn's own optimizer, which is enough
//! without data parallelism, clipping or mixed precision.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor};
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::data::{BatchLayout, GptBatch, GptCorpusDataset, GptCorpusDatasetConfig};
use burn_megatron::dropin::TpPlan;
use burn_megatron::dropin::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn_megatron::dropin::nn::{self, Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn_megatron::launch::{self, LaunchOptions, RankContext};
use burn_megatron::optimizer::NormType;
use burn_megatron::tensor_parallel::vocab_parallel_cross_entropy;
use burn_megatron::topology::ParallelConfig;
use burn_megatron::training::ParallelTrainingConfig;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

const TP: usize = 2;
const DP: usize = 2;
const VOCAB: usize = 256; // bytes
const D_MODEL: usize = 64;
const SEQ_LENGTH: usize = 32;
const GLOBAL_BATCH: usize = 16; // 8 samples per data-parallel rank and step
const TRAIN_ITERS: usize = 30;
const LR: f64 = 3e-3;

/// A Burn user's model: an embedding, Burn's `TransformerEncoder` under a causal mask, an
/// output layer. Nothing in it knows about parallelism but its loss (below).
#[derive(Module, Debug)]
struct TinyLm {
    embedding: Embedding,
    encoder: TransformerEncoder,
    output: Linear,
}

impl TinyLm {
    fn new(device: &Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 4 * D_MODEL, 4, 2)
                .with_norm_first(true)
                .init(device),
            output: LinearConfig::new(D_MODEL, VOCAB).init(device),
        }
    }

    /// The mean next-token cross-entropy. Split by the plan, `output` gives this rank's
    /// slice of the vocabulary's logits, so the loss is the vocabulary-parallel one over its
    /// group (at TP 1 it is Burn's cross-entropy).
    fn loss(&self, ids: Tensor<2, Int>, labels: Tensor<2, Int>) -> Result<Tensor<1>> {
        let [b, s] = ids.dims();
        let mask = nn::attention::generate_autoregressive_mask(b, s, &ids.device());
        let x = self.embedding.forward(ids);
        let x = self
            .encoder
            .forward(TransformerEncoderInput::new(x).mask_attn(mask));
        let logits = self.output.forward(x);
        let v = logits.dims()[2];
        let (logits, labels) = (logits.reshape([b * s, v]), labels.reshape([b * s]));
        let group = self.output.group();
        Ok(vocab_parallel_cross_entropy(logits, labels, 0.0, &group)?.mean())
    }
}

/// One rank's training: returns the losses, averaged over the data-parallel ranks.
fn train(ctx: RankContext, data: &GptCorpusDataset, root: &Path) -> Result<Vec<f32>> {
    let (tp, device) = (&ctx.groups.tp, &ctx.device);
    // ANCHOR: setup
    // The layout, named once: each encoder layer split as Megatron splits a transformer
    // layer, the vocabulary split over the embedding and the output layer.
    let plan = TpPlan::new().encoder(&["encoder"])?;
    let plan = plan.vocab(&["embedding", "output"])?;
    let mut chunks = vec![plan.apply(TinyLm::new(device), tp)?];
    // How checkpoints name each parameter: a model in one stage, by its own module path.
    let names = Arc::new(|path: &str| path.to_string());
    let training = ParallelTrainingConfig::new()
        .with_use_distributed_optimizer(true) // ZeRO-1: AdamW's state sharded over DP
        .init(&ctx, &chunks, names)?;
    // Every replica from the first one's weights: a layer no plan splits is Burn's draw,
    // which differs by rank (here every layer is split, and it costs one broadcast).
    chunks = training.broadcast_params(chunks)?;
    let mut optimizer = training
        .optimizer(AdamWConfig::new().init(), &chunks)?
        .with_clip_grad(1.0, NormType::L2);
    // ANCHOR_END: setup
    let batches = BatchLayout::new(GLOBAL_BATCH, GLOBAL_BATCH / DP, DP)?;
    let dp_rank = ctx.state.data_parallel_rank();
    let logs = ctx.state.global_rank() == 0;
    let mut losses = Vec::new();
    // ANCHOR: loop
    for iteration in 0..TRAIN_ITERS {
        // This data-parallel rank's share of the global batch.
        let samples = batches.micro_batch(iteration, dp_rank, 0);
        let samples: Vec<_> = samples.map(|i| data.sample(i % data.len())).collect();
        let batch = GptBatch::new(&samples, device);
        let loss = chunks[0].loss(batch.ids, batch.labels)?;
        let mut value = vec![loss.clone().into_scalar::<f32>()];
        let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
        // Megatron's finalize_model_grads: here the data-parallel reduction (a
        // reduce-scatter, for the distributed optimizer).
        training.finalize(&chunks, &mut grads)?;
        let report;
        (chunks, report) = optimizer.step(LR, chunks, grads)?;
        ctx.groups.dp.all_reduce_vec(&mut value, ReduceOp::Avg)?;
        losses.push(value[0]);
        if logs {
            let norm = report.grad_norm.unwrap_or(f64::NAN);
            let it = iteration + 1;
            println!(
                "iteration {it:>3} | lm loss {:.4} | grad norm {norm:.3}",
                value[0]
            );
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
    // ANCHOR_END: loop
    if logs {
        println!("saved iteration {TRAIN_ITERS} under {}", root.display());
    }
    Ok(losses)
}

fn main() -> Result<()> {
    // The corpus as bytes (a newline ends each document), cut into samples of SEQ_LENGTH + 1
    // tokens; shared read-only by the rank threads.
    let tokens: Vec<u32> = burn_megatron::data::synthetic_corpus(800, 7)
        .iter()
        .flat_map(|doc| doc.join(" ").into_bytes().into_iter().chain([b'\n']))
        .map(u32::from)
        .collect();
    let data = GptCorpusDataset::from_tokens(tokens, GptCorpusDatasetConfig::new(SEQ_LENGTH))?;
    let root = match std::env::args_os().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir().join("burn_megatron_train_dropin"),
    };
    println!(
        "TinyLm 2 × {D_MODEL} | TP {TP} × DP {DP} on threads | {} samples",
        data.len()
    );
    let layout = ParallelConfig::new(TP * DP, TP, 1);
    let losses = launch::threads(&layout, LaunchOptions::default(), |ctx| {
        train(ctx, &data, &root)
    })
    .map_err(|e| e.to_string())?;
    match (losses[0].first(), losses[0].last()) {
        (Some(first), Some(last)) => println!("lm loss {first:.4} → {last:.4}"),
        _ => return Err("no loss".into()),
    }
    Ok(())
}
