//! The examples end to end, in one test binary (each test binary links Burn, which costs CI a
//! minute or more of linking apiece): the pretraining runs and their resumes, reshards and
//! refusals, the checkpoint tool, the distributed optimizer, the drop-in conversions, and
//! with the `mpi` feature the same runs under `mpirun`. Filter by module, e.g. `cargo test -p
//! burn-megatron-examples reshard`. The tests run the example binaries too, which `cargo test` builds first.

#[allow(dead_code)] // the mpi module alone uses some helpers
mod common;

mod bert_pretrain;
#[cfg(feature = "mpi")]
mod bert_pretrain_mpi;
mod checkpoint_tool;
mod distributed_optimizer;
mod dropin;
mod gpt_pretrain;
mod legacy_configs;
mod reshard;
mod train_minimal;
mod units;
