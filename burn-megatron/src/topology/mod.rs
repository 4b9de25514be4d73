//! How global ranks are laid out into tensor-, pipeline-, data- and context-parallel
//! groups, with Megatron-Core's exact rank arithmetic.
//!
//! - [`RankGenerator`]: the mixed-radix grid of ranks over the dimensions `tp`, `cp`,
//!   `ep`, `dp` and `pp` (first token of the order varies fastest), and the groups of
//!   any subset of them.
//! - [`ParallelConfig`] → [`ValidatedConfig`]: user settings, checked up front;
//!   [`ValidatedConfig::all_groups`] lists every group a launcher must create.
//! - [`ParallelState`]: one rank's coordinates, groups and pipeline neighbours.
//! - Layer placement over the pipeline: [`PipelinePosition::layer_range`] gives a chunk's
//!   layers, as its [`LayerSplit`] (`split.rs`) places them: evenly, Megatron's uneven first
//!   and last stages, or every virtual stage written out ([`PipelineLayout`], `layout.rs`,
//!   `--pipeline-model-parallel-layout`). Parsed layouts are kept for the life of the
//!   process (interned, so that a split stays `Copy`); all else here is arithmetic.
//!
//! ```
//! use burn_megatron::topology::{GroupKind, ParallelConfig, ParallelState};
//!
//! // 8 ranks: tensor parallel 2, pipeline parallel 2, so data parallel 2.
//! let config = ParallelConfig::new(8, 2, 2).validate().unwrap();
//! assert_eq!(
//!     config.all_groups(GroupKind::DataParallel),
//!     vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
//! );
//!
//! let state = ParallelState::new(&config, 6).unwrap();
//! assert_eq!(state.pipeline_model_parallel_rank(), 1);
//! assert!(state.is_pipeline_last_stage());
//! assert_eq!(state.pipeline_prev_rank(), 2);
//! ```

mod config;
mod dim;
mod error;
mod group;
mod layout;
mod rank_generator;
mod split;
mod stage;
mod state;

#[cfg(test)]
mod tests;

pub use config::{ParallelConfig, ValidatedConfig};
pub use dim::{ParallelDim, RankCoords};
pub use error::TopologyError;
pub use group::GroupKind;
pub use layout::PipelineLayout;
pub use rank_generator::{DEFAULT_ORDER, RankGenerator};
pub use split::LayerSplit;
pub use stage::PipelinePosition;
#[cfg(test)]
pub(crate) use stage::{layer_offset, layers_per_chunk};
pub use state::ParallelState;
