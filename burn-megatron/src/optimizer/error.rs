//! Why an optimizer step fails.

use crate::comm::CommError;
use burn_megatron_kernels::KernelError;

/// Why a [`MegatronOptimizer::step`](super::MegatronOptimizer::step) failed.
#[derive(Debug, thiserror::Error)]
pub enum OptimizerError {
    /// A collective of the model-parallel group failed (timeout, a failed peer).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The fused step refused its inputs (e.g. a negative or non-finite learning rate).
    #[error("fused optimizer step: {0}")]
    Kernel(#[from] KernelError),
    /// A combination this optimizer cannot step yet.
    #[error("not supported yet: {0}")]
    Unsupported(String),
}
