//! User-facing parallelism settings and their up-front validation.

use super::dim::parse_tokens;
use super::rank_generator::DEFAULT_ORDER;
use super::{LayerSplit, ParallelDim, RankGenerator, TopologyError};

/// How a training job is split across `world_size` ranks.
///
/// Build it with [`ParallelConfig::new`] and the `with_*` methods (or set the public
/// fields directly), then call [`ParallelConfig::validate`] before use.
///
/// ```
/// use burn_megatron::topology::ParallelConfig;
///
/// let config = ParallelConfig::new(16, 2, 2)
///     .with_virtual_pipeline(Some(2))
///     .validate()
///     .unwrap();
/// assert_eq!(config.data_parallel_size(), 4);
/// ```
///
/// Sequence parallelism is not here: it changes what a layer computes, so it is the model's
/// setting, as in Megatron-Core's `TransformerConfig` (`TransformerLayerConfig::sequence_parallel`,
/// `TpPlan::sequence_parallel` for a drop-in model, or a parallel linear layer's own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelConfig {
    /// Total number of ranks.
    pub world_size: usize,
    /// Ranks that split each layer's weights (`tp`).
    pub tensor_model_parallel_size: usize,
    /// Pipeline stages (`pp`).
    pub pipeline_model_parallel_size: usize,
    /// Model chunks per pipeline stage for the interleaved schedule; `None` when not
    /// interleaving.
    pub virtual_pipeline_model_parallel_size: Option<usize>,
    /// How the model's layers split over the pipeline's virtual stages (evenly by default;
    /// Megatron's uneven first and last stages).
    pub layer_split: LayerSplit,
    /// Ranks that split the sequence dimension in attention (`cp`); the models split it by
    /// their `context_parallel` setting (all-gather, ring or Ulysses).
    pub context_parallel_size: usize,
    /// Ranks that split the experts of mixture-of-experts layers (`ep`), laid out by a
    /// second rank generator as Megatron-Core's (see [`GroupKind::ExpertModelParallel`](crate::topology::GroupKind::ExpertModelParallel)).
    pub expert_model_parallel_size: usize,
    /// Ranks that split each expert's weights (`--expert-tensor-parallel-size`): 1 (the
    /// default here; Megatron's is the dense TP size) or the tensor-parallel size, when the
    /// experts' tensor-parallel groups are the dense ones (the default order's).
    pub expert_tensor_parallel_size: usize,
    /// `-`-joined dimension order, fastest-varying first; `pp` must come last when pp > 1.
    pub order: String,
}

impl ParallelConfig {
    /// A configuration with the given world, tensor and pipeline sizes; context and expert
    /// parallel size 1, no virtual pipeline, order
    /// `"tp-cp-ep-dp-pp"`. The data parallel size is whatever remains.
    pub fn new(world_size: usize, tp: usize, pp: usize) -> ParallelConfig {
        ParallelConfig {
            world_size,
            tensor_model_parallel_size: tp,
            pipeline_model_parallel_size: pp,
            virtual_pipeline_model_parallel_size: None,
            layer_split: LayerSplit::default(),
            context_parallel_size: 1,
            expert_model_parallel_size: 1,
            expert_tensor_parallel_size: 1,
            order: DEFAULT_ORDER.to_string(),
        }
    }

    /// Sets the dimension order, e.g. `"tp-pp-dp"` is rejected when pp > 1 but
    /// `"tp-dp-pp"` is accepted.
    #[must_use]
    pub fn with_order(mut self, order: impl Into<String>) -> ParallelConfig {
        self.order = order.into();
        self
    }

    /// Sets the number of model chunks per pipeline stage (interleaved schedule).
    #[must_use]
    pub fn with_virtual_pipeline(mut self, size: Option<usize>) -> ParallelConfig {
        self.virtual_pipeline_model_parallel_size = size;
        self
    }

    /// Sets how the layers split over the pipeline stages (checked against the model's
    /// layer count when a chunk is built: [`PipelinePosition::layer_range`](super::PipelinePosition::layer_range)).
    #[must_use]
    pub fn with_layer_split(mut self, split: LayerSplit) -> ParallelConfig {
        self.layer_split = split;
        self
    }

    /// Sets the context parallel size (validation rejects values above 1 for now).
    #[must_use]
    pub fn with_context_parallel(mut self, cp: usize) -> ParallelConfig {
        self.context_parallel_size = cp;
        self
    }

    /// Sets the expert parallel size (`--expert-model-parallel-size`).
    #[must_use]
    pub fn with_expert_parallel(mut self, ep: usize) -> ParallelConfig {
        self.expert_model_parallel_size = ep;
        self
    }

    /// Sets the expert tensor parallel size (`--expert-tensor-parallel-size`): 1 or the
    /// tensor-parallel size (validation refuses others).
    #[must_use]
    pub fn with_expert_tensor_parallel(mut self, etp: usize) -> ParallelConfig {
        self.expert_tensor_parallel_size = etp;
        self
    }

    /// `world_size / (tp · pp · cp)`, rounded down; 0 when that product is 0. Exact
    /// only for a configuration that [`validate`](ParallelConfig::validate) accepts.
    pub fn data_parallel_size(&self) -> usize {
        self.tensor_model_parallel_size
            .checked_mul(self.pipeline_model_parallel_size)
            .and_then(|product| product.checked_mul(self.context_parallel_size))
            .and_then(|product| self.world_size.checked_div(product))
            .unwrap_or(0)
    }

    /// Checks every constraint up front and derives the rank layout.
    ///
    /// # Errors
    ///
    /// A size of 0 (including a virtual pipeline size of 0); an expert tensor-parallel size
    /// other than 1 or the tensor-parallel size, or whose groups are not the tensor-parallel
    /// groups (not supported yet); a world size that tp · pp · cp or etp · ep · pp does not
    /// divide; an unknown or repeated order token, or a dimension of size > 1 missing from the order;
    /// `pp` not last in the order when pp > 1; a virtual pipeline size with pp = 1; a
    /// layer split that [`LayerSplit::check`] refuses.
    pub fn validate(self) -> Result<ValidatedConfig, TopologyError> {
        let config = self;
        let world = config.world_size;
        let tp = config.tensor_model_parallel_size;
        let pp = config.pipeline_model_parallel_size;
        let cp = config.context_parallel_size;
        let ep = config.expert_model_parallel_size;

        let named = [
            (world, "world"),
            (tp, "tensor model parallel (tp)"),
            (pp, "pipeline model parallel (pp)"),
            (cp, "context parallel (cp)"),
            (ep, "expert model parallel (ep)"),
            (
                config.expert_tensor_parallel_size,
                "expert tensor parallel (etp)",
            ),
            (
                config.virtual_pipeline_model_parallel_size.unwrap_or(1),
                "virtual pipeline model parallel",
            ),
        ];
        if let Some((_, what)) = named.iter().find(|(size, _)| *size == 0) {
            return Err(TopologyError::ZeroSize { what });
        }

        let etp = config.expert_tensor_parallel_size;
        // Only the layout where each expert is split like the dense layers: its shards then
        // sit where the dense shards do (checkpoint directories, Hugging Face slices).
        if etp > 1 && etp != tp {
            return Err(TopologyError::ExpertTensorParallelNotTp {
                etp,
                tp,
                order: None,
            });
        }

        let product = tp
            .checked_mul(pp)
            .and_then(|product| product.checked_mul(cp))
            .ok_or_else(|| TopologyError::SizeOverflow {
                sizes: format!("tp = {tp}, pp = {pp}, cp = {cp}"),
            })?;
        if !world.is_multiple_of(product) {
            return Err(TopologyError::WorldSizeNotDivisible {
                world_size: world,
                tp,
                pp,
                cp,
                product,
            });
        }
        let dp = world / product;

        // Megatron-Core's two generators: the dense layers' has no expert dimension, the
        // experts' no context dimension; both end in pp, so their pipelines coincide.
        let generator = RankGenerator::new(tp, 1, dp, pp, cp, &config.order)?;
        let expert_product = etp
            .checked_mul(ep)
            .and_then(|product| product.checked_mul(pp))
            .ok_or_else(|| TopologyError::SizeOverflow {
                sizes: format!("etp = {etp}, ep = {ep}, pp = {pp}"),
            })?;
        if !world.is_multiple_of(expert_product) {
            return Err(TopologyError::ExpertWorldSizeNotDivisible {
                world_size: world,
                etp,
                ep,
                pp,
                product: expert_product,
            });
        }
        let expert_generator =
            RankGenerator::new(etp, ep, world / expert_product, pp, 1, &config.order)?;
        if etp > 1 && expert_generator.get_ranks("tp")? != generator.get_ranks("tp")? {
            return Err(TopologyError::ExpertTensorParallelNotTp {
                etp,
                tp,
                order: Some(config.order.clone()),
            });
        }
        if pp > 1 && parse_tokens(&config.order)?.last() != Some(&ParallelDim::Pipeline) {
            return Err(TopologyError::PipelineNotLast {
                pp,
                order: config.order.clone(),
            });
        }

        if let Some(virtual_size) = config.virtual_pipeline_model_parallel_size
            && pp == 1
        {
            return Err(TopologyError::VirtualPipelineWithoutPipeline { virtual_size, pp });
        }

        config
            .layer_split
            .check(pp, config.virtual_pipeline_model_parallel_size.unwrap_or(1))?;

        debug_assert_eq!(generator.world_size(), world);
        Ok(ValidatedConfig {
            config,
            data_parallel_size: dp,
            generator,
            expert_generator,
        })
    }
}

impl Default for ParallelConfig {
    /// A single rank with no parallelism.
    fn default() -> ParallelConfig {
        ParallelConfig::new(1, 1, 1)
    }
}

/// A [`ParallelConfig`] that passed [`ParallelConfig::validate`], with its rank layout.
///
/// Use [`ValidatedConfig::all_groups`] to list every communicator a launcher must create,
/// and [`ParallelState::new`](super::ParallelState::new) for one rank's view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedConfig {
    config: ParallelConfig,
    data_parallel_size: usize,
    generator: RankGenerator,
    expert_generator: RankGenerator,
}

impl ValidatedConfig {
    /// The settings as validated.
    pub fn config(&self) -> &ParallelConfig {
        &self.config
    }

    /// The rank layout.
    pub fn rank_generator(&self) -> &RankGenerator {
        &self.generator
    }

    /// The layout of the experts' groups (Megatron-Core's second rank generator: `tp` is
    /// expert tensor parallelism, `dp` expert data parallelism, no `cp`).
    pub fn expert_rank_generator(&self) -> &RankGenerator {
        &self.expert_generator
    }

    /// Total number of ranks.
    pub fn world_size(&self) -> usize {
        self.config.world_size
    }

    /// Tensor model parallel size.
    pub fn tensor_model_parallel_size(&self) -> usize {
        self.config.tensor_model_parallel_size
    }

    /// Pipeline model parallel size.
    pub fn pipeline_model_parallel_size(&self) -> usize {
        self.config.pipeline_model_parallel_size
    }

    /// Virtual pipeline size (model chunks per stage), if interleaving.
    pub fn virtual_pipeline_model_parallel_size(&self) -> Option<usize> {
        self.config.virtual_pipeline_model_parallel_size
    }

    /// How the layers split over the virtual pipeline stages.
    pub fn layer_split(&self) -> LayerSplit {
        self.config.layer_split
    }

    /// Context parallel size.
    pub fn context_parallel_size(&self) -> usize {
        self.config.context_parallel_size
    }

    /// Expert model parallel size.
    pub fn expert_model_parallel_size(&self) -> usize {
        self.config.expert_model_parallel_size
    }

    /// Expert tensor parallel size.
    pub fn expert_tensor_parallel_size(&self) -> usize {
        self.config.expert_tensor_parallel_size
    }

    /// Expert data parallel size: `world_size / (etp · ep · pp)`, the replicas of each
    /// expert that reduce its gradients.
    pub fn expert_data_parallel_size(&self) -> usize {
        self.expert_generator.size(ParallelDim::Data)
    }

    /// Data parallel size: `world_size / (tp · pp · cp)`, exact.
    pub fn data_parallel_size(&self) -> usize {
        self.data_parallel_size
    }
}

impl TryFrom<ParallelConfig> for ValidatedConfig {
    type Error = TopologyError;

    fn try_from(config: ParallelConfig) -> Result<ValidatedConfig, TopologyError> {
        config.validate()
    }
}
