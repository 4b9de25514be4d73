//! What each rank is handed.

use crate::comm::{Comm, CommError, World};
use crate::moe::ExpertGroups;
use crate::pipeline::{P2pCommunicator, P2pShapes};
use crate::topology::{GroupKind, ParallelState};
use burn::tensor::Device;
use std::sync::Arc;

/// A communicator on each group this rank belongs to.
#[derive(Debug, Clone)]
pub struct RankGroups {
    /// Tensor-model-parallel group.
    pub tp: Comm,
    /// Pipeline-model-parallel group (also the channel of activations between stages).
    pub pp: Comm,
    /// The pipeline group again, as a separate channel for gradients between stages.
    pub pp_backward: Comm,
    /// Data-parallel group.
    pub dp: Comm,
    /// Data-parallel group including context-parallel ranks.
    pub dp_cp: Comm,
    /// Context-parallel group: the ranks that split one sequence.
    pub cp: Comm,
    /// Model-parallel group (tensor × pipeline).
    pub mp: Comm,
    /// Tensor × data parallel group.
    pub tp_dp: Comm,
    /// Expert model parallel group: the ranks each MoE layer's experts are split over, which
    /// exchange tokens.
    pub ep: Comm,
    /// Expert tensor-parallel group: the ranks that split each expert's weights (the
    /// tensor-parallel group's ranks when `--expert-tensor-parallel-size` is above 1, else
    /// this rank alone).
    pub expert_tp: Comm,
    /// Expert data parallel group: the replicas of this rank's experts, which reduce their
    /// gradients (the dense parameters' are reduced over [`RankGroups::dp_cp`]).
    pub expert_dp: Comm,
    /// Expert tensor × expert × pipeline group: the expert parameters' share of the
    /// gradient norm is summed over it.
    pub expert_mp: Comm,
    /// Embedding group (first and last stage); `None` on middle stages.
    pub embedding: Option<Comm>,
    /// Position-embedding group (first stage); `None` on other stages.
    pub position_embedding: Option<Comm>,
    /// Every rank of the world.
    pub world: Comm,
}

impl RankGroups {
    /// The groups this rank's MoE layers split their experts over: [`RankGroups::ep`] and
    /// [`RankGroups::expert_tp`].
    pub fn experts(&self) -> ExpertGroups {
        ExpertGroups {
            ep: self.ep.clone(),
            etp: self.expert_tp.clone(),
        }
    }
}

/// Everything one rank needs: its coordinates and groups, its communicators, its device.
#[derive(Debug, Clone)]
pub struct RankContext {
    /// This rank's place in the layout.
    pub state: ParallelState,
    /// Communicators on this rank's groups.
    pub groups: RankGroups,
    /// This rank's own device (autodiff-enabled by default).
    pub device: Device,
    /// The world (threads of this process, or processes), for creating further groups.
    pub world: Arc<dyn World>,
}

impl RankContext {
    /// One communicator per model chunk over this rank's data-parallel group (with its
    /// context-parallel ranks: gradients are reduced over both), each a
    /// channel of its own (same ranks, separate traffic): what overlapped reducers need,
    /// as their workers issue collectives while the caller may issue its own on
    /// [`RankGroups::dp`], and the reducers of several chunks run at the same time.
    ///
    /// Collective over the data-parallel group; call it once per rank.
    pub fn chunk_data_parallel_groups(&self, chunks: usize) -> Result<Vec<Comm>, CommError> {
        (0..chunks)
            .map(|c| {
                self.world.new_group(
                    &format!("dp-grad-chunk-{c}"),
                    self.state.group(GroupKind::DataParallelWithCp).to_vec(),
                    self.state.global_rank(),
                )
            })
            .collect()
    }

    /// This rank's pipeline channels ([`RankGroups::pp`] forward, [`RankGroups::pp_backward`]
    /// backward), receiving onto this rank's device.
    pub fn p2p(&self, shapes: P2pShapes) -> P2pCommunicator {
        P2pCommunicator::new(
            self.groups.pp.clone(),
            self.groups.pp_backward.clone(),
            shapes,
            self.device.clone(),
        )
    }

    /// Creates the communicators of `state`'s groups on `world` (collectively: every rank
    /// of the world calls this).
    pub fn new(
        state: ParallelState,
        world: Arc<dyn World>,
        device: Device,
    ) -> Result<Self, CommError> {
        let rank = state.global_rank();
        let comm = |kind: GroupKind| world.new_group(kind.name(), state.group(kind).to_vec(), rank);
        let member = |kind: GroupKind| state.index_in_group(kind).is_some();
        let groups = RankGroups {
            tp: comm(GroupKind::TensorModelParallel)?,
            pp: comm(GroupKind::PipelineModelParallel)?,
            pp_backward: world.new_group(
                "pp-backward",
                state.pipeline_model_parallel_group().to_vec(),
                rank,
            )?,
            dp: comm(GroupKind::DataParallel)?,
            dp_cp: comm(GroupKind::DataParallelWithCp)?,
            cp: comm(GroupKind::ContextParallel)?,
            mp: comm(GroupKind::ModelParallel)?,
            tp_dp: comm(GroupKind::TensorAndDataParallel)?,
            ep: comm(GroupKind::ExpertModelParallel)?,
            expert_tp: comm(GroupKind::ExpertTensorParallel)?,
            expert_dp: comm(GroupKind::ExpertDataParallel)?,
            expert_mp: comm(GroupKind::ExpertTensorModelPipelineParallel)?,
            embedding: member(GroupKind::Embedding)
                .then(|| comm(GroupKind::Embedding))
                .transpose()?,
            position_embedding: member(GroupKind::PositionEmbedding)
                .then(|| comm(GroupKind::PositionEmbedding))
                .transpose()?,
            world: world.new_group("world", (0..world.size()).collect(), rank)?,
        };
        Ok(Self {
            state,
            groups,
            device,
            world,
        })
    }
}
