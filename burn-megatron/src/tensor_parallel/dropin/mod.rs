//! A model written with `burn::nn` made tensor-parallel, its record paths unchanged: import
//! [`nn`]'s `Linear`, `Embedding`, `SwiGlu`, `attention::MultiHeadAttention`,
//! `transformer::TransformerEncoder` and `transformer::TransformerDecoder` (Burn's names,
//! fields, configs and record paths) in place of `burn::nn`'s, and name the layout once with
//! a [`TpPlan`]: one [`apply`](TpPlan::apply) splits the whole module tree.
//!
//! One layer at a time, for a user who holds a built Burn layer rather than a model's code:
//! [`ParallelSwiGlu`] (for `nn::SwiGlu`) and [`ParallelTransformerEncoder`] (for
//! `nn::transformer::TransformerEncoder`, with its layer, [`ParallelMultiHeadAttention`] and
//! [`ParallelPositionWiseFeedForward`]) take this rank's shard of a plain layer (`from_*`),
//! gather it back (`to_*`, collective), or draw it from Burn's own config as every TP size
//! draws it ([`MasterInit`](super::MasterInit)). A plan does all of that for a whole model.
//!
//! Either way the split is Megatron's: query, key, value and the first feed-forward layer
//! column-parallel, the attention output and the second feed-forward layer row-parallel, norms
//! whole (one all-reduce per block in each direction); sizes that do not split are errors
//! naming the layer and the numbers, except a vocabulary, which a plan pads as Megatron does
//! ([`TpPlan::make_vocab_size_divisible_by`]). Dropout comes from a [`RngTracker`](super::RngTracker):
//! Burn's `Dropout` draws from one process-wide generator, so ranks running as threads would
//! draw different masks for activations every rank holds whole.
//!
//! Then [`load_sharded`] reads the record the plain model saved, each rank only its shards,
//! and [`save_gathered`] writes one the plain model loads, from the shards;
//! [`attention_split`] gives per-rank head counts; the vocabulary-parallel loss, sampler and
//! argmax are in [`tensor_parallel`](super).

mod encoder;
mod heads;
mod init;
mod load;
mod mha;
pub mod nn;
mod plan;
mod save;
mod shard;
mod swiglu;

pub use encoder::{
    ParallelPositionWiseFeedForward, ParallelTransformerEncoder, ParallelTransformerEncoderLayer,
};
pub use heads::{AttentionSplit, attention_split};
pub use init::master_init;
pub use load::{LoadOptions, LoadReport, RecordSource, load_sharded};
pub use mha::{ParallelMhaInput, ParallelMhaOutput, ParallelMultiHeadAttention};
pub use plan::{Split, TpPlan, TpSlot};
pub use save::save_gathered;
pub use swiglu::ParallelSwiGlu;
