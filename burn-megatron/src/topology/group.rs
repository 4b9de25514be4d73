//! The kinds of process groups a Megatron-style job needs, and how to list them.

use std::fmt;

use super::{TopologyError, ValidatedConfig};

/// A kind of process group.
///
/// ```
/// use burn_megatron::topology::{GroupKind, ParallelConfig};
///
/// let config = ParallelConfig::new(8, 2, 2).validate().unwrap();
/// assert_eq!(GroupKind::ModelParallel.name(), "mp");
/// assert_eq!(
///     config.all_groups(GroupKind::ModelParallel),
///     vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    /// Ranks that split the same layers' weights (`tp`).
    TensorModelParallel,
    /// The stages of one pipeline (`pp`).
    PipelineModelParallel,
    /// Replicas that all-reduce gradients, excluding context parallelism (`dp`).
    DataParallel,
    /// Data parallel replicas including context parallel ranks (`dp-cp`).
    DataParallelWithCp,
    /// One full copy of the model: tensor × pipeline ranks (`tp-pp`).
    ModelParallel,
    /// Tensor × data parallel ranks of one pipeline stage (`tp-dp`).
    TensorAndDataParallel,
    /// First and last pipeline stage, which share the word embeddings.
    Embedding,
    /// First pipeline stage only, which holds position embeddings.
    PositionEmbedding,
    /// Ranks that split one sequence (`cp`).
    ContextParallel,
    /// Ranks that split the experts of each MoE layer (`ep`, of the experts' generator):
    /// the group tokens are exchanged over.
    ExpertModelParallel,
    /// Ranks that split each expert's weights (`etp`).
    ExpertTensorParallel,
    /// Expert tensor × expert parallel ranks (`etp-ep`).
    ExpertTensorAndModelParallel,
    /// Expert tensor × expert × pipeline ranks (`etp-ep-pp`): what the gradient norm of
    /// expert parameters is summed over, as the dense ones' over `mp`.
    ExpertTensorModelPipelineParallel,
    /// Replicas of the same experts, which reduce their gradients (`edp`).
    ExpertDataParallel,
}

impl GroupKind {
    /// Every kind, in declaration order.
    pub const ALL: [GroupKind; 14] = [
        GroupKind::TensorModelParallel,
        GroupKind::PipelineModelParallel,
        GroupKind::DataParallel,
        GroupKind::DataParallelWithCp,
        GroupKind::ModelParallel,
        GroupKind::TensorAndDataParallel,
        GroupKind::Embedding,
        GroupKind::PositionEmbedding,
        GroupKind::ContextParallel,
        GroupKind::ExpertModelParallel,
        GroupKind::ExpertTensorParallel,
        GroupKind::ExpertTensorAndModelParallel,
        GroupKind::ExpertTensorModelPipelineParallel,
        GroupKind::ExpertDataParallel,
    ];

    /// Short name: `"tp"`, `"pp"`, `"dp"`, `"dp-cp"`, `"mp"`, `"tp-dp"`, `"embd"`,
    /// `"pos-embd"`, `"cp"`, `"ep"`, `"etp"`, `"etp-ep"`, `"etp-ep-pp"` or `"edp"`.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::TensorModelParallel => "tp",
            GroupKind::PipelineModelParallel => "pp",
            GroupKind::DataParallel => "dp",
            GroupKind::DataParallelWithCp => "dp-cp",
            GroupKind::ModelParallel => "mp",
            GroupKind::TensorAndDataParallel => "tp-dp",
            GroupKind::Embedding => "embd",
            GroupKind::PositionEmbedding => "pos-embd",
            GroupKind::ContextParallel => "cp",
            GroupKind::ExpertModelParallel => "ep",
            GroupKind::ExpertTensorParallel => "etp",
            GroupKind::ExpertTensorAndModelParallel => "etp-ep",
            GroupKind::ExpertTensorModelPipelineParallel => "etp-ep-pp",
            GroupKind::ExpertDataParallel => "edp",
        }
    }

    /// Whether the experts' rank generator lays this kind out.
    pub fn is_expert(self) -> bool {
        matches!(
            self,
            GroupKind::ExpertModelParallel
                | GroupKind::ExpertTensorParallel
                | GroupKind::ExpertTensorAndModelParallel
                | GroupKind::ExpertTensorModelPipelineParallel
                | GroupKind::ExpertDataParallel
        )
    }

    /// The rank-generator token whose groups this kind is (or is derived from).
    fn generator_token(self) -> &'static str {
        match self {
            GroupKind::TensorModelParallel => "tp",
            GroupKind::PipelineModelParallel
            | GroupKind::Embedding
            | GroupKind::PositionEmbedding => "pp",
            GroupKind::DataParallel => "dp",
            GroupKind::DataParallelWithCp => "dp-cp",
            GroupKind::ModelParallel => "tp-pp",
            GroupKind::TensorAndDataParallel => "tp-dp",
            GroupKind::ContextParallel => "cp",
            GroupKind::ExpertModelParallel => "ep",
            GroupKind::ExpertTensorParallel => "tp",
            GroupKind::ExpertTensorAndModelParallel => "tp-ep",
            GroupKind::ExpertTensorModelPipelineParallel => "tp-ep-pp",
            GroupKind::ExpertDataParallel => "dp",
        }
    }

    /// Narrows a pipeline group to this kind (identity for non-embedding kinds).
    fn narrow(self, mut group: Vec<usize>) -> Vec<usize> {
        match self {
            GroupKind::Embedding => {
                let (first, last) = (group[0], group[group.len() - 1]);
                if first == last {
                    vec![first]
                } else {
                    vec![first, last]
                }
            }
            GroupKind::PositionEmbedding => {
                group.truncate(1);
                group
            }
            _ => group,
        }
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl ValidatedConfig {
    /// Every group of `kind` in the whole world, each as ascending global ranks, in
    /// Megatron-Core's enumeration order. Together the groups of any kind other than
    /// the embedding kinds partition the world.
    ///
    /// Embedding groups are `[first, last]` of each pipeline group (`[first]` when
    /// pp = 1); position embedding groups are `[first]`.
    pub fn all_groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        self.generator_of(kind)
            .get_ranks(kind.generator_token())
            .expect("group kinds use valid generator tokens")
            .into_iter()
            .map(|group| kind.narrow(group))
            .collect()
    }

    /// The group of `kind` associated with `rank`, as ascending global ranks.
    ///
    /// For the embedding kinds this is the group derived from `rank`'s pipeline group,
    /// which does not contain `rank` when it is a middle stage.
    ///
    /// # Errors
    ///
    /// [`TopologyError::RankOutOfRange`] when `rank >= world_size()`.
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Result<Vec<usize>, TopologyError> {
        let group = self
            .generator_of(kind)
            .group_of(kind.generator_token(), rank)?;
        Ok(kind.narrow(group))
    }

    fn generator_of(&self, kind: GroupKind) -> &super::RankGenerator {
        if kind.is_expert() {
            self.expert_rank_generator()
        } else {
            self.rank_generator()
        }
    }
}
