//! The pretraining command line that `bert_pretrain` and `gpt_pretrain` share (Megatron's
//! flag names), checked before any work starts; each example adds its model's flags.

use super::device::TrainDevice;
use burn_megatron::data::BatchLayout;
use burn_megatron::launch::DistributedBackend;
use burn_megatron::models::AttnBackend;
use burn_megatron::optimizer::{LrDecayStyle, WdIncrStyle, WsdDecayStyle};
use burn_megatron::pipeline::PipelineSchedule;
use burn_megatron::recompute::{
    RecomputeConfig, RecomputeGranularity, RecomputeMethod, RecomputeModule,
};
use burn_megatron::topology::{LayerSplit, ParallelConfig, PipelineLayout};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// Learning-rate decay style, as Megatron's `--lr-decay-style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecayStyle {
    /// Constant after warmup.
    Constant,
    /// Linear to `--min-lr`.
    Linear,
    /// Half a cosine to `--min-lr`.
    Cosine,
    /// `1 / sqrt(step)`.
    InverseSquareRoot,
    /// Warmup-stable-decay: `--lr` until the last `--lr-wsd-decay-iters`, then annealed to
    /// `--min-lr` as `--lr-wsd-decay-style` says.
    #[value(name = "WSD", alias = "wsd")]
    Wsd,
}

/// The WSD style's annealing shape, as Megatron's `--lr-wsd-decay-style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WsdDecay {
    /// `1 − r` over the decay phase's fraction `r`.
    Linear,
    /// `(cos(π r) + 1) / 2`.
    Cosine,
    /// `2 · 0.5^r − 1`.
    Exponential,
    /// `1 − √r`.
    #[value(name = "minus_sqrt", alias = "minus-sqrt")]
    MinusSqrt,
}

impl From<WsdDecay> for WsdDecayStyle {
    fn from(s: WsdDecay) -> Self {
        match s {
            WsdDecay::Linear => WsdDecayStyle::Linear,
            WsdDecay::Cosine => WsdDecayStyle::Cosine,
            WsdDecay::Exponential => WsdDecayStyle::Exponential,
            WsdDecay::MinusSqrt => WsdDecayStyle::MinusSqrt,
        }
    }
}

impl From<DecayStyle> for LrDecayStyle {
    fn from(s: DecayStyle) -> Self {
        match s {
            DecayStyle::Constant => LrDecayStyle::Constant,
            DecayStyle::Linear => LrDecayStyle::Linear,
            DecayStyle::Cosine => LrDecayStyle::Cosine,
            DecayStyle::InverseSquareRoot => LrDecayStyle::InverseSquareRoot,
            DecayStyle::Wsd => LrDecayStyle::Wsd,
        }
    }
}

/// Megatron's `--cp-comm-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CpCommType {
    /// K and V all-gathered over CP in each layer.
    #[value(name = "all_gather")]
    AllGather,
    /// Ring attention: K/V blocks passed around the CP ring, merged by log-sum-exp.
    P2p,
    /// Ulysses: all-to-alls trade tokens for heads, attention sees the whole sequence.
    A2a,
}

/// Megatron's `--attention-backend`, with the backends this library has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionBackend {
    /// Scores, softmax, dropout and weighted values as separate products and kernels; the
    /// `[b, heads, s, s]` probabilities kept for backward.
    Unfused,
    /// A block of `--attention-query-chunk` query rows at a time, the probabilities
    /// recomputed in backward: nothing `[b, heads, s, s]` kept.
    Chunked,
    /// One kernel per direction on CUDA and wgpu (the chunked schedule on the CPU): only
    /// each query row's log-sum-exp kept.
    Flash,
}

impl From<AttentionBackend> for AttnBackend {
    fn from(b: AttentionBackend) -> Self {
        match b {
            AttentionBackend::Unfused => AttnBackend::Unfused,
            AttentionBackend::Chunked => AttnBackend::Chunked,
            AttentionBackend::Flash => AttnBackend::Flash,
        }
    }
}

/// Megatron's `--recompute-granularity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Granularity {
    /// Whole layers.
    Full,
    /// Sub-modules of each layer.
    Selective,
}

/// Megatron's `--recompute-method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Method {
    /// Every layer, in regions of `--recompute-num-layers`.
    Uniform,
    /// The first `--recompute-num-layers` layers of each pipeline chunk.
    Block,
}

/// Weight-decay increment style, as Megatron's `--weight-decay-incr-style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WdIncr {
    /// Constant (start and end must be equal).
    Constant,
    /// Linear from start to end.
    Linear,
    /// Half a cosine from start to end.
    Cosine,
}

impl From<WdIncr> for WdIncrStyle {
    fn from(s: WdIncr) -> Self {
        match s {
            WdIncr::Constant => WdIncrStyle::Constant,
            WdIncr::Linear => WdIncrStyle::Linear,
            WdIncr::Cosine => WdIncrStyle::Cosine,
        }
    }
}

/// Training with tensor, pipeline and data parallelism (ranks run as threads of this
/// process, or as processes under mpirun / srun / torchrun). Without `--data-path` it trains
/// on a procedurally generated English-like corpus.
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 2)]
    pub tensor_model_parallel_size: usize,
    /// Split LayerNorm and dropout activations along the sequence across TP ranks.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Context-parallel size: each sequence split over this many ranks (rank r holds
    /// chunks r and 2·CP − 1 − r of 2·CP, so causal attention's work is balanced).
    #[arg(long, default_value_t = 1)]
    pub context_parallel_size: usize,
    /// How attention reaches the other CP ranks' keys and values.
    #[arg(long, value_enum, default_value = "all_gather")]
    pub cp_comm_type: CpCommType,
    /// Expert-parallel size: each MoE layer's experts split over this many ranks, which
    /// exchange tokens (laid out as Megatron-Core's expert groups).
    #[arg(long, default_value_t = 1)]
    pub expert_model_parallel_size: usize,
    /// Expert tensor-parallel size: each expert's weights split over this many ranks, 1 or
    /// the tensor-parallel size (Megatron's default is the tensor-parallel size; here 1, the
    /// experts whole on each rank).
    #[arg(long, default_value_t = 1)]
    pub expert_tensor_parallel_size: usize,
    /// Form the parallel linear layers' weight gradients in f32 with the fused kernel
    /// (Megatron's flag of the same name), also under --bf16 / --fp16.
    #[arg(long)]
    pub gradient_accumulation_fusion: bool,
    /// Pipeline stages; each holds `--num-layers / PP` layers (unless the flags below
    /// split them unevenly), the first the embeddings and the last the heads.
    #[arg(long, default_value_t = 1)]
    pub pipeline_model_parallel_size: usize,
    /// Layers per model chunk of the interleaved 1F1B schedule: each stage holds
    /// V = (layers + the counted embedding and loss) / PP / this chunks (default: one chunk,
    /// plain 1F1B).
    #[arg(long)]
    pub num_layers_per_virtual_pipeline_stage: Option<usize>,
    /// Model chunks per stage of the interleaved 1F1B schedule (V), the way to interleave
    /// an uneven split; not with --num-layers-per-virtual-pipeline-stage.
    #[arg(long)]
    pub num_virtual_stages_per_pipeline_rank: Option<usize>,
    /// Layers on the first pipeline stage, which also embeds; the stages between the first
    /// and the last split the rest evenly.
    #[arg(long)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    /// Layers on the last pipeline stage, which also computes the loss.
    #[arg(long)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    /// Count the embedding as a layer of the even split: the first stage holds one layer
    /// fewer.
    #[arg(long)]
    pub account_for_embedding_in_pipeline_split: bool,
    /// Count the loss as a layer of the even split: the last stage holds one layer fewer.
    #[arg(long)]
    pub account_for_loss_in_pipeline_split: bool,
    /// Every virtual stage's layers, written out: stages separated by `|` in virtual-stage
    /// order, `E` the embedding, `t` a transformer layer, `L` the loss, `x*n` and `(…)*n`
    /// repeating (`E|t*4|(tt|)*2,tL`). The number of stages over PP sets the model chunks
    /// per stage; not with the four flags above or --num-layers-per-virtual-pipeline-stage.
    #[arg(long)]
    pub pipeline_model_parallel_layout: Option<PipelineLayout>,
    /// Microbatches per group of the interleaved schedule's table (default: PP).
    #[arg(long)]
    pub microbatch_group_size_per_virtual_pipeline_stage: Option<usize>,
    /// Total ranks; data-parallel size = world size / (TP × PP × CP).
    #[arg(long, default_value_t = 2)]
    pub world_size: usize,
    /// Transformer layers.
    #[arg(long, default_value_t = 2)]
    pub num_layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 128)]
    pub hidden_size: usize,
    /// Attention heads (divisible by the TP size).
    #[arg(long, default_value_t = 4)]
    pub num_attention_heads: usize,
    /// MLP inner size (default 4 × hidden).
    #[arg(long)]
    pub ffn_hidden_size: Option<usize>,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    pub seq_length: usize,
    /// Position-embedding table size (default: the sequence length).
    #[arg(long)]
    pub max_position_embeddings: Option<usize>,
    /// Activation recomputation: `full` recomputes whole layers (see
    /// --recompute-method), `selective` the --recompute-modules inside each layer.
    #[arg(long, value_enum)]
    pub recompute_granularity: Option<Granularity>,
    /// With `full`: `uniform` recomputes every layer in regions of --recompute-num-layers,
    /// `block` the first --recompute-num-layers layers of each pipeline chunk.
    #[arg(long, value_enum)]
    pub recompute_method: Option<Method>,
    /// With `full`: layers per region (`uniform`) or recomputed layers per chunk (`block`).
    #[arg(long)]
    pub recompute_num_layers: Option<usize>,
    /// With `selective`: which sub-modules (core_attn, mlp, layernorm, mlp_act), space- or
    /// comma-separated.
    #[arg(long, num_args = 1.., value_delimiter = ',', default_value = "core_attn")]
    pub recompute_modules: Vec<RecomputeModule>,
    /// Samples per forward/backward on one data-parallel rank.
    #[arg(long, default_value_t = 8)]
    pub micro_batch_size: usize,
    /// Samples per optimizer step over all data-parallel ranks.
    #[arg(long, default_value_t = 16)]
    pub global_batch_size: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 800)]
    pub train_iters: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Floor of the decay.
    #[arg(long, default_value_t = 1e-5)]
    pub min_lr: f64,
    /// Decay style.
    #[arg(long, value_enum, default_value_t = DecayStyle::Cosine)]
    pub lr_decay_style: DecayStyle,
    /// Iterations of the WSD style's decay phase, the last of `--train-iters` (`WSD` only).
    #[arg(long)]
    pub lr_wsd_decay_iters: Option<usize>,
    /// The WSD style's annealing shape (`WSD` only).
    #[arg(long, value_enum, default_value_t = WsdDecay::Exponential)]
    pub lr_wsd_decay_style: WsdDecay,
    /// Fraction of `--train-iters` spent warming up.
    #[arg(long, default_value_t = 0.05)]
    pub lr_warmup_fraction: f64,
    /// AdamW weight decay (not applied to biases and norms).
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// Weight decay at the first iteration (default: --weight-decay).
    #[arg(long)]
    pub start_weight_decay: Option<f64>,
    /// Weight decay at the last iteration (default: --weight-decay).
    #[arg(long)]
    pub end_weight_decay: Option<f64>,
    /// How the weight decay moves from start to end over --train-iters.
    #[arg(long, value_enum, default_value_t = WdIncr::Constant)]
    pub weight_decay_incr_style: WdIncr,
    /// Reduce data-parallel gradients bucket by bucket during backward.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// Step with the fused Adam over flat FP32 buffers (one kernel per parameter group)
    /// instead of burn-optim's `AdamW`; the same update.
    #[arg(long)]
    pub use_fused_adam: bool,
    /// The vocabulary is padded to a multiple of this × TP (Megatron's flag). A GPT's
    /// checkpoint holds the real vocabulary and loads at any padding; a BERT's holds the
    /// padded one (its padding logits take part in the softmax), so it loads at another TP
    /// size only when both pad it to the same size.
    #[arg(long, default_value_t = 128)]
    pub make_vocab_size_divisible_by: usize,
    /// Megatron's distributed optimizer (ZeRO-1): gradients reduce-scattered over the
    /// data-parallel group, each rank keeping master weights and Adam moments for its shard
    /// only, weights all-gathered after the step; around the fused Adam with
    /// --use-fused-adam, around burn-optim's AdamW otherwise.
    #[arg(long)]
    pub use_distributed_optimizer: bool,
    /// Clip gradients to this global L2 norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
    /// Train in bf16 with FP32 master weights.
    #[arg(long, conflicts_with = "fp16")]
    pub bf16: bool,
    /// Train in f16 with FP32 master weights and loss scaling.
    #[arg(long)]
    pub fp16: bool,
    /// Fixed loss scale for --fp16 (default: dynamic).
    #[arg(long)]
    pub loss_scale: Option<f64>,
    /// Hidden-state dropout.
    #[arg(long, default_value_t = 0.1)]
    pub hidden_dropout: f64,
    /// Attention-probability dropout.
    #[arg(long, default_value_t = 0.1)]
    pub attention_dropout: f64,
    /// How the core attention runs.
    #[arg(long, value_enum, default_value_t = AttentionBackend::Unfused)]
    pub attention_backend: AttentionBackend,
    /// Query rows per block of `--attention-backend chunked` (its transient scores are
    /// `[micro-batch, heads / TP, rows, seq]`).
    #[arg(long, default_value_t = 128)]
    pub attention_query_chunk: usize,
    /// Standard deviation of the normal weight initialisation.
    #[arg(long, default_value_t = 0.02)]
    pub init_method_std: f64,
    /// Seed of weights, data and dropout.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// The data: Megatron's `PREFIX` of `PREFIX.bin`/`.idx` (as `preprocess_data` writes
    /// them), or weighted prefixes `W1 P1 W2 P2 …`; or a corpus file, `.jsonl` ({"text": …}
    /// per line) or plain text (blank-line separated documents). Default: the built-in
    /// generator.
    #[arg(long, num_args = 1..)]
    pub data_path: Vec<String>,
    /// The train, validation and test proportions of a Megatron dataset's documents.
    #[arg(long, default_value = "969,30,1")]
    pub split: String,
    /// Where a Megatron dataset's sample indices are cached (default: beside the data).
    #[arg(long)]
    pub data_cache_path: Option<PathBuf>,
    /// Documents the built-in generator writes.
    #[arg(long, default_value_t = 20_000)]
    pub synthetic_documents: usize,
    /// The tokenizer: a Hugging Face `tokenizer.json` (or BERT's `vocab.txt`). Default: BERT
    /// uses the generator's vocabulary, or with `--data-path` trains a WordPiece one; GPT
    /// trains a byte-level BPE on the corpus.
    #[arg(long, visible_alias = "tokenizer-model")]
    pub vocab_file: Option<PathBuf>,
    /// Size of a vocabulary trained on the corpus.
    #[arg(long, default_value_t = 8192)]
    pub vocab_size: usize,
    /// Save checkpoints under this directory.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from the newest checkpoint under this directory that verifies (at or before
    /// `latest_checkpointed_iteration.txt`), saved at any layout.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// With --load, the iteration to load (Megatron's flag); an error if it does not
    /// verify. Without it, the newest checkpoint at or before
    /// `latest_checkpointed_iteration.txt` that verifies, falling back past any that do not.
    #[arg(long, requires = "load")]
    pub ckpt_step: Option<usize>,
    /// With --load, take the weights only: a fresh optimizer (Megatron's flag).
    #[arg(long)]
    pub no_load_optim: bool,
    /// Iterations between checkpoints (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_interval: usize,
    /// Iterations between log lines.
    #[arg(long, default_value_t = 50)]
    pub log_interval: usize,
    /// Iterations between validation losses (0 disables).
    #[arg(long, default_value_t = 200)]
    pub eval_interval: usize,
    /// Batches per validation.
    #[arg(long, default_value_t = 5)]
    pub eval_iters: usize,
    /// Where the loss curve is drawn (PNG; default: `<example>_loss.png`).
    #[arg(long)]
    pub loss_plot: Option<PathBuf>,
    /// Write the last iteration's pipeline schedule as a Chrome trace (JSON; Perfetto and
    /// chrome://tracing open it) and as a PNG beside it.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Also write every iteration's log as JSON lines (full precision) to this file.
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// How the ranks communicate, as Megatron's flag: `threads` runs every rank in this
    /// process; `mpi` is one process per rank, started by mpirun or srun (build with
    /// `--features mpi`); `nccl` is one process per GPU, started by torchrun, srun or
    /// mpirun (build with `--features cuda`).
    #[arg(long, default_value = "threads")]
    pub distributed_backend: DistributedBackend,
    /// Where the ranks compute under `threads` and `mpi` (under `nccl` each rank is on its
    /// local GPU): `cpu`, `cuda` (GPU 0) or `wgpu` (a Vulkan GPU).
    #[arg(long, value_enum, default_value_t = TrainDevice::Cpu)]
    pub device: TrainDevice,
    /// The bound on every collective, in minutes, as Megatron's flag: a rank that waits
    /// longer for its peers fails, naming the ranks it waited for. The default is the
    /// library's (5; Megatron's is 10). Checkpoint barriers have their own, longer bound.
    #[arg(long, default_value_t = 5)]
    pub distributed_timeout_minutes: u64,
}

impl TrainArgs {
    /// Data-parallel size.
    pub fn data_parallel_size(&self) -> usize {
        let mp = self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size;
        self.world_size / mp.max(1)
    }

    /// Model chunks per pipeline stage (V): 1 without interleaving.
    pub fn num_model_chunks(&self) -> usize {
        let pp = self.pipeline_model_parallel_size.max(1);
        let split = self.layer_split();
        // Megatron counts the embedding and the loss in the layers a stage holds.
        let counted = split.counted_ends();
        let layout = self.pipeline_model_parallel_layout.as_ref();
        match (
            self.num_virtual_stages_per_pipeline_rank,
            self.num_layers_per_virtual_pipeline_stage,
        ) {
            (Some(v), _) => v.max(1),
            (None, _) if let Some(layout) = layout => (layout.num_stages() / pp).max(1),
            (None, Some(n)) if n > 0 => ((self.num_layers + counted) / pp / n).max(1),
            _ => 1,
        }
    }

    /// Whether a flag asks for the interleaved schedule.
    fn interleaved(&self) -> bool {
        self.num_layers_per_virtual_pipeline_stage.is_some()
            || self.num_virtual_stages_per_pipeline_rank.is_some()
            || self.num_model_chunks() > 1
    }

    /// How the layers split over the pipeline stages.
    pub fn layer_split(&self) -> LayerSplit {
        LayerSplit {
            num_layers_in_first_pipeline_stage: self.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage: self.decoder_last_pipeline_num_layers,
            account_for_embedding_in_pipeline_split: self.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split: self.account_for_loss_in_pipeline_split,
            pipeline_model_parallel_layout: self.pipeline_model_parallel_layout,
        }
    }

    /// Layers of each virtual stage (`chunk·PP + stage`), or an error naming the flags.
    pub fn layers_per_virtual_stage(&self) -> Result<Vec<usize>, String> {
        let (pp, v) = (self.pipeline_model_parallel_size, self.num_model_chunks());
        self.layer_split()
            .layers_per_virtual_stage(self.num_layers, pp, v)
            .map_err(|e| {
                let split = [
                    (
                        "--decoder-first-pipeline-num-layers",
                        self.decoder_first_pipeline_num_layers.is_some(),
                    ),
                    (
                        "--decoder-last-pipeline-num-layers",
                        self.decoder_last_pipeline_num_layers.is_some(),
                    ),
                    (
                        "--account-for-embedding-in-pipeline-split",
                        self.account_for_embedding_in_pipeline_split,
                    ),
                    (
                        "--account-for-loss-in-pipeline-split",
                        self.account_for_loss_in_pipeline_split,
                    ),
                ];
                let flags: Vec<&str> = split.iter().filter(|f| f.1).map(|f| f.0).collect();
                format!(
                    "--num-layers ({}) over --pipeline-model-parallel-size ({pp}) × {v} model \
                     chunks per stage{}: {e}",
                    self.num_layers,
                    if flags.is_empty() {
                        String::new()
                    } else {
                        format!(" with {}", flags.join(", "))
                    }
                )
            })
    }

    /// The parallel layout, validated.
    pub fn parallel_config(&self) -> Result<ParallelConfig, String> {
        let v = self.num_model_chunks();
        let config = ParallelConfig::new(
            self.world_size,
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
        )
        .with_context_parallel(self.context_parallel_size)
        .with_expert_parallel(self.expert_model_parallel_size)
        .with_expert_tensor_parallel(self.expert_tensor_parallel_size)
        .with_virtual_pipeline(self.interleaved().then_some(v))
        .with_layer_split(self.layer_split());
        config.clone().validate().map_err(|e| {
            format!(
                "--world-size {} with --tensor-model-parallel-size {}, --pipeline-model-parallel-size {}, --context-parallel-size {}, --expert-model-parallel-size {} and --expert-tensor-parallel-size {}: {e}",
                self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size, self.expert_model_parallel_size, self.expert_tensor_parallel_size
            )
        })?;
        Ok(config)
    }

    /// The pipeline schedule of one iteration.
    pub fn schedule(&self, layout: &BatchLayout) -> PipelineSchedule {
        PipelineSchedule::new(
            self.pipeline_model_parallel_size,
            layout.num_micro_batches(),
        )
        .with_model_chunks(self.num_model_chunks())
        .with_microbatch_group_size(self.microbatch_group_size_per_virtual_pipeline_stage)
    }

    /// The collective timeout of `--distributed-timeout-minutes`.
    pub fn distributed_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.distributed_timeout_minutes.saturating_mul(60))
    }

    /// The recomputation the `--recompute-*` flags ask for.
    pub fn recompute(&self) -> RecomputeConfig {
        RecomputeConfig::new()
            .with_granularity(self.recompute_granularity.map(|g| match g {
                Granularity::Full => RecomputeGranularity::Full,
                Granularity::Selective => RecomputeGranularity::Selective,
            }))
            .with_method(self.recompute_method.map(|m| match m {
                Method::Uniform => RecomputeMethod::Uniform,
                Method::Block => RecomputeMethod::Block,
            }))
            .with_num_layers(self.recompute_num_layers)
            .with_modules(self.recompute_modules.clone())
    }
}

mod validate;

pub use validate::{Domain, check_float};
