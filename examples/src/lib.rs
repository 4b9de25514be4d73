//! Shared helpers of the examples and benchmarks under `examples/examples/`.

/// The median of `samples` (the upper one for an even count). Panics on an empty slice.
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

mod alloc;
pub mod checkpoint_tool;
pub mod dataset_tool;
pub mod memory;
pub mod phases;
pub mod plan;
pub mod preprocess;
pub mod pretrain;
pub mod torch_ref;
