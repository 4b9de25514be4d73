//! How a model's layers split over the pipeline's virtual stages: evenly, or as
//! Megatron-Core's uneven split sets them.

use super::{PipelineLayout, PipelinePosition, TopologyError};
use std::ops::Range;

/// How the transformer layers split over the `P·V` virtual pipeline stages, with
/// Megatron-Core's settings of the same names. The default splits them evenly.
///
/// - `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`
///   (`--decoder-first-pipeline-num-layers`, `--decoder-last-pipeline-num-layers`): the
///   first or last pipeline rank holds that many layers, and the other ranks split the rest
///   evenly. The first stage also embeds and the last computes the loss over the whole
///   vocabulary, so giving them fewer layers balances time and memory.
/// - `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`: the
///   embedding (the loss) counts as one layer of the even split, so the first (last)
///   virtual stage holds one layer fewer; it may hold none.
/// - `pipeline_model_parallel_layout` (`--pipeline-model-parallel-layout`): every virtual
///   stage's layers written out ([`PipelineLayout`]), instead of the four above.
///
/// With a virtual pipeline, each rank's layers split evenly over its `V` chunks, and chunk
/// `c` of rank `r` is virtual stage `c·P + r`: the stages hold consecutive layers in
/// that order.
///
/// ```
/// use burn_megatron::topology::{LayerSplit, PipelinePosition};
/// // 10 layers over 4 stages: 1 on the first, 3 on each of the others.
/// let split = LayerSplit::default().with_first_stage(1);
/// assert_eq!(split.layers_per_virtual_stage(10, 4, 1).unwrap(), vec![1, 3, 3, 3]);
/// let second = PipelinePosition::new(4, 1, 1, 0).with_split(split);
/// assert_eq!(second.layer_range(10).unwrap(), 1..4);
/// // The embedding and the loss counted as layers: 6 layers + 2 over 4 stages.
/// let counted = LayerSplit::default().with_embedding_counted(true).with_loss_counted(true);
/// assert_eq!(counted.layers_per_virtual_stage(6, 4, 1).unwrap(), vec![1, 2, 2, 1]);
/// // The rest must split evenly over the middle stages.
/// assert!(split.layers_per_virtual_stage(9, 4, 1).is_err());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct LayerSplit {
    /// Layers on the first pipeline rank (`None`: as many as a middle rank).
    pub num_layers_in_first_pipeline_stage: Option<usize>,
    /// Layers on the last pipeline rank (`None`: as many as a middle rank).
    pub num_layers_in_last_pipeline_stage: Option<usize>,
    /// The embedding counts as a layer of the even split.
    pub account_for_embedding_in_pipeline_split: bool,
    /// The loss counts as a layer of the even split.
    pub account_for_loss_in_pipeline_split: bool,
    /// Every virtual stage's layers, written out (the four fields above then stay unset).
    pub pipeline_model_parallel_layout: Option<PipelineLayout>,
}

impl LayerSplit {
    /// Sets the first pipeline rank's layers.
    #[must_use]
    pub fn with_first_stage(mut self, layers: usize) -> Self {
        self.num_layers_in_first_pipeline_stage = Some(layers);
        self
    }

    /// Sets the last pipeline rank's layers.
    #[must_use]
    pub fn with_last_stage(mut self, layers: usize) -> Self {
        self.num_layers_in_last_pipeline_stage = Some(layers);
        self
    }

    /// Counts the embedding as a layer of the even split, or not.
    #[must_use]
    pub fn with_embedding_counted(mut self, counted: bool) -> Self {
        self.account_for_embedding_in_pipeline_split = counted;
        self
    }

    /// Counts the loss as a layer of the even split, or not.
    #[must_use]
    pub fn with_loss_counted(mut self, counted: bool) -> Self {
        self.account_for_loss_in_pipeline_split = counted;
        self
    }

    /// Sets every virtual stage's layers.
    #[must_use]
    pub fn with_layout(mut self, layout: PipelineLayout) -> Self {
        self.pipeline_model_parallel_layout = Some(layout);
        self
    }

    /// The ends counted as layers of the even split: 0, 1 or 2 (the embedding, the loss).
    pub fn counted_ends(&self) -> usize {
        usize::from(self.account_for_embedding_in_pipeline_split)
            + usize::from(self.account_for_loss_in_pipeline_split)
    }

    /// Whether the first or last rank's layers are set.
    pub fn is_uneven(&self) -> bool {
        self.num_layers_in_first_pipeline_stage.is_some()
            || self.num_layers_in_last_pipeline_stage.is_some()
    }

    /// The layout's checks that need no layer count: Megatron-Core's conflicts with the
    /// other settings, and its stages against the pipeline's.
    fn check_layout(
        &self,
        layout: &PipelineLayout,
        pipeline_size: usize,
        num_model_chunks: usize,
    ) -> Result<(), TopologyError> {
        let invalid = |reason: String| Err(layout.invalid(reason));
        if self.is_uneven() || self.counted_ends() > 0 {
            return invalid(
                "it sets every stage's layers: the first or last stage's layers and the \
                 embedding or loss counted as a layer cannot be set with it"
                    .into(),
            );
        }
        let stages = layout.num_stages();
        if stages != pipeline_size * num_model_chunks {
            // A virtual pipeline needs pipeline parallelism: at PP 1 no chunk count fits.
            let hint = match pipeline_size > 1 && stages.is_multiple_of(pipeline_size) {
                true => format!(
                    "; a virtual pipeline of {} chunks per stage fits it",
                    stages / pipeline_size
                ),
                false if pipeline_size <= 1 && stages > 1 => {
                    "; its stages need pipeline parallelism".to_string()
                }
                false => String::new(),
            };
            return invalid(format!(
                "it has {stages} stages, and the pipeline {pipeline_size} stages × \
                 {num_model_chunks} model chunks{hint}"
            ));
        }
        Ok(())
    }

    /// The checks that need no layer count, for
    /// [`ParallelConfig::validate`](crate::topology::ParallelConfig::validate):
    /// Megatron-Core's, and pipeline parallelism for an uneven split.
    ///
    /// # Errors
    ///
    /// A first or last rank of 0 layers, or of a count its `num_model_chunks` chunks do not
    /// share evenly; an uneven split with one pipeline stage; an uneven split with the
    /// embedding or the loss counted.
    pub fn check(
        &self,
        pipeline_size: usize,
        num_model_chunks: usize,
    ) -> Result<(), TopologyError> {
        if let Some(layout) = &self.pipeline_model_parallel_layout {
            return self.check_layout(layout, pipeline_size, num_model_chunks);
        }
        let invalid = |reason: String| Err(TopologyError::InvalidLayerSplit { reason });
        if self.is_uneven()
            && (self.account_for_embedding_in_pipeline_split
                || self.account_for_loss_in_pipeline_split)
        {
            return invalid(
                "the first or last pipeline stage's layers cannot be set together with the \
                 embedding or the loss counted as a layer"
                    .into(),
            );
        }
        if self.is_uneven() && pipeline_size < 2 {
            return invalid(format!(
                "the first or last pipeline stage's layers need pipeline parallelism, got \
                 {pipeline_size} stage"
            ));
        }
        for (which, layers) in [
            ("first", self.num_layers_in_first_pipeline_stage),
            ("last", self.num_layers_in_last_pipeline_stage),
        ] {
            match layers {
                Some(0) => {
                    return invalid(format!("the {which} pipeline stage must hold a layer"));
                }
                Some(n) if !n.is_multiple_of(num_model_chunks.max(1)) => {
                    return invalid(format!(
                        "the {which} pipeline stage's {n} layers do not split evenly over its \
                         {num_model_chunks} model chunks"
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Layers each of `pipeline_size` ranks holds over its chunks, from
    /// [`layers_per_virtual_stage`](Self::layers_per_virtual_stage)'s answer: virtual stage
    /// `s` sits on rank `s mod P`.
    ///
    /// ```
    /// use burn_megatron::topology::LayerSplit;
    /// // PP 2 × VP 2, the first stage with 1 layer: chunks 1, 3 | 3, 3.
    /// assert_eq!(LayerSplit::per_rank(&[1, 3, 3, 3], 2), vec![4, 6]);
    /// ```
    pub fn per_rank(layers_per_virtual_stage: &[usize], pipeline_size: usize) -> Vec<usize> {
        let p = pipeline_size.max(1);
        (0..p)
            .map(|rank| layers_per_virtual_stage.iter().skip(rank).step_by(p).sum())
            .collect()
    }

    /// Layers of each virtual stage, in virtual-stage order (`chunk·P + pipeline_rank`),
    /// for a model of `num_layers`; they add up to `num_layers`.
    ///
    /// # Errors
    ///
    /// What [`check`](Self::check) refuses; an even split that does not divide; first and
    /// last stages holding more than the model, or leaving layers without a middle stage to
    /// take them (or middle stages without layers); middle layers that do not split evenly
    /// over the middle stages and their chunks.
    pub fn layers_per_virtual_stage(
        &self,
        num_layers: usize,
        pipeline_size: usize,
        num_model_chunks: usize,
    ) -> Result<Vec<usize>, TopologyError> {
        let (p, v) = (pipeline_size, num_model_chunks);
        if p == 0 || v == 0 || num_layers == 0 {
            return Err(TopologyError::LayersNotDivisible {
                num_layers,
                pipeline_size,
                num_model_chunks,
            });
        }
        if p.checked_mul(v).is_none() || num_layers.checked_add(2).is_none() {
            return Err(TopologyError::InvalidLayerSplit {
                reason: format!("{num_layers} layers over {p} stages × {v} chunks overflow"),
            });
        }
        self.check(p, v)?;
        if let Some(layout) = &self.pipeline_model_parallel_layout {
            if layout.num_layers() != num_layers {
                return Err(layout.invalid(format!(
                    "it holds {} transformer layers, and the model {num_layers}",
                    layout.num_layers()
                )));
            }
            return Ok(layout.layers_per_virtual_stage().to_vec());
        }
        let per_rank = if self.is_uneven() {
            self.uneven_ranks(num_layers, p, v)?
        } else {
            let counted = self.counted_ends();
            let total = num_layers + counted;
            if !total.is_multiple_of(p * v) {
                return Err(if counted == 0 {
                    TopologyError::LayersNotDivisible {
                        num_layers,
                        pipeline_size,
                        num_model_chunks,
                    }
                } else {
                    TopologyError::InvalidLayerSplit {
                        reason: format!(
                            "{num_layers} layers and {counted} counted for the embedding or \
                             the loss do not split evenly over {p} pipeline stages × {v} \
                             model chunks"
                        ),
                    }
                });
            }
            vec![total / p; p]
        };
        let mut counts = vec![0; p * v];
        for (stage, count) in counts.iter_mut().enumerate() {
            *count = per_rank[stage % p] / v;
        }
        // `total` exceeds the layers by exactly the counted ends, so these cannot underflow.
        if self.account_for_embedding_in_pipeline_split {
            counts[0] -= 1;
        }
        if self.account_for_loss_in_pipeline_split {
            counts[p * v - 1] -= 1;
        }
        Ok(counts)
    }

    /// Layers of each pipeline rank under an uneven split.
    fn uneven_ranks(
        &self,
        num_layers: usize,
        p: usize,
        v: usize,
    ) -> Result<Vec<usize>, TopologyError> {
        let (first, last) = (
            self.num_layers_in_first_pipeline_stage,
            self.num_layers_in_last_pipeline_stage,
        );
        let middle_stages = p - usize::from(first.is_some()) - usize::from(last.is_some());
        let invalid = |reason: String| Err(TopologyError::InvalidLayerSplit { reason });
        let ends = first.unwrap_or(0).checked_add(last.unwrap_or(0));
        let Some(middle) = ends.and_then(|ends| num_layers.checked_sub(ends)) else {
            let ends = first.unwrap_or(0) as u128 + last.unwrap_or(0) as u128;
            return invalid(format!(
                "the first and last pipeline stages' {ends} layers exceed the model's \
                 {num_layers}"
            ));
        };
        if (middle == 0) != (middle_stages == 0) {
            return invalid(format!(
                "{middle} layers are left for {middle_stages} middle pipeline stages"
            ));
        }
        let per_middle = middle.checked_div(middle_stages).unwrap_or(0);
        if middle_stages > 0
            && (per_middle * middle_stages != middle || !per_middle.is_multiple_of(v))
        {
            return invalid(format!(
                "the {middle} layers between the first and last pipeline stages do not split \
                 evenly over {middle_stages} middle stages × {v} model chunks"
            ));
        }
        Ok((0..p)
            .map(|rank| match (rank, first, last) {
                (0, Some(n), _) => n,
                (r, _, Some(n)) if r + 1 == p => n,
                _ => per_middle,
            })
            .collect())
    }

    /// The global indices of the layers of the chunk at `position`, out of `num_layers`.
    ///
    /// # Errors
    ///
    /// What [`layers_per_virtual_stage`](Self::layers_per_virtual_stage) refuses, and a
    /// position outside its pipeline.
    pub fn layer_range(
        &self,
        num_layers: usize,
        position: &PipelinePosition,
    ) -> Result<Range<usize>, TopologyError> {
        let counts = self.layers_per_virtual_stage(
            num_layers,
            position.pipeline_size,
            position.num_model_chunks,
        )?;
        if position.pipeline_rank >= position.pipeline_size
            || position.chunk >= position.num_model_chunks
        {
            return Err(TopologyError::PositionOutOfRange {
                pipeline_rank: position.pipeline_rank,
                pipeline_size: position.pipeline_size,
                chunk: position.chunk,
                num_model_chunks: position.num_model_chunks,
            });
        }
        let stage = position.virtual_stage();
        let start = counts[..stage].iter().sum::<usize>();
        Ok(start..start + counts[stage])
    }
}
