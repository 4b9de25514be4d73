//! Drop-in conversion: a model written with `burn::nn` made tensor- and pipeline-parallel,
//! its record paths unchanged. Import
//! [`nn`]'s `Linear`, `Embedding`, `SwiGlu`, `attention::MultiHeadAttention`,
//! `attention::CrossAttention`,
//! `transformer::TransformerEncoder` and `transformer::TransformerDecoder` (Burn's names,
//! fields, configs and record paths) in place of `burn::nn`'s, and name the layout once with
//! a [`TpPlan`]: one [`apply`](TpPlan::apply) splits the whole module tree.
//!
//! A layer Burn already built (a loaded `burn::nn::transformer::TransformerEncoder`, say)
//! becomes its drop-in counterpart with `From`, its values and lazy parameters kept, and a
//! plan splits it as it splits one the model built.
//!
//! The split is Megatron's: query, key, value and the first feed-forward layer
//! column-parallel, the attention output and the second feed-forward layer row-parallel, norms
//! whole (one all-reduce per block in each direction); sizes that do not split are errors
//! naming the layer and the numbers, except a vocabulary, which a plan pads as Megatron does
//! ([`TpPlan::make_vocab_size_divisible_by`]). Dropout comes from a
//! [`RngTracker`](crate::tensor_parallel::RngTracker): Burn's `Dropout` draws from one process-wide generator, so ranks running as threads would
//! draw different masks for activations every rank holds whole. With
//! [`TpPlan::sequence_parallel`] the encoder and decoder also split their residual stream by
//! sequence between blocks (Megatron's sequence parallelism), the model's code unchanged.
//!
//! Then [`load_sharded`] reads the record the plain model saved, each rank only its shards,
//! and [`save_gathered`] writes one the plain model loads, from the shards;
//! [`attention_split`] gives per-rank head counts; the vocabulary-parallel loss, sampler and
//! argmax are in [`tensor_parallel`](crate::tensor_parallel).
//!
//! A model split into pipeline stages is built per stage from a [`PpPlan`]'s [`PpStage`],
//! and [`save_gathered_stages`] writes the plain record from every stage's shards.

mod heads;
mod init;
mod load;
pub mod nn;
mod pipeline;
mod plan;
mod save;
mod shard;
mod slot;
mod stage;

pub use heads::{AttentionSplit, attention_split};
pub use init::master_init;
pub use load::{
    LoadOptions, LoadReport, RecordSource, convert_named_mpk, load_sharded,
    rotary_half_to_interleaved,
};
pub use pipeline::{PpPlan, PpStage};
pub use plan::{Split, TpPlan, apply_lora, apply_qlora};
pub use save::{
    SaveOptions, rotary_interleaved_to_half, save_gathered, save_gathered_group,
    save_gathered_stages, save_safetensors, save_safetensors_stages,
};
pub use slot::TpSlot;
pub(crate) use stage::{StageKey, StageKeys};
