//! `bert_pretrain`: BERT's command line, data and microbatch step for the shared loop.

use super::args::TrainArgs;
use super::data::{DataSource, megatron_documents};
use super::{Family, Split, Summary, corpus, is_leader, layout_line, precision, train_family};
use burn::config::Config;
use burn::tensor::Device;
use burn_megatron::context_parallel::ContextParallel;
use burn_megatron::data::{
    BertBatch, BertDataset, BertDatasetConfig, BertSample, BertTokenizer, Document,
    synthetic_vocabulary,
};
use burn_megatron::launch::RankContext;
use burn_megatron::models::{
    Bert, BertConfig, BertStageOutput, LayerNormPosition, MaskedPositions, ParallelAttentionConfig,
    ParallelMlpConfig, TransformerLayerConfig,
};
use burn_megatron::pipeline::{ChunkOutput, ForwardStep, StageError};
use burn_megatron::tensor_parallel::{IdCheck, MasterInit, RngTracker, padded_vocab_size};
use burn_megatron::topology::PipelinePosition;
use clap::Parser;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// BERT pretraining with tensor, pipeline and data parallelism (ranks run as threads of
/// this process). Without `--data-path` it trains on a procedurally generated English-like
/// corpus with the generator's own vocabulary; with `--data-path` and without
/// `--vocab-file` it trains a WordPiece vocabulary on the data first.
#[derive(Debug, Clone, Parser)]
#[command(name = "bert_pretrain", version, args_override_self = true)]
pub struct Args {
    /// The flags every pretraining example has.
    #[command(flatten)]
    pub train: TrainArgs,
    /// Run the MLM head on every position, as Hugging Face's `BertForPreTraining` does,
    /// instead of the masked ones the loss counts (the original BERT's choice: the same loss
    /// and gradients with ~1/7 of the vocabulary-sized work).
    #[arg(long)]
    pub mlm_head_all_positions: bool,
}

impl Args {
    /// The model these flags describe, for a vocabulary of `vocab_size` real entries.
    pub fn model_config(&self, vocab_size: usize) -> BertConfig {
        let a = &self.train;
        let attention = ParallelAttentionConfig::new(a.num_attention_heads)
            .with_attention_dropout(a.attention_dropout)
            .with_attention_backend(a.attention_backend.into())
            .with_attention_query_chunk(a.attention_query_chunk);
        let mlp = ParallelMlpConfig::new(a.ffn_hidden_size.unwrap_or(4 * a.hidden_size));
        let transformer = TransformerLayerConfig::new(a.hidden_size, attention, mlp)
            .with_hidden_dropout(a.hidden_dropout)
            .with_sequence_parallel(a.sequence_parallel_on())
            .with_recompute(a.recompute())
            .with_gradient_accumulation_fusion(a.gradient_accumulation_fusion)
            .with_initializer(MasterInit::Normal {
                mean: 0.0,
                std: a.init_method_std,
            })
            .with_seed(a.seed);
        let tp = a.tensor_model_parallel_size;
        BertConfig::new(
            a.num_layers,
            a.max_position_embeddings.unwrap_or(a.seq_length),
            padded_vocab_size(vocab_size, a.make_vocab_size_divisible_by, tp),
            transformer,
        )
    }

    /// Every check that can fail before training starts, with a message naming the flags.
    pub fn validate(&self) -> Result<burn_megatron::data::BatchLayout, String> {
        let a = &self.train;
        let layout = a.validate()?;
        // bert_pretrain's encoder layers are post-norm (BertConfig's default).
        LayerNormPosition::Post
            .check_recompute(&a.recompute())
            .map_err(|e| e.to_string())?;
        let tp = a.tensor_model_parallel_size;
        if !a.num_attention_heads.is_multiple_of(tp) {
            return Err(format!(
                "--num-attention-heads ({}) must be divisible by --tensor-model-parallel-size ({tp})",
                a.num_attention_heads
            ));
        }
        if !a.hidden_size.is_multiple_of(a.num_attention_heads) {
            return Err(format!(
                "--hidden-size ({}) must be divisible by --num-attention-heads ({})",
                a.hidden_size, a.num_attention_heads
            ));
        }
        if a.max_position_embeddings.unwrap_or(a.seq_length) < a.seq_length {
            return Err("--max-position-embeddings must be at least --seq-length".into());
        }
        Ok(layout)
    }
}

/// The tokenizer: `--vocab-file`; else the one saved with the checkpoint being loaded;
/// else the built-in generator's fixed vocabulary; else one trained on the corpus (and
/// saved with the checkpoints, since training can differ between processes).
fn tokenizer(args: &TrainArgs, docs: &[Document], leader: bool) -> Result<BertTokenizer, String> {
    let saved = args
        .load
        .as_ref()
        .map(|d| d.join("tokenizer.json"))
        .filter(|p| p.is_file());
    let tokenizer = match (&args.vocab_file, &saved, args.data_path.is_empty()) {
        (Some(p), _, _) | (None, Some(p), _) => BertTokenizer::from_file(p.as_path()),
        (None, None, true) => BertTokenizer::from_vocab(synthetic_vocabulary()),
        (None, None, false) => BertTokenizer::train(docs, args.vocab_size),
    }
    .map_err(|e| e.to_string())?;
    let trained = args.vocab_file.is_none() && saved.is_none() && !args.data_path.is_empty();
    if trained && leader && tokenizer.vocab_size() > args.vocab_size {
        // WordPiece keeps every character of the corpus and the special tokens.
        println!(
            "> --vocab-size {} is below the corpus's characters and the special tokens: the \
             trained vocabulary has {}",
            args.vocab_size,
            tokenizer.vocab_size()
        );
    }
    if let Some(dir) = args.save.as_ref().filter(|_| leader) {
        std::fs::create_dir_all(dir).map_err(|e| format!("--save {}: {e}", dir.display()))?;
        tokenizer
            .save(&dir.join("tokenizer.json"))
            .map_err(|e| e.to_string())?;
    }
    Ok(tokenizer)
}

/// BERT for the shared loop: its config, data and head choice.
struct BertFamily {
    config: BertConfig,
    train: BertDataset,
    valid: BertDataset,
    all_positions: bool,
    header: String,
}

impl Family for BertFamily {
    type Chunk = Bert;

    fn example(&self) -> &'static str {
        "bert_pretrain"
    }

    fn header(&self) -> String {
        self.header.clone()
    }

    fn has_sop(&self) -> bool {
        true
    }

    fn init_chunk(&self, ctx: &RankContext, position: PipelinePosition) -> Result<Bert, String> {
        // The dataset checks its ids against the tokenizer on the host (token types are 0
        // or 1 by construction): no device read per forward.
        Ok(self
            .config
            .init_stage(&ctx.groups.tp, position, &ctx.device)
            .map_err(|e| e.to_string())?
            .with_id_check(IdCheck::Clamp))
    }

    fn first_layer(chunk: &Bert) -> usize {
        chunk.first_layer()
    }

    fn global_name(first: &[usize], path: &str) -> String {
        Bert::global_param_name_at(first, path)
    }

    fn forward_step(
        &self,
        s: ForwardStep<'_, Bert, 3>,
        split: Split,
        samples: Range<usize>,
        rng: Option<&RngTracker>,
        cp: Option<&ContextParallel>,
        device: &Device,
    ) -> Result<ChunkOutput<3>, StageError> {
        let data = match split {
            Split::Train => &self.train,
            Split::Valid => &self.valid,
        };
        // ANCHOR: bert_step
        let samples: Vec<BertSample> = samples.map(|i| data.sample(i)).collect();
        let mut b = BertBatch::new(&samples, device);
        if let Some(cp) = cp {
            // This rank's tokens (Megatron's `get_batch_on_this_cp_rank`); the padding
            // stays whole, since attention sees every key.
            b.ids = cp.split_tensor(b.ids, 1)?;
            b.types = cp.split_tensor(b.types, 1)?;
            b.labels = cp.split_tensor(b.labels, 1)?;
            b.loss_mask = cp.split_tensor(b.loss_mask, 1)?;
        }
        let tokens = s.input.is_none().then_some((b.ids, b.types));
        let last = s.model.head.is_some();
        // The predicted positions from the samples' host masks: no device read.
        let positions = (last && !self.all_positions)
            .then(|| {
                let mut mask = Vec::new();
                for x in &samples {
                    match cp {
                        Some(cp) => mask.extend(cp.split(&x.loss_mask)?),
                        None => mask.extend_from_slice(&x.loss_mask),
                    }
                }
                MaskedPositions::from_host_mask(&mask, b.loss_mask.dims(), device)
            })
            .transpose()?;
        let (model, positions) = (s.model, positions.as_ref());
        let out = match cp {
            None => model.forward_stage_with_positions(tokens, s.input, b.padding, rng, positions),
            Some(cp) => model.forward_stage_cp(tokens, s.input, b.padding, rng, positions, cp),
        }?;
        Ok(match out {
            BertStageOutput::Hidden(h) => ChunkOutput::Activation(h),
            BertStageOutput::Output(o) => {
                let (lm, sop) = match cp {
                    None => model.loss(o, b.labels, b.loss_mask, b.is_random)?,
                    // Megatron's scaling: × CP here, averaged over DP × CP with the
                    // gradients, so the CP ranks' shares add up.
                    Some(cp) => {
                        let (lm, sop) = model.loss_cp(o, b.labels, b.loss_mask, b.is_random, cp)?;
                        let n = cp.size() as f32;
                        (lm * n, sop * n)
                    }
                };
                let report = vec![lm.clone(), sop.clone()];
                ChunkOutput::Loss {
                    loss: lm + sop,
                    report,
                }
            }
        })
        // ANCHOR_END: bert_step
    }
}

/// Validates `args`, prepares the data and trains; returns the log of global rank 0.
pub fn run(args: &Args) -> Result<Summary, String> {
    let start = Instant::now();
    let layout = args.validate()?;
    let a = &args.train;
    let leader = is_leader(a)?;
    let (docs, valid_docs) = corpus(a)?;
    let tokenizer = tokenizer(a, &docs, leader)?;
    let data_config = BertDatasetConfig::new(a.seq_length).with_seed(a.seed);
    let valid_config = data_config.clone().with_seed(a.seed.wrapping_add(1));
    let (train, valid) = match a.data_source()? {
        DataSource::Megatron(blend) => {
            let [train, valid] = megatron_documents(a, &blend)?;
            let dataset = |docs, config| {
                BertDataset::from_token_documents(docs, &tokenizer, config)
                    .map_err(|e| format!("--data-path: {e}"))
            };
            (dataset(train, data_config)?, dataset(valid, valid_config)?)
        }
        _ => (
            BertDataset::new(&docs, &tokenizer, data_config).map_err(|e| e.to_string())?,
            BertDataset::new(&valid_docs, &tokenizer, valid_config).map_err(|e| e.to_string())?,
        ),
    };
    let config = args.model_config(tokenizer.vocab_size());
    // Beside the checkpoints, what the `checkpoint` tool needs to rebuild the model.
    if let Some(dir) = a.save.as_ref().filter(|_| leader) {
        let path = dir.join("bert_config.json");
        config
            .save(&path)
            .map_err(|e| format!("--save {}: {e}", path.display()))?;
    }
    let header = format!(
        "> BERT {} layers, hidden {}, {} heads, seq {} | {} | vocab {} (padded {}) | \
         {} train / {} validation segments | {}",
        a.num_layers,
        a.hidden_size,
        a.num_attention_heads,
        a.seq_length,
        layout_line(a),
        tokenizer.vocab_size(),
        config.padded_vocab_size,
        train.len(),
        valid.len(),
        precision(a),
    );
    let family = BertFamily {
        config,
        train,
        valid,
        all_positions: args.mlm_head_all_positions,
        header,
    };
    let rank = |ctx, shared: &Arc<_>| super::train::train_rank(ctx, shared);
    train_family(a, layout, family, leader, start, &rank)
}
