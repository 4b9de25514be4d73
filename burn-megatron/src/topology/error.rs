//! The error type shared by everything in [`crate::topology`].

use thiserror::Error;

/// Everything that can go wrong while laying out ranks into parallel groups.
///
/// Every variant carries the numbers involved, so its message says exactly what to fix.
///
/// ```
/// use burn_megatron::topology::ParallelConfig;
///
/// let err = ParallelConfig::new(6, 4, 1).validate().unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "world size 6 is not divisible by tensor (4) × pipeline (1) × context (1) = 4"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TopologyError {
    /// A size (world, a parallel dimension, or the virtual pipeline size) is zero.
    #[error("{what} size must be at least 1, got 0")]
    ZeroSize {
        /// Which size was zero, e.g. `"tensor model parallel (tp)"`.
        what: &'static str,
    },

    /// The product of the parallel sizes does not fit in a `usize`.
    #[error("the product of the parallel sizes overflows: {sizes}")]
    SizeOverflow {
        /// The sizes involved, written out as `name = size` pairs.
        sizes: String,
    },

    /// A `-`-separated token string names something other than `tp`, `cp`, `ep`, `dp` or `pp`.
    #[error("unknown parallelism token \"{token}\" in \"{input}\" (expected tp, cp, ep, dp or pp)")]
    UnknownToken {
        /// The offending token.
        token: String,
        /// The whole string it appeared in.
        input: String,
    },

    /// A token appears twice in an order string or in a requested group token.
    #[error("parallelism token \"{token}\" appears more than once in \"{input}\"")]
    DuplicateToken {
        /// The repeated token.
        token: String,
        /// The whole string it appeared in.
        input: String,
    },

    /// A dimension larger than 1 is missing from the order string.
    #[error("\"{token}\" has size {size} but is missing from the order \"{order}\"")]
    MissingFromOrder {
        /// The missing token.
        token: &'static str,
        /// Its size (always greater than 1).
        size: usize,
        /// The order string as given.
        order: String,
    },

    /// A global rank is not smaller than the world size.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The offending rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },

    /// A coordinate is not smaller than the size of its dimension.
    #[error("{token} coordinate {index} is out of range for {token} size {size}")]
    CoordinateOutOfRange {
        /// The dimension's token.
        token: &'static str,
        /// The offending coordinate.
        index: usize,
        /// The dimension's size.
        size: usize,
    },

    /// The world size is not a multiple of tensor × pipeline × context parallel sizes.
    #[error(
        "world size {world_size} is not divisible by tensor ({tp}) × pipeline ({pp}) × context ({cp}) = {product}"
    )]
    WorldSizeNotDivisible {
        /// The world size.
        world_size: usize,
        /// Tensor model parallel size.
        tp: usize,
        /// Pipeline model parallel size.
        pp: usize,
        /// Context parallel size.
        cp: usize,
        /// `tp * pp * cp`.
        product: usize,
    },

    /// The world size is not a multiple of expert tensor × expert × pipeline parallel sizes.
    #[error(
        "world size {world_size} is not divisible by expert tensor ({etp}) × expert ({ep}) × pipeline ({pp}) = {product}"
    )]
    ExpertWorldSizeNotDivisible {
        /// The world size.
        world_size: usize,
        /// Expert tensor parallel size.
        etp: usize,
        /// Expert model parallel size.
        ep: usize,
        /// Pipeline model parallel size.
        pp: usize,
        /// `etp * ep * pp`.
        product: usize,
    },

    /// Pipeline parallelism is used but `pp` is not the last token of the order.
    #[error(
        "pipeline parallelism (pp = {pp}) requires \"pp\" to be the last token of the order, got \"{order}\""
    )]
    PipelineNotLast {
        /// Pipeline model parallel size (greater than 1).
        pp: usize,
        /// The order string as given.
        order: String,
    },

    /// A virtual pipeline size is set while pipeline parallelism is off.
    #[error(
        "virtual pipeline size {virtual_size} requires pipeline parallelism (pp > 1), got pp = {pp}"
    )]
    VirtualPipelineWithoutPipeline {
        /// The requested virtual pipeline size.
        virtual_size: usize,
        /// Pipeline model parallel size (1).
        pp: usize,
    },

    /// The layers do not split evenly over the `P·V` virtual pipeline stages.
    #[error(
        "{num_layers} layers do not split evenly over {pipeline_size} pipeline stages × {num_model_chunks} model chunks = {} virtual stages",
        pipeline_size * num_model_chunks
    )]
    LayersNotDivisible {
        /// Transformer layers in the whole model.
        num_layers: usize,
        /// P.
        pipeline_size: usize,
        /// V.
        num_model_chunks: usize,
    },

    /// A `--pipeline-model-parallel-layout` that does not parse, or names what is not built.
    #[error("--pipeline-model-parallel-layout {layout:?}: {reason}")]
    InvalidPipelineLayout {
        /// The layout as written.
        layout: String,
        /// What is wrong.
        reason: String,
    },

    /// A [`LayerSplit`](super::LayerSplit) that cannot place the layers.
    #[error("pipeline layer split: {reason}")]
    InvalidLayerSplit {
        /// What does not fit.
        reason: String,
    },

    /// A pipeline position outside its pipeline.
    #[error(
        "pipeline rank {pipeline_rank} of {pipeline_size}, model chunk {chunk} of {num_model_chunks}: out of range"
    )]
    PositionOutOfRange {
        /// The stage.
        pipeline_rank: usize,
        /// P.
        pipeline_size: usize,
        /// The chunk.
        chunk: usize,
        /// V.
        num_model_chunks: usize,
    },

    /// Expert tensor parallelism that does not split the experts over the tensor-parallel
    /// groups: a size other than 1 or `tp`, or an order under which the two differ.
    #[error(
        "expert tensor parallel size {etp} is not supported with tensor parallel size {tp}{}: \
         use 1 or the tensor parallel size, with an order whose tp groups are the experts' \
         (cp after tp)",
        order.as_ref().map(|o| format!(" and order \"{o}\"")).unwrap_or_default()
    )]
    ExpertTensorParallelNotTp {
        /// Expert tensor parallel size.
        etp: usize,
        /// Tensor parallel size.
        tp: usize,
        /// The order, when it is what makes the groups differ.
        order: Option<String>,
    },
}
