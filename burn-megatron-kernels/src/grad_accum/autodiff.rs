//! Autodiff for weight-gradient accumulation: it runs inside a backward, so it runs on the
//! inner backend and its result is not tracked.

use super::GradAccumOps;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};

impl<B: GradAccumOps, C: CheckpointStrategy> GradAccumOps for Autodiff<B, C> {
    fn accumulate_weight_grad(
        main_grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::accumulate_weight_grad(
            main_grad.into_primitive(),
            x.into_primitive(),
            dy.into_primitive(),
        ))
    }
}
