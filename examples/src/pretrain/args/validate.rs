//! The pretraining flags' checks: every flag's value and their combinations refused with a
//! message naming the flags, before any rank starts.

use super::{CpCommType, TrainArgs};
use burn_megatron::checkpoint::{CheckpointIndex, committed_dir, latest_loadable_checkpoint};
use burn_megatron::data::BatchLayout;
use burn_megatron::launch::DistributedBackend;

/// The values a float flag may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// Zero or more.
    NonNegative,
    /// More than zero.
    Positive,
    /// In [0, 1): a dropout probability, a fraction of the run.
    Fraction,
    /// In (0, 1]: a share of something that must keep a part.
    Share,
}

/// `value` of `flag`, refused when it is NaN, infinite or outside `domain`, with a message
/// naming the flag: clap parses `nan` and `inf` as floats, and a NaN learning rate would
/// make every loss after the first step NaN (and a `--save` write NaN weights).
///
/// ```
/// use burn_megatron_examples::pretrain::{Domain, check_float};
/// assert!(check_float("--lr", 3e-4, Domain::NonNegative).is_ok());
/// assert_eq!(
///     check_float("--lr", f64::NAN, Domain::NonNegative).unwrap_err(),
///     "--lr must be a finite number ≥ 0, got NaN"
/// );
/// ```
pub fn check_float(flag: &str, value: f64, domain: Domain) -> Result<(), String> {
    let (ok, range) = match domain {
        Domain::NonNegative => (value >= 0.0, "≥ 0"),
        Domain::Positive => (value > 0.0, "> 0"),
        Domain::Fraction => ((0.0..1.0).contains(&value), "in [0, 1)"),
        Domain::Share => (value > 0.0 && value <= 1.0, "in (0, 1]"),
    };
    match value.is_finite() && ok {
        true => Ok(()),
        false => Err(format!(
            "{flag} must be a finite number {range}, got {value}"
        )),
    }
}

impl TrainArgs {
    /// Megatron's checks of `--context-parallel-size` against the sequence.
    fn validate_context_parallel(&self) -> Result<(), String> {
        let (cp, tp, s) = (
            self.context_parallel_size,
            self.tensor_model_parallel_size,
            self.seq_length,
        );
        if cp == 1 {
            return Ok(());
        }
        let heads = self.num_attention_heads;
        if self.cp_comm_type == CpCommType::A2a && !(heads / tp).is_multiple_of(cp) {
            return Err(format!(
                "--cp-comm-type a2a splits the attention heads over context parallelism: \
                 --num-attention-heads ({heads}) / --tensor-model-parallel-size ({tp}) is not \
                 divisible by --context-parallel-size ({cp})"
            ));
        }
        if !s.is_multiple_of(2 * cp) {
            return Err(format!(
                "--seq-length ({s}) must be divisible by 2 × --context-parallel-size ({})",
                2 * cp
            ));
        }
        if self.sequence_parallel && !(s / cp).is_multiple_of(tp) {
            return Err(format!(
                "--seq-length / --context-parallel-size ({}) must be divisible by \
                 --tensor-model-parallel-size ({tp}) with --sequence-parallel",
                s / cp
            ));
        }
        Ok(())
    }

    /// What one process per rank cannot do, refused before any work.
    fn validate_backend(&self) -> Result<(), String> {
        if self.distributed_timeout_minutes == 0 {
            return Err("--distributed-timeout-minutes must be at least 1".into());
        }
        if self.distributed_backend == DistributedBackend::Threads {
            return Ok(());
        }
        let saved = self
            .load
            .as_ref()
            .is_some_and(|d| d.join("tokenizer.json").is_file());
        if !self.data_path.is_empty() && self.vocab_file.is_none() && !saved {
            return Err(format!(
                "--distributed-backend {} with --data-path needs --vocab-file: a tokenizer \
                 trained in each process could differ between them",
                self.distributed_backend
            ));
        }
        Ok(())
    }

    /// The pipeline flags' own checks, before the layout is built.
    fn validate_pipeline(&self) -> Result<(), String> {
        let (pp, layers) = (self.pipeline_model_parallel_size, self.num_layers);
        if pp == 0 {
            return Err("--pipeline-model-parallel-size must be at least 1".into());
        }
        let split = self.layer_split();
        match (
            self.num_layers_per_virtual_pipeline_stage,
            self.num_virtual_stages_per_pipeline_rank,
        ) {
            (Some(_), Some(_)) => {
                return Err("set one of --num-layers-per-virtual-pipeline-stage and \
                     --num-virtual-stages-per-pipeline-rank"
                    .into());
            }
            (Some(_), None) | (None, Some(_)) if pp == 1 => {
                return Err(
                    "the interleaved schedule (--num-layers-per-virtual-pipeline-stage \
                     or --num-virtual-stages-per-pipeline-rank) needs \
                     --pipeline-model-parallel-size > 1"
                        .into(),
                );
            }
            (None, None)
                if pp == 1
                    && split
                        .pipeline_model_parallel_layout
                        .is_some_and(|l| l.num_stages() > 1) =>
            {
                return Err(
                    "--pipeline-model-parallel-layout of more than one stage needs \
                     --pipeline-model-parallel-size > 1 (its stages over the pipeline's set \
                     the model chunks of each)"
                        .into(),
                );
            }
            (Some(_), None) if split.pipeline_model_parallel_layout.is_some() => {
                return Err(
                    "--pipeline-model-parallel-layout sets every stage's layers, \
                     and with them the model chunks: not with \
                     --num-layers-per-virtual-pipeline-stage"
                        .into(),
                );
            }
            (Some(_), None) if split.is_uneven() => {
                return Err("an uneven split (--decoder-first-pipeline-num-layers or \
                     --decoder-last-pipeline-num-layers) interleaves with \
                     --num-virtual-stages-per-pipeline-rank, not \
                     --num-layers-per-virtual-pipeline-stage"
                    .into());
            }
            (Some(n), None) => {
                let counted = split.counted_ends();
                let per_stage = (layers + counted) / pp;
                if n == 0 || !(layers + counted).is_multiple_of(pp) || !per_stage.is_multiple_of(n)
                {
                    return Err(format!(
                        "--num-layers-per-virtual-pipeline-stage ({n}) must divide the \
                         {per_stage} layers of each stage (--num-layers {layers}{} / \
                         --pipeline-model-parallel-size {pp})",
                        if counted > 0 {
                            format!(" + {counted} counted for the embedding and the loss")
                        } else {
                            String::new()
                        }
                    ));
                }
            }
            (None, Some(0)) => {
                return Err("--num-virtual-stages-per-pipeline-rank must be at least 1".into());
            }
            _ => {}
        }
        self.layers_per_virtual_stage()?;
        if self
            .microbatch_group_size_per_virtual_pipeline_stage
            .is_some()
            && self.num_model_chunks() == 1
        {
            return Err(format!(
                "--microbatch-group-size-per-virtual-pipeline-stage needs the interleaved \
                 schedule (--num-layers-per-virtual-pipeline-stage or \
                 --num-virtual-stages-per-pipeline-rank){}",
                if self.interleaved() {
                    ", with more than one model chunk per stage: these flags give one, plain 1F1B"
                } else {
                    ""
                }
            ));
        }
        Ok(())
    }

    /// Every float flag in its domain, and the learning rates in order.
    fn validate_floats(&self) -> Result<(), String> {
        use Domain::*;
        let flags = [
            ("--lr", Some(self.lr), NonNegative),
            ("--min-lr", Some(self.min_lr), NonNegative),
            (
                "--lr-warmup-fraction",
                Some(self.lr_warmup_fraction),
                Fraction,
            ),
            ("--weight-decay", Some(self.weight_decay), NonNegative),
            ("--start-weight-decay", self.start_weight_decay, NonNegative),
            ("--end-weight-decay", self.end_weight_decay, NonNegative),
            ("--clip-grad", Some(self.clip_grad), NonNegative),
            ("--loss-scale", self.loss_scale, Positive),
            ("--hidden-dropout", Some(self.hidden_dropout), Fraction),
            (
                "--attention-dropout",
                Some(self.attention_dropout),
                Fraction,
            ),
            ("--init-method-std", Some(self.init_method_std), NonNegative),
        ];
        for (flag, value, domain) in flags {
            if let Some(value) = value {
                check_float(flag, value, domain)?;
            }
        }
        if self.min_lr > self.lr {
            return Err(format!(
                "--min-lr ({}) must not exceed --lr ({})",
                self.min_lr, self.lr
            ));
        }
        Ok(())
    }

    /// Whether sequence parallelism is on: `--sequence-parallel` at a tensor-parallel size
    /// above 1 (at 1 there is nothing to split, and Megatron switches it off, as here).
    pub fn sequence_parallel_on(&self) -> bool {
        self.sequence_parallel && self.tensor_model_parallel_size > 1
    }

    /// Every check that can fail before training starts, with a message naming the flags.
    pub fn validate(&self) -> Result<BatchLayout, String> {
        if self.sequence_parallel && !self.sequence_parallel_on() {
            tracing::warn!("--sequence-parallel is off: --tensor-model-parallel-size is 1");
        }
        self.validate_floats()?;
        for (flag, value) in [
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--seq-length", self.seq_length),
            ("--micro-batch-size", self.micro_batch_size),
            ("--attention-query-chunk", self.attention_query_chunk),
        ] {
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        self.validate_pipeline()?;
        self.validate_backend()?;
        // Megatron checks --recompute-num-layers against the layers of a pipeline rank (the
        // largest, under an uneven split).
        let (pp, per_stage) = (
            self.pipeline_model_parallel_size,
            self.layers_per_virtual_stage()?,
        );
        let per_rank = burn_megatron::topology::LayerSplit::per_rank(&per_stage, pp);
        let per_rank = per_rank.into_iter().max().unwrap_or(0);
        self.recompute().check(per_rank).map_err(|e| e.0)?;
        self.parallel_config()?;
        self.validate_context_parallel()?;
        let tp = self.tensor_model_parallel_size;
        if self.sequence_parallel && !self.seq_length.is_multiple_of(tp) {
            return Err(format!(
                "--seq-length ({}) must be divisible by --tensor-model-parallel-size ({tp}) \
                 with --sequence-parallel",
                self.seq_length
            ));
        }
        let dp = self.data_parallel_size();
        let pp = self.pipeline_model_parallel_size;
        let layout = BatchLayout::new(self.global_batch_size, self.micro_batch_size, dp)
            .map_err(|_| {
                format!(
                    "--global-batch-size ({}) must be divisible by --micro-batch-size ({}) × \
                     data-parallel size ({dp} = --world-size {} / (--tensor-model-parallel-size {tp} × \
                     --pipeline-model-parallel-size {pp}))",
                    self.global_batch_size, self.micro_batch_size, self.world_size
                )
            })?;
        self.schedule(&layout).validate().map_err(|e| {
            format!(
                "pipeline schedule of {} microbatches (--global-batch-size / (--micro-batch-size × \
                 data-parallel size)) over --pipeline-model-parallel-size {pp}: {e}",
                layout.num_micro_batches()
            )
        })?;
        if let Some(p) = self.vocab_file.as_ref().filter(|p| !p.is_file()) {
            return Err(format!("--vocab-file {}: no such file", p.display()));
        }
        self.data_source()?;
        if let Some(dir) = &self.load {
            self.check_saved_layout(dir)?;
        }
        if self.train_iters == 0 || self.log_interval == 0 {
            return Err("--train-iters and --log-interval must be positive".into());
        }
        super::super::setup::scheduler(self)?;
        if self.loss_scale.is_some() && !self.fp16 {
            return Err("--loss-scale needs --fp16".into());
        }
        Ok(layout)
    }

    /// The checkpoint to load, read: `--ckpt-step`'s, or the newest under `dir` that
    /// verifies.
    fn checkpoint_to_load(
        &self,
        dir: &std::path::Path,
    ) -> Result<(usize, CheckpointIndex), String> {
        if let Some(step) = self.ckpt_step {
            let index = CheckpointIndex::read(&committed_dir(dir, step))
                .map_err(|e| format!("--load {} (iteration {step}): {e}", dir.display()))?;
            return Ok((step, index));
        }
        let found = latest_loadable_checkpoint(dir).map_err(|e| format!("--load: {e}"))?;
        found.map(|f| (f.iteration, f.index)).ok_or_else(|| {
            format!(
                "--load {}: no checkpoint (latest_checkpointed_iteration.txt missing)",
                dir.display()
            )
        })
    }

    /// The checkpoint to load must be readable, and its optimizer state one this run's
    /// optimizer takes (or `--no-load-optim`); any layout loads.
    fn check_saved_layout(&self, dir: &std::path::Path) -> Result<(), String> {
        let (iteration, index) = self.checkpoint_to_load(dir)?;
        if self.no_load_optim {
            return Ok(());
        }
        let fused = self.use_fused_adam;
        let saved_fused = index.state().fused_adam_steps.is_some();
        let kind = |f: bool| {
            if f {
                "the fused Adam"
            } else {
                "burn-optim's AdamW"
            }
        };
        if fused != saved_fused {
            return Err(format!(
                "--load {}: iteration {iteration} was saved by {}, this run uses {}: add \
                 --no-load-optim to load the weights only",
                dir.display(),
                kind(saved_fused),
                kind(fused)
            ));
        }
        Ok(())
    }
}
