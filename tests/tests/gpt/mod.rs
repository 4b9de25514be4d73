//! The GPT family (Llama-style and GPT-2-style configs of one model): parity of every layout
//! with one rank, Hugging Face fixtures, generation, and refused configurations.

mod context_parallel;
mod errors;
mod generate;
mod hf;
mod hf_moe;
mod host_reads;
mod moe;
mod parity;
mod pipeline;
mod recompute;

/// The error type the rank closures return.
type Error = Box<dyn std::error::Error + Send + Sync>;
