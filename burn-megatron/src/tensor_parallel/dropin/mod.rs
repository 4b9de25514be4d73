//! Parallel counterparts of Burn's composite layers, with Burn's field names, so that a model
//! written with `burn::nn` becomes tensor-parallel by swapping types, and its record paths stay
//! the same:
//!
//! - [`ParallelSwiGlu`] for `nn::SwiGlu`: both projections column-parallel, the output split
//!   (the next layer is a [`RowParallelLinear`](super::RowParallelLinear), as Llama's `w2`);
//! - [`ParallelTransformerEncoder`] (with [`ParallelTransformerEncoderLayer`],
//!   [`ParallelMultiHeadAttention`] and [`ParallelPositionWiseFeedForward`]) for
//!   `nn::transformer::TransformerEncoder`: query, key, value and the first feed-forward layer
//!   column-parallel, the attention output and the second feed-forward layer row-parallel, the
//!   norms duplicated (Megatron's split: one all-reduce per block in each direction).
//!
//! Each has `from_*`, this rank's shard of the plain layer (its weights sliced, the same at
//! every TP size), `to_*`, the plain layer gathered from the ranks (collective), and a
//! constructor from Burn's own config that draws the weights as every TP size draws them
//! ([`MasterInit`](super::MasterInit)). Sizes that do not split over the ranks are errors
//! naming the layer and the numbers, at construction and again at the first forward.
//!
//! Dropout comes from a [`RngTracker`](super::RngTracker) the layers hold: Burn's `Dropout`
//! draws from one process-wide generator, so ranks running as threads would draw different
//! masks for activations every rank holds whole. The `dropout` fields stay Burn's `Dropout`
//! (the probability, and the training flag `valid()` and freezing clear).

mod encoder;
mod heads;
mod init;
mod load;
mod mha;
pub mod nn;
mod plan;
mod swiglu;

pub use encoder::{
    ParallelPositionWiseFeedForward, ParallelTransformerEncoder, ParallelTransformerEncoderLayer,
};
pub use heads::{AttentionSplit, attention_split};
pub use init::master_init;
pub use load::{LoadOptions, LoadReport, RecordSource, load_sharded};
pub use mha::{ParallelMhaInput, ParallelMhaOutput, ParallelMultiHeadAttention};
pub use plan::{Split, TpPlan, TpSlot};
pub use swiglu::ParallelSwiGlu;
