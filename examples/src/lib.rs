//! Examples live under `examples/examples/`.
