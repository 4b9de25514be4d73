//! Errors of the kernel ops' public functions: inputs are checked before any launch.

/// Why a fused op refused its inputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// Shapes that do not fit together, with the shapes in the message.
    #[error("shape error: {0}")]
    Shape(String),
    /// A scalar argument outside its domain (a probability, a scale), with the value.
    #[error("invalid argument: {0}")]
    Argument(String),
    /// The device cannot run the op as asked (e.g. a dtype it cannot hold).
    #[error("unsupported: {0}")]
    Unsupported(String),
}
