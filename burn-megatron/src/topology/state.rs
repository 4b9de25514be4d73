//! One rank's view of the parallel layout: its coordinates, groups and pipeline peers.

use super::{GroupKind, LayerSplit, ParallelConfig, RankCoords, TopologyError, ValidatedConfig};

/// Everything one global rank needs to know about where it sits in the job.
///
/// Groups are ascending global ranks. A rank's index inside any group it belongs to is
/// [`ParallelState::index_in_group`]; for the tp, pp, dp and cp groups it equals
/// the corresponding `*_rank()` coordinate.
///
/// ```
/// use burn_megatron::topology::{GroupKind, ParallelConfig, ParallelState};
///
/// let config = ParallelConfig::new(8, 2, 2).validate().unwrap();
/// let state = ParallelState::new(&config, 1).unwrap();
/// assert_eq!(state.tensor_model_parallel_group(), &[0, 1]);
/// assert_eq!(state.pipeline_model_parallel_group(), &[1, 5]);
/// assert_eq!(state.data_parallel_group(), &[1, 3]);
/// assert_eq!(state.embedding_group(), &[1, 5]);
/// assert!(state.is_pipeline_first_stage());
/// assert_eq!(state.pipeline_next_rank(), 5);
/// assert_eq!(state.index_in_group(GroupKind::TensorModelParallel), Some(1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelState {
    config: ValidatedConfig,
    global_rank: usize,
    coords: RankCoords,
    /// This rank's group of each kind, indexed by `GroupKind as usize`.
    groups: Vec<Vec<usize>>,
}

impl ParallelState {
    /// The state of `global_rank` under `config`.
    ///
    /// # Errors
    ///
    /// [`TopologyError::RankOutOfRange`] when `global_rank >= world_size`.
    pub fn new(
        config: &ValidatedConfig,
        global_rank: usize,
    ) -> Result<ParallelState, TopologyError> {
        let coords = config.rank_generator().coords(global_rank)?;
        let groups = GroupKind::ALL
            .into_iter()
            .map(|kind| config.group_of(kind, global_rank))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ParallelState {
            config: config.clone(),
            global_rank,
            coords,
            groups,
        })
    }

    /// The validated configuration this state was built from.
    pub fn config(&self) -> &ValidatedConfig {
        &self.config
    }

    /// This rank's global rank.
    pub fn global_rank(&self) -> usize {
        self.global_rank
    }

    /// Total number of ranks.
    pub fn world_size(&self) -> usize {
        self.config.world_size()
    }

    /// This rank's index along every parallel dimension.
    pub fn coords(&self) -> RankCoords {
        self.coords
    }

    /// Index inside the tensor model parallel group.
    pub fn tensor_model_parallel_rank(&self) -> usize {
        self.coords.tp
    }

    /// Tensor model parallel size.
    pub fn tensor_model_parallel_size(&self) -> usize {
        self.config.tensor_model_parallel_size()
    }

    /// Pipeline stage of this rank (index inside its pipeline group).
    pub fn pipeline_model_parallel_rank(&self) -> usize {
        self.coords.pp
    }

    /// Number of pipeline stages.
    pub fn pipeline_model_parallel_size(&self) -> usize {
        self.config.pipeline_model_parallel_size()
    }

    /// Virtual pipeline size (model chunks per stage), if interleaving.
    pub fn virtual_pipeline_model_parallel_size(&self) -> Option<usize> {
        self.config.virtual_pipeline_model_parallel_size()
    }

    /// How the layers split over the virtual pipeline stages.
    pub fn layer_split(&self) -> LayerSplit {
        self.config.layer_split()
    }

    /// Index inside the data parallel group (excluding context parallelism).
    pub fn data_parallel_rank(&self) -> usize {
        self.coords.dp
    }

    /// Index inside the data parallel group that includes context parallel ranks.
    pub fn data_parallel_rank_with_cp(&self) -> usize {
        self.index_in_group(GroupKind::DataParallelWithCp)
            .expect("a rank always belongs to its own dp-cp group")
    }

    /// Data parallel size.
    pub fn data_parallel_size(&self) -> usize {
        self.config.data_parallel_size()
    }

    /// Index inside the context parallel group.
    pub fn context_parallel_rank(&self) -> usize {
        self.coords.cp
    }

    /// Context parallel size.
    pub fn context_parallel_size(&self) -> usize {
        self.config.context_parallel_size()
    }

    /// Expert model parallel size.
    pub fn expert_model_parallel_size(&self) -> usize {
        self.config.expert_model_parallel_size()
    }

    /// Index inside the expert model parallel group: which share of each MoE layer's
    /// experts this rank holds.
    pub fn expert_model_parallel_rank(&self) -> usize {
        self.index_in_group(GroupKind::ExpertModelParallel)
            .expect("a rank always belongs to its own ep group")
    }

    /// This rank's group of `kind`, as ascending global ranks.
    ///
    /// For [`GroupKind::Embedding`] and [`GroupKind::PositionEmbedding`] this is the
    /// group of this rank's pipeline, which a middle stage is not a member of; check
    /// [`ParallelState::index_in_group`] before joining it.
    pub fn group(&self, kind: GroupKind) -> &[usize] {
        &self.groups[kind as usize]
    }

    /// This rank's position inside its group of `kind`, or `None` if it is not a member
    /// (only possible for the embedding kinds).
    pub fn index_in_group(&self, kind: GroupKind) -> Option<usize> {
        self.group(kind).binary_search(&self.global_rank).ok()
    }

    /// Every group of `kind` in the whole world; see [`ValidatedConfig::all_groups`].
    pub fn all_groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        self.config.all_groups(kind)
    }

    /// Ranks that split the same layers' weights (`tp`).
    pub fn tensor_model_parallel_group(&self) -> &[usize] {
        self.group(GroupKind::TensorModelParallel)
    }

    /// The stages of this rank's pipeline, first stage first (`pp`).
    pub fn pipeline_model_parallel_group(&self) -> &[usize] {
        self.group(GroupKind::PipelineModelParallel)
    }

    /// Data parallel replicas of this rank (`dp`).
    pub fn data_parallel_group(&self) -> &[usize] {
        self.group(GroupKind::DataParallel)
    }

    /// Data parallel replicas including context parallel ranks (`dp-cp`).
    pub fn data_parallel_group_with_cp(&self) -> &[usize] {
        self.group(GroupKind::DataParallelWithCp)
    }

    /// The ranks holding one full copy of the model with this rank (`tp-pp`).
    pub fn model_parallel_group(&self) -> &[usize] {
        self.group(GroupKind::ModelParallel)
    }

    /// Tensor × data parallel ranks of this pipeline stage (`tp-dp`).
    pub fn tensor_and_data_parallel_group(&self) -> &[usize] {
        self.group(GroupKind::TensorAndDataParallel)
    }

    /// First and last stage of this rank's pipeline (just one rank when pp = 1).
    pub fn embedding_group(&self) -> &[usize] {
        self.group(GroupKind::Embedding)
    }

    /// First stage of this rank's pipeline.
    pub fn position_embedding_group(&self) -> &[usize] {
        self.group(GroupKind::PositionEmbedding)
    }

    /// Whether this rank is in its embedding group (first or last stage).
    pub fn is_rank_in_embedding_group(&self) -> bool {
        self.index_in_group(GroupKind::Embedding).is_some()
    }

    /// Whether this rank is in its position embedding group (first stage).
    pub fn is_rank_in_position_embedding_group(&self) -> bool {
        self.index_in_group(GroupKind::PositionEmbedding).is_some()
    }

    /// Whether this rank is the first pipeline stage (virtual chunks are not considered).
    pub fn is_pipeline_first_stage(&self) -> bool {
        self.coords.pp == 0
    }

    /// Whether this rank is the last pipeline stage (virtual chunks are not considered).
    pub fn is_pipeline_last_stage(&self) -> bool {
        self.coords.pp + 1 == self.pipeline_model_parallel_size()
    }

    /// Global rank of the first stage of this rank's pipeline.
    pub fn pipeline_first_rank(&self) -> usize {
        self.pipeline_model_parallel_group()[0]
    }

    /// Global rank of the last stage of this rank's pipeline.
    pub fn pipeline_last_rank(&self) -> usize {
        let group = self.pipeline_model_parallel_group();
        group[group.len() - 1]
    }

    /// Global rank of the next pipeline stage; the last stage wraps around to the first.
    pub fn pipeline_next_rank(&self) -> usize {
        let group = self.pipeline_model_parallel_group();
        group[(self.coords.pp + 1) % group.len()]
    }

    /// Global rank of the previous pipeline stage; the first stage wraps around to the last.
    pub fn pipeline_prev_rank(&self) -> usize {
        let group = self.pipeline_model_parallel_group();
        group[(self.coords.pp + group.len() - 1) % group.len()]
    }
}

impl ParallelConfig {
    /// Validates this configuration and builds the state of `global_rank` in one step.
    ///
    /// # Errors
    ///
    /// Any [`ParallelConfig::validate`] error, or `global_rank >= world_size`.
    pub fn state_for_rank(self, global_rank: usize) -> Result<ParallelState, TopologyError> {
        ParallelState::new(&self.validate()?, global_rank)
    }
}
