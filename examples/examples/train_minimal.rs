//! The smallest complete parallel training loop: a small Llama-style GPT at tensor-parallel 2 ×
//! pipeline-parallel 2 × data-parallel 2, eight ranks as threads of this process, no flags.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example train_minimal [-- CHECKPOINT_DIR]
//! ```
//!
//! Every rank runs the same function: build its pipeline stage of the model (its shard of
//! every layer), wrap the optimizer, then loop Megatron's `train_step`: the microbatches of
//! one global batch go through `forward_backward_func` (the 1F1B schedule, activations sent
//! between stages), `finalize` reduces the gradients over data-parallel ranks (and the other
//! reductions the layout needs), the optimizer steps, and at the end every rank saves its
//! shards of one checkpoint. `gpt_pretrain` is this loop with every Megatron flag.

use burn::optim::AdamWConfig;
use burn_megatron::comm::{CommunicatorExt, ReduceOp};
use burn_megatron::data::{BatchLayout, GptBatch, GptCorpusDataset, GptCorpusDatasetConfig};
use burn_megatron::launch::{self, LaunchOptions, RankContext};
use burn_megatron::models::{
    ActivationFunc, AttnMaskType, Gpt, GptConfig, GptStageOutput, LayerNormPosition, NormKind,
    ParallelAttentionConfig, ParallelMlpConfig, PositionEmbeddingType, TransformerLayerConfig,
};
use burn_megatron::optimizer::NormType;
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule,
    forward_backward_func, read_losses,
};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron::training::ParallelTrainingConfig;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

const TP: usize = 2;
const PP: usize = 2;
const DP: usize = 2;
const SEQ_LENGTH: usize = 32;
const MICRO_BATCH: usize = 4;
const GLOBAL_BATCH: usize = 32; // 4 microbatches per data-parallel rank and step
const TRAIN_ITERS: usize = 30;
const LR: f64 = 3e-3;

/// The model: 4 layers of width 64, 4 heads sharing 2 key/value groups, rotary positions,
/// RMSNorm, SwiGLU, no biases, an untied output layer; its vocabulary is bytes.
fn model_config() -> GptConfig {
    let attention = ParallelAttentionConfig::new(4)
        .with_num_query_groups(Some(2))
        .with_attn_mask_type(AttnMaskType::Causal);
    let mlp = ParallelMlpConfig::new(176)
        .with_gated_linear_unit(true)
        .with_activation_func(ActivationFunc::Silu);
    let layer = TransformerLayerConfig::new(64, attention, mlp)
        .with_layernorm_position(LayerNormPosition::Pre)
        .with_normalization(NormKind::RmsNorm)
        .with_layernorm_epsilon(1e-5)
        .with_add_bias_linear(false)
        .with_seed(1234);
    GptConfig::new(4, SEQ_LENGTH, 256, layer)
        .with_position_embedding_type(PositionEmbeddingType::Rope)
        .with_untie_embeddings_and_output_weights(true)
}

/// One rank's training: returns its losses (the last pipeline stage's; empty elsewhere).
fn train(ctx: RankContext, data: &GptCorpusDataset, root: &Path) -> Result<Vec<f32>> {
    // ANCHOR: setup
    let stage = PipelinePosition::of(&ctx.state, 0);
    let mut chunks: Vec<Gpt> =
        vec![model_config().init_stage(&ctx.groups.tp, stage, &ctx.device)?];
    // Checkpoints name layers by their global index, so any layout can load them.
    let first_layers = vec![chunks[0].first_layer()];
    let names = Arc::new(move |path: &str| Gpt::global_param_name_at(&first_layers, path));
    let training = ParallelTrainingConfig::new()
        .with_use_distributed_optimizer(true) // ZeRO-1: Adam's state sharded over DP
        .init(&ctx, &chunks, names)?;
    let adamw = AdamWConfig::new().init();
    let mut optimizer = training
        .optimizer(adamw, &chunks)?
        .with_clip_grad(1.0, NormType::L2);

    let batches = BatchLayout::new(GLOBAL_BATCH, MICRO_BATCH, DP)?;
    let schedule = PipelineSchedule::new(PP, batches.num_micro_batches());
    let p2p = ctx.p2p(P2pShapes::Variable);
    // ANCHOR_END: setup
    let (dp_rank, last_stage) = (ctx.state.data_parallel_rank(), stage.is_last_stage());
    let logs = last_stage && dp_rank == 0 && ctx.state.tensor_model_parallel_rank() == 0;
    let mut losses = Vec::new();
    // ANCHOR: loop
    for iteration in 0..TRAIN_ITERS {
        // One microbatch through this rank's stage; the first stage embeds the tokens,
        // the last computes the loss, the others take and give hidden states (3: their
        // tensor rank, [s, b, h]).
        let step = |s: ForwardStep<'_, Gpt, 3>| {
            let samples = batches.micro_batch(iteration, dp_rank, s.microbatch);
            let samples: Vec<_> = samples.map(|i| data.sample(i % data.len())).collect();
            let batch = GptBatch::new(&samples, &ctx.device);
            let ids = s.input.is_none().then_some(batch.ids);
            Ok(match s.model.forward_stage(ids, s.input, None)? {
                GptStageOutput::Hidden(hidden) => ChunkOutput::Activation(hidden),
                GptStageOutput::Logits(logits) => {
                    let loss = s.model.loss(logits, batch.labels, batch.loss_mask)?;
                    ChunkOutput::Loss {
                        loss,
                        report: vec![],
                    }
                }
            })
        };
        let fb = ForwardBackwardConfig::new(schedule);
        let out = forward_backward_func(step, &chunks, &p2p, fb)?;
        let mut grads = out.grads;
        training.finalize(&chunks, &mut grads)?; // Megatron's finalize_model_grads
        let report;
        (chunks, report) = optimizer.step(LR, chunks, grads)?;
        if last_stage {
            // The losses stayed on the device; one host read for all micro-batches.
            let read = read_losses(&out.losses);
            let mean = read.iter().map(|l| l.loss).sum::<f64>() / read.len() as f64;
            let mut loss = vec![mean as f32];
            ctx.groups.dp.all_reduce_vec(&mut loss, ReduceOp::Avg)?;
            losses.push(loss[0]);
            if logs {
                let norm = report.grad_norm.unwrap_or(f64::NAN);
                println!(
                    "iteration {:>3} | lm loss {:.4} | grad norm {norm:.3}",
                    iteration + 1,
                    loss[0]
                );
            }
        }
    }
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
    // The corpus, tokenized as bytes (a newline ends each document), cut into samples of
    // SEQ_LENGTH + 1 tokens; shared read-only by the rank threads.
    let tokens: Vec<u32> = burn_megatron::data::synthetic_corpus(800, 7)
        .iter()
        .flat_map(|doc| doc.join(" ").into_bytes().into_iter().chain([b'\n']))
        .map(u32::from)
        .collect();
    let data = GptCorpusDataset::from_tokens(tokens, GptCorpusDatasetConfig::new(SEQ_LENGTH))?;
    // Where the checkpoint goes: the first argument, else a directory under the system's
    // temporary one.
    let root = match std::env::args_os().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir().join("burn_megatron_train_minimal"),
    };
    let layout = ParallelConfig::new(TP * PP * DP, TP, PP);
    println!(
        "GPT 4 × 64 | TP {TP} × PP {PP} × DP {DP} on threads | {} samples",
        data.len()
    );
    let losses = launch::threads(&layout, LaunchOptions::default(), |ctx| {
        train(ctx, &data, &root)
    })
    .map_err(|e| e.to_string())?;
    let losses = losses
        .into_iter()
        .find(|l| !l.is_empty())
        .unwrap_or_default();
    match (losses.first(), losses.last()) {
        (Some(first), Some(last)) => println!("lm loss {first:.4} → {last:.4}"),
        _ => return Err("no rank reported a loss".into()),
    }
    Ok(())
}
