//! Megatron-LM-style model parallelism for [Burn](https://burn.dev).
//!
//! The crate is organised bottom-up, one module per layer of the system:
//!
//! - [`topology`]: how global ranks are laid out into tensor-, pipeline-, data- and
//!   context-parallel groups (Megatron-Core's exact rank arithmetic).
//! - [`checkpoint`]: training checkpoints (weights, master weights, optimizer state).
//! - [`comm`]: collectives between ranks (NCCL-shaped), every call bounded by a timeout.
//! - [`data`]: BERT pretraining data: corpus, WordPiece tokenizer, masked sentence pairs.
//! - [`data_parallel`]: gradient reduction over the data-parallel group, in buckets.
//! - [`launch`]: run one closure per rank as threads of this process.
//! - [`models`]: tensor-parallel attention, MLP and transformer layer.
//! - [`optimizer`]: Megatron's learning-rate / weight-decay scheduler.
//! - [`tensor_parallel`]: differentiable mappings and parallel layers.

pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod data_parallel;
pub mod launch;
pub mod models;
pub mod optimizer;
mod param_grads;
mod safetensors_io;
pub mod tensor_parallel;
pub mod topology;
