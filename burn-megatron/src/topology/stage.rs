//! Where one model chunk sits in a pipeline, and which layers it holds.

use super::{LayerSplit, ParallelState, TopologyError};
use std::ops::Range;

/// Model chunk `chunk` (of `num_model_chunks` per stage) on pipeline stage `pipeline_rank`
/// (of `pipeline_size`): virtual stage `chunk·P + pipeline_rank` of `P·V`, and how the
/// model's layers split over those stages (evenly unless `split` says otherwise).
///
/// ```
/// use burn_megatron::topology::PipelinePosition;
/// // 8 layers, 2 stages, 2 chunks: rank 1 holds layers 2..4 (chunk 0) and 6..8 (chunk 1).
/// let p = PipelinePosition::new(2, 1, 2, 1);
/// assert_eq!(p.layer_range(8).unwrap(), 6..8);
/// assert!(p.is_last_stage() && !p.is_first_stage());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PipelinePosition {
    /// P.
    pub pipeline_size: usize,
    /// This stage, `0..P`.
    pub pipeline_rank: usize,
    /// V.
    pub num_model_chunks: usize,
    /// This chunk, `0..V`.
    pub chunk: usize,
    /// How the layers split over the virtual stages.
    pub split: LayerSplit,
}

impl PipelinePosition {
    /// Chunk `chunk` of `num_model_chunks` on stage `pipeline_rank` of `pipeline_size`,
    /// the layers split evenly.
    pub fn new(
        pipeline_size: usize,
        pipeline_rank: usize,
        num_model_chunks: usize,
        chunk: usize,
    ) -> Self {
        Self {
            pipeline_size,
            pipeline_rank,
            num_model_chunks,
            chunk,
            split: LayerSplit::default(),
        }
    }

    /// The same position under another split of the layers.
    #[must_use]
    pub fn with_split(mut self, split: LayerSplit) -> Self {
        self.split = split;
        self
    }

    /// The whole model on one stage.
    pub fn whole() -> Self {
        Self::new(1, 0, 1, 0)
    }

    /// Chunk `chunk` of `state`'s pipeline stage (V from its virtual pipeline size), under
    /// its layout's [`LayerSplit`].
    pub fn of(state: &ParallelState, chunk: usize) -> Self {
        Self::new(
            state.pipeline_model_parallel_size(),
            state.pipeline_model_parallel_rank(),
            state.virtual_pipeline_model_parallel_size().unwrap_or(1),
            chunk,
        )
        .with_split(state.layer_split())
    }

    /// `chunk·P + pipeline_rank`: activations go round the ring of stages V times.
    pub fn virtual_stage(&self) -> usize {
        self.chunk * self.pipeline_size + self.pipeline_rank
    }

    /// The first virtual stage (Megatron's `pre_process`: it embeds).
    pub fn is_first_stage(&self) -> bool {
        self.virtual_stage() == 0
    }

    /// The last virtual stage (Megatron's `post_process`: it computes the loss).
    pub fn is_last_stage(&self) -> bool {
        self.virtual_stage() + 1 == self.pipeline_size * self.num_model_chunks
    }

    /// The global indices of this chunk's layers out of `num_layers`, under its
    /// [`LayerSplit`]; split evenly, `L/(P·V)` of them from Megatron's offset
    /// `chunk·L/V + pipeline_rank·L/(P·V)`.
    ///
    /// # Errors
    ///
    /// Layers the split cannot place ([`LayerSplit::layers_per_virtual_stage`]), or a
    /// position outside its pipeline.
    pub fn layer_range(&self, num_layers: usize) -> Result<Range<usize>, TopologyError> {
        self.split.layer_range(num_layers, self)
    }
}

/// Layers per model chunk when `num_layers` split evenly over `P·V` virtual stages (the
/// default [`LayerSplit`]; an uneven split's chunks differ: use
/// [`LayerSplit::layers_per_virtual_stage`]). The schedule tests' shorthand: code places a
/// chunk's layers with [`PipelinePosition::layer_range`].
#[cfg(test)]
pub(crate) fn layers_per_chunk(
    num_layers: usize,
    pipeline_size: usize,
    num_model_chunks: usize,
) -> Result<usize, TopologyError> {
    let stages = pipeline_size * num_model_chunks;
    if stages == 0 || num_layers == 0 || !num_layers.is_multiple_of(stages) {
        return Err(TopologyError::LayersNotDivisible {
            num_layers,
            pipeline_size,
            num_model_chunks,
        });
    }
    Ok(num_layers / stages)
}

/// Index of the first layer of `chunk` on `pipeline_rank` under an even split (the schedule
/// tests' shorthand for [`PipelinePosition::layer_range`], which follows the position's
/// [`LayerSplit`]).
#[cfg(test)]
pub(crate) fn layer_offset(
    num_layers: usize,
    pipeline_size: usize,
    num_model_chunks: usize,
    pipeline_rank: usize,
    chunk: usize,
) -> Result<usize, TopologyError> {
    PipelinePosition::new(pipeline_size, pipeline_rank, num_model_chunks, chunk)
        .layer_range(num_layers)
        .map(|r| r.start)
}
