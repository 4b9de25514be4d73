//! Megatron-LM-style model parallelism for [Burn](https://burn.dev).
//!
//! The crate is organised bottom-up, one module per layer of the system:
//!
//! - [`topology`]: how global ranks are laid out into tensor-, pipeline-, data- and
//!   context-parallel groups (Megatron-Core's exact rank arithmetic).
//! - [`comm`]: collectives between ranks (NCCL-shaped), every call bounded by a timeout.
//! - [`tensor_parallel`]: differentiable mappings, parallel layers, vocab-parallel
//!   cross-entropy, initialisation and dropout RNG independent of the TP size.
//! - [`data_parallel`]: gradient reduction over the data-parallel group in buckets, after
//!   backward or overlapped with it.
//! - [`optimizer`]: Megatron's LR / WD scheduler, loss scalers, and the optimizer wrapper
//!   (FP32 master weights, overflow skipping, global-norm clipping).
//! - [`pipeline`]: schedules (1F1B, interleaved), p2p between stages and
//!   `forward_backward_func` over any model's chunks.
//! - [`context_parallel`]: one sequence split over the context-parallel group (the
//!   load-balanced split, K/V all-gathered over it, masks by global position).
//! - [`recompute`]: activation recomputation: regions that keep only their input and run
//!   again in backward (Megatron's `--recompute-granularity`).
//! - [`models`]: tensor-parallel attention, MLP, transformer layer and BERT, with Hugging
//!   Face checkpoint import/export.
//! - [`data`]: BERT pretraining data: corpus, WordPiece tokenizer, masked sentence pairs.
//! - [`launch`]: run one closure per rank (threads of this process, or processes), each
//!   handed its groups, device and pipeline channels.
//! - [`checkpoint`]: training checkpoints (weights, master weights, optimizer state).
//! - [`training`]: one rank's side of training in one object: the data-parallel
//!   reducers and shard plans, `finalize`, and collective checkpoint `save` / `load`.
//!
//! No module imports one listed after it, except that the models sit below data
//! parallelism, the optimizer and the pipeline (none of which imports them);
//! `tests/layering.rs` holds the exact table and checks it. The gradient-ready hooks the
//! parallel layers and the overlapped reduction share sit below both, with the other
//! crate-private helpers.

mod activation;
pub mod aux_loss;
pub mod checkpoint;
pub mod comm;
pub mod context_parallel;
#[cfg(feature = "cuda")]
pub use burn_megatron_kernels::cuda;
pub mod data;
pub mod data_parallel;
mod grad_hooks;
pub mod launch;
pub mod models;
mod module_path;
pub mod moe;
pub mod optimizer;
mod param_grads;
pub mod pipeline;
pub mod recompute;
mod safetensors_io;
pub mod tensor_parallel;
pub mod topology;
pub mod training;
