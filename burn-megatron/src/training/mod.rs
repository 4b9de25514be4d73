//! One rank's side of parallel training, in one object: [`ParallelTraining`] owns what a
//! training loop would otherwise thread through every call — the data-parallel reducers and
//! the distributed optimizer's shard plans of the model's chunks, the groups they reduce
//! over, and where this rank's checkpoint shards go — so that a step reads like Megatron's
//! `train_step`:
//!
//! ```text
//! let mut training = ParallelTrainingConfig::new().init(&ctx, &chunks, names)?;
//! let mut optim = training.optimizer(adamw, &chunks)?;          // ZeRO-1 if configured
//! let hooks = training.grad_sync();                             // overlapped reduction
//! loop {
//!     fb.grad_sync = hooks.as_deref();
//!     let out = forward_backward_func(…, &chunks, …, fb)?;
//!     training.finalize(&chunks, &mut grads)?;                  // finalize_model_grads
//!     (chunks, _) = optim.step(lr, chunks, grads)?;
//!     training.save(root, iteration, &chunks, &optim, extra)?;  // barriers inside
//! }
//! ```
//!
//! The model is a `Vec` of chunks (one per virtual pipeline stage; one chunk without
//! interleaving), as Megatron's list of model chunks.

use crate::checkpoint::{
    CheckpointError, CheckpointRank, Restored, SaveShare, SavedLayout,
    advanced::{begin_checkpoint, commit_checkpoint, load_checkpoint, save_checkpoint},
    latest_loadable_checkpoint,
};
use crate::comm::{Buffer, CHECKPOINT_BARRIER_TIMEOUT, Comm, CommError, CommunicatorExt};
use crate::data_parallel::{
    DataParallelConfig,
    advanced::{
        DpReduction, OptimizerShards, OverlapReducer, ShardPlan, broadcast_params, check_replicas,
        finalize_expert_grads, finalize_model_grads, sync_batch_norm,
    },
    expert_params,
};
use crate::launch::RankContext;
use crate::optimizer::{InnerOptimizer, MegatronOptimizer, OptimizerError};
use crate::pipeline::GradSync;
use crate::topology::GroupKind;
use burn::config::Config;
use burn::module::Module;
use burn::optim::GradientsParams;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// How gradients are reduced and the optimizer state is laid out (Megatron's
/// `DistributedDataParallelConfig` and `--use-distributed-optimizer`).
#[derive(Config, Debug)]
pub struct ParallelTrainingConfig {
    /// Reduce gradients while backward still runs (`--overlap-grad-reduce`).
    #[config(default = false)]
    pub overlap_grad_reduce: bool,
    /// Shard the optimizer state over the data-parallel ranks, ZeRO-1
    /// (`--use-distributed-optimizer`).
    #[config(default = false)]
    pub use_distributed_optimizer: bool,
    /// Bucket size, averaging, and the dtype gradients are reduced in.
    #[config(default = "DataParallelConfig::default()")]
    pub data_parallel: DataParallelConfig,
}

/// The global name of a parameter at a local module path of the chunks (layers by global
/// index), which checkpoints key tensors by.
pub type GlobalNames = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// This rank's data-parallel reducers, shard plans, groups and checkpoint placement for one
/// model; see the [module docs](self).
pub struct ParallelTraining {
    config: ParallelTrainingConfig,
    tp: Comm,
    /// Megatron's dp-cp group: context-parallel ranks hold the same weights, so the
    /// data-parallel reductions run over DP × CP.
    dp_cp: Comm,
    mp: Comm,
    expert_dp: Comm,
    expert_mp: Comm,
    world: Comm,
    embedding: Option<Comm>,
    /// One data-parallel channel per chunk, for the overlapped reducers.
    chunk_dp: Vec<Comm>,
    tied: bool,
    tp_rank: usize,
    pp_rank: usize,
    ep_rank: usize,
    /// This rank's index among the replicas of its experts.
    expert_dp_rank: usize,
    dp_cp_rank: usize,
    dp_cp_size: usize,
    layout: SavedLayout,
    names: GlobalNames,
    plans: Vec<ShardPlan>,
    /// The experts' plans over the expert data-parallel group (none without experts).
    expert_plans: Vec<ShardPlan>,
    reducers: Vec<OverlapReducer>,
    /// Whether a `finalize` has found the data-parallel replicas alike (checked once).
    replicas_checked: AtomicBool,
    /// Whether an optimizer was built, which copied the replicas' weights as they were.
    optimizer_built: AtomicBool,
}

impl ParallelTrainingConfig {
    /// The training state of `chunks` on this rank: shard plans when the optimizer is
    /// distributed, reducers when the reduction overlaps backward. `names` gives each local
    /// module path's global name (the identity for a model on one stage).
    pub fn init<C: Module>(
        &self,
        ctx: &RankContext,
        chunks: &[C],
        names: GlobalNames,
    ) -> Result<ParallelTraining, CommError> {
        let state = &ctx.state;
        let chunk_dp = if self.overlap_grad_reduce {
            ctx.chunk_data_parallel_groups(chunks.len())?
        } else {
            Vec::new()
        };
        let embedding = ctx.groups.embedding.clone();
        let mut training = ParallelTraining {
            config: self.clone(),
            tp: ctx.groups.tp.clone(),
            // Gradients are reduced, and the distributed optimizer sharded, over data ×
            // context parallelism (Megatron's dp-cp group): CP ranks hold the same weights
            // and each computes part of every gradient.
            dp_cp: ctx.groups.dp_cp.clone(),
            mp: ctx.groups.mp.clone(),
            expert_dp: ctx.groups.expert_dp.clone(),
            expert_mp: ctx.groups.expert_mp.clone(),
            world: ctx.groups.world.clone(),
            tied: embedding.as_ref().is_some_and(|e| e.group().size() > 1),
            embedding,
            chunk_dp,
            tp_rank: state.tensor_model_parallel_rank(),
            pp_rank: state.pipeline_model_parallel_rank(),
            ep_rank: state.expert_model_parallel_rank(),
            expert_dp_rank: state
                .index_in_group(GroupKind::ExpertDataParallel)
                .expect("a rank always belongs to its own edp group"),
            dp_cp_rank: state.data_parallel_rank_with_cp(),
            dp_cp_size: state.data_parallel_size() * state.context_parallel_size(),
            layout: SavedLayout {
                tensor_model_parallel_size: state.tensor_model_parallel_size(),
                pipeline_model_parallel_size: state.pipeline_model_parallel_size(),
                virtual_pipeline_model_parallel_size: chunks.len(),
                // The optimizer's shards: a CP 2 × DP 1 checkpoint is sharded as DP 2.
                data_parallel_size: state.data_parallel_size() * state.context_parallel_size(),
                distributed_optimizer: self.use_distributed_optimizer,
                expert_model_parallel_size: state.expert_model_parallel_size(),
            },
            names,
            plans: Vec::new(),
            expert_plans: Vec::new(),
            reducers: Vec::new(),
            replicas_checked: AtomicBool::new(false),
            optimizer_built: AtomicBool::new(false),
        };
        training.attach(chunks);
        Ok(training)
    }
}

impl ParallelTraining {
    /// Plans and reducers for `chunks`' parameters (their ids: a load may restore others).
    fn attach<C: Module>(&mut self, chunks: &[C]) {
        // The old reducers' hooks must be gone before new ones are installed.
        self.reducers.clear();
        (self.plans, self.expert_plans) = self.plans_for(chunks);
        if self.config.overlap_grad_reduce {
            self.reducers = chunks
                .iter()
                .zip(&self.chunk_dp)
                .enumerate()
                .map(|(c, (chunk, dp))| match self.plans.get(c) {
                    Some(plan) => {
                        OverlapReducer::distributed(chunk, dp, &self.config.data_parallel, plan)
                    }
                    None => OverlapReducer::new(chunk, dp, &self.config.data_parallel),
                })
                .collect();
        }
    }

    /// The distributed optimizer's plans of `chunks`: the dense ones, and the experts' when
    /// the chunks have experts.
    fn plans_for<C: Module>(&self, chunks: &[C]) -> (Vec<ShardPlan>, Vec<ShardPlan>) {
        if !self.config.use_distributed_optimizer {
            return (Vec::new(), Vec::new());
        }
        let config = &self.config.data_parallel;
        let dense = chunks
            .iter()
            .map(|c| ShardPlan::new(c, self.dp_cp_size, self.dp_cp_rank, config, self.tied))
            .collect();
        let has_experts = chunks.iter().any(|c| !expert_params(c).is_empty());
        let experts = match has_experts {
            true => {
                let (size, rank) = (self.expert_dp.group().size(), self.expert_dp_rank);
                let plan = |c| ShardPlan::experts(c, size, rank, config);
                chunks.iter().map(plan).collect()
            }
            false => Vec::new(),
        };
        (dense, experts)
    }

    /// The distributed optimizer's shards of `chunks` and the groups they shard over.
    fn shards_for<C: Module>(&self, chunks: &[C]) -> OptimizerShards {
        let (dense, experts) = self.plans_for(chunks);
        let shards = OptimizerShards::new(dense, self.dp_cp.clone());
        match experts.is_empty() {
            true => shards,
            false => shards.with_experts(experts, self.expert_dp.clone()),
        }
    }

    /// The configuration this was built with.
    pub fn config(&self) -> &ParallelTrainingConfig {
        &self.config
    }

    /// Where this rank's checkpoint shards go, and the layout it runs at.
    pub fn checkpoint_rank(&self) -> CheckpointRank<'_> {
        CheckpointRank {
            layout: self.layout,
            tensor_model_parallel_rank: self.tp_rank,
            pipeline_model_parallel_rank: self.pp_rank,
            expert_model_parallel_rank: self.ep_rank,
            // The dense weights are written by data-parallel rank 0, the experts by their
            // expert data-parallel rank 0. With the distributed optimizer every rank takes
            // part, since the state is gathered to those ranks (and only they write).
            share: SaveShare {
                dense: self.dp_cp_rank == 0 || self.config.use_distributed_optimizer,
                experts: self.expert_dp_rank == 0 || self.config.use_distributed_optimizer,
            },
            names: &*self.names,
        }
    }

    /// `inner` wrapped for `chunks`: around the distributed optimizer's shards when so
    /// configured, with the model-parallel group for the overflow check and the norm. Add
    /// clipping and loss scaling with the wrapper's `with_*` methods. Its error is
    /// [`load`](Self::load)'s `make_optimizer`'s, so that closure may be this call.
    pub fn optimizer<C: Module + Clone>(
        &self,
        inner: impl Into<InnerOptimizer>,
        chunks: &Vec<C>,
    ) -> Result<MegatronOptimizer<Vec<C>>, OptimizerError> {
        self.optimizer_built.store(true, Ordering::Relaxed);
        let (mp, tp_rank) = (self.mp.clone(), self.tp_rank);
        let optimizer = match self.config.use_distributed_optimizer {
            true => {
                MegatronOptimizer::distributed(inner, chunks, self.shards_for(chunks), mp, tp_rank)?
            }
            false => MegatronOptimizer::new(inner, chunks, mp, tp_rank),
        };
        Ok(optimizer.with_expert_model_parallel(self.expert_mp.clone()))
    }

    /// The hooks that overlap the data-parallel reduction with backward, for
    /// [`ForwardBackwardConfig::grad_sync`](crate::pipeline::ForwardBackwardConfig); `None`
    /// when the reduction does not overlap.
    pub fn grad_sync(&self) -> Option<Vec<&dyn GradSync>> {
        self.config
            .overlap_grad_reduce
            .then(|| self.reducers.iter().map(|r| r as &dyn GradSync).collect())
    }

    /// `chunks` with every replica holding the first data-parallel rank's weights and
    /// buffers (Megatron's `broadcast_params`; PyTorch's DDP does it at construction). A
    /// Burn model built on each rank needs it: Burn's initializers draw on each rank apart,
    /// and [`finalize`](Self::finalize) refuses replicas that differ. A collective: every
    /// rank calls it, once, before building the optimizer, which copies the weights it is
    /// built with (refused after, on every rank).
    ///
    /// ```text
    /// let training = ParallelTrainingConfig::new().init(&ctx, &chunks, names)?;
    /// let chunks = training.broadcast_params(chunks)?;
    /// let optimizer = training.optimizer(adamw, &chunks)?;
    /// ```
    pub fn broadcast_params<C: Module>(&self, chunks: Vec<C>) -> Result<Vec<C>, CommError> {
        if self.optimizer_built.load(Ordering::Relaxed) {
            return Err(CommError::InvalidArgument {
                group: self.dp_cp.group().name().to_string(),
                op: "broadcast_params",
                reason: "the optimizer was built before the broadcast: it copied each \
                         replica's own weights (its FP32 master weights or shards of them), \
                         and its first step would write them back. Broadcast the replicas, \
                         then build the optimizer"
                    .to_string(),
            });
        }
        chunks
            .into_iter()
            .map(|c| broadcast_params(c, &self.dp_cp, &self.expert_dp, &self.tp))
            .collect()
    }

    /// `chunks` with every drop-in [`BatchNorm`](crate::dropin::nn::BatchNorm) computing its
    /// training statistics over the data- and context-parallel batches together (PyTorch's
    /// `SyncBatchNorm.convert_sync_batchnorm`), so that DP `n` trains as one rank over the `n`
    /// batches. Refused, naming the layer, for Burn's own `burn::nn::BatchNorm`. Moves no
    /// data; every rank calls it, as every rank's training forward then synchronises.
    ///
    /// ```text
    /// let chunks = training.broadcast_params(chunks)?;
    /// let chunks = training.sync_batch_norm(chunks)?;
    /// ```
    pub fn sync_batch_norm<C: Module>(&self, chunks: Vec<C>) -> Result<Vec<C>, CommError> {
        chunks
            .into_iter()
            .map(|c| sync_batch_norm(c, &self.dp_cp))
            .collect()
    }

    /// Megatron's `finalize_model_grads` for this configuration: the data-parallel
    /// reduction (waited for when it overlapped backward, reduce-scattered for the
    /// distributed optimizer), the tensor-parallel reduction of sequence-parallel
    /// gradients, the embedding group's of tied embeddings, and the experts' over their
    /// expert-data-parallel replicas.
    ///
    /// The first call also checks that the data-parallel replicas hold the same weights,
    /// and fails naming the first parameter that differs (see
    /// [`broadcast_params`](Self::broadcast_params)).
    pub fn finalize<M: Module>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), CommError> {
        if !self.replicas_checked.load(Ordering::Relaxed) {
            check_replicas(model, &self.dp_cp, &self.expert_dp, &self.tp, &self.world)?;
            self.replicas_checked.store(true, Ordering::Relaxed);
        }
        let (tp, embedding, config) = (
            &self.tp,
            self.embedding.as_ref(),
            &self.config.data_parallel,
        );
        let (dp, expert_dp) = (&self.dp_cp, &self.expert_dp);
        let dense = if self.config.overlap_grad_reduce {
            DpReduction::Overlapped(&self.reducers)
        } else if self.config.use_distributed_optimizer {
            DpReduction::ReduceScatter(dp, &self.plans)
        } else {
            DpReduction::AllReduce(dp)
        };
        // The experts' reduction never overlaps backward.
        let experts = match self.config.use_distributed_optimizer {
            true => DpReduction::ReduceScatter(expert_dp, &self.expert_plans),
            false => DpReduction::AllReduce(expert_dp),
        };
        finalize_model_grads(model, grads, dense, tp, embedding, config)?;
        // Expert parameters are reduced over their own replicas: none of the dense
        // reductions touches them.
        finalize_expert_grads(model, grads, experts, self.dp_cp_size, config)
    }

    /// Saves iteration `iteration` under `root`, collectively over the world: every rank
    /// calls it. One rank clears an interrupted save of it, the ranks that hold state write
    /// (data-parallel rank 0, or every rank with the distributed optimizer), and once all
    /// have, one rank commits it as the newest. After each phase the ranks agree whether
    /// any failed, so every rank returns an error if one did and none waits for a peer that
    /// gave up. The waits are bounded by [`CHECKPOINT_BARRIER_TIMEOUT`], not the collective
    /// timeout: a slow disk is not a dead peer.
    pub fn save<C: Module + Clone>(
        &self,
        root: &Path,
        iteration: usize,
        chunks: &Vec<C>,
        optimizer: &MegatronOptimizer<Vec<C>>,
        extra: serde_json::Value,
    ) -> Result<(), CheckpointError> {
        let leader = self.world.group().rank() == 0;
        let share = self.checkpoint_rank().share;
        let writes = share.dense || share.experts;
        self.phase(
            "clearing",
            leader.then(|| begin_checkpoint(root, iteration)),
        )?;
        let rank = self.checkpoint_rank();
        let saved =
            writes.then(|| save_checkpoint(root, iteration, &rank, chunks, optimizer, extra));
        self.phase("writing", saved)?;
        self.phase(
            "committing",
            leader.then(|| commit_checkpoint(root, iteration)),
        )
    }

    /// Waits for every rank to finish a phase of a save (`mine`: this rank's part, if it had
    /// one) and agrees whether any failed.
    fn phase(
        &self,
        what: &str,
        mine: Option<Result<(), CheckpointError>>,
    ) -> Result<(), CheckpointError> {
        let mine = mine.unwrap_or(Ok(()));
        let collective = |e: CommError| CheckpointError::Comm(e);
        self.world
            .barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT)
            .map_err(collective)?;
        let failed = self.world.any_rank(mine.is_err()).map_err(collective)?;
        mine?;
        if failed {
            return Err(CheckpointError::Peer(format!(
                "another rank failed while {what} the checkpoint (see its error)"
            )));
        }
        Ok(())
    }

    /// Loads a checkpoint under `root` into the freshly built `chunks`, whatever layout
    /// saved it, then rebuilds the plans and reducers for the loaded parameters. Collective:
    /// every rank calls it. `step` picks the iteration (Megatron's `--ckpt-step`, no
    /// fallback); without it rank 0 picks the newest one that verifies, passing over (and
    /// reporting in [`Restored::skipped`]) newer ones that do not, and every rank loads that
    /// one. `make_optimizer` builds the optimizer for the loaded model (with
    /// [`ParallelTraining::optimizer`]); with `load_optimizer` its state is restored too.
    pub fn load<C: Module + Clone>(
        &mut self,
        root: &Path,
        step: Option<usize>,
        chunks: Vec<C>,
        make_optimizer: impl FnOnce(
            &ParallelTraining,
            &Vec<C>,
        ) -> Result<MegatronOptimizer<Vec<C>>, OptimizerError>,
        load_optimizer: bool,
    ) -> Result<Restored<Vec<C>>, CheckpointError> {
        let (iteration, skipped) = match step {
            Some(step) => (step, Vec::new()),
            None => self.agree_on_checkpoint(root)?,
        };
        let this = &*self;
        let mut restored = load_checkpoint(
            root,
            iteration,
            &this.checkpoint_rank(),
            chunks,
            |m| make_optimizer(this, m),
            load_optimizer,
        )?;
        restored.skipped = skipped;
        self.attach(&restored.model);
        Ok(restored)
    }

    /// The newest checkpoint under `root` that verifies, as rank 0 finds it, on every rank.
    fn agree_on_checkpoint(
        &self,
        root: &Path,
    ) -> Result<(usize, Vec<(usize, String)>), CheckpointError> {
        let leader = self.world.group().rank() == 0;
        let mut chosen = Err(CheckpointError::Peer(
            "rank 0 found no checkpoint to load (see its error)".into(),
        ));
        if leader {
            chosen = match latest_loadable_checkpoint(root) {
                Ok(Some(found)) => Ok((
                    found.iteration,
                    found
                        .skipped
                        .into_iter()
                        .map(|(i, e)| (i, e.to_string()))
                        .collect(),
                )),
                Ok(None) => Err(CheckpointError::Io {
                    path: root.display().to_string(),
                    message: "no checkpoint to load".into(),
                }),
                Err(e) => Err(e),
            };
        }
        // Rank 0 reads every file of the candidates: the others wait for it as for a save.
        self.world
            .barrier_with_timeout(CHECKPOINT_BARRIER_TIMEOUT)?;
        let found = chosen
            .as_ref()
            .ok()
            .and_then(|(i, _)| i64::try_from(*i).ok())
            .unwrap_or(-1);
        let mut buf = Buffer::I64(vec![found]);
        self.world.broadcast(&mut buf, 0)?;
        let agreed = match buf {
            Buffer::I64(v) => usize::try_from(v[0]).ok(),
            _ => None,
        };
        match (agreed, chosen) {
            (Some(iteration), Ok((_, skipped))) => Ok((iteration, skipped)),
            (Some(iteration), Err(_)) => Ok((iteration, Vec::new())),
            (None, Err(e)) => Err(e),
            (None, Ok((i, _))) => Err(CheckpointError::Mismatch(format!(
                "iteration {i} does not fit the broadcast"
            ))),
        }
    }
}

#[cfg(test)]
mod tests;
