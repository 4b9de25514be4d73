//! Every cross-crate integration and parity test, in one binary: each test binary links Burn,
//! which costs CI a minute or more of linking apiece. Filter by module, e.g.
//! `cargo test -p burn-megatron-tests gpt::pipeline`.

mod bert_parity;
mod bert_pipeline;
mod dropin;
mod fused_optimizer;
mod gpt;
mod grad_accum_fusion;
mod hf_bert;
mod megatron_optimizer;
#[cfg(feature = "mpi")]
mod mpi;
mod tp_parity;
mod transformer_parity;
