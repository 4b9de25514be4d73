//! Autodiff for the local cross-entropy ops: they are pieces of a forward and of a
//! handwritten backward that the cross-entropy op owns, so they run on the inner backend
//! and their results are not tracked.

use super::{CrossEntropyOps, LabelSmoothing};
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend};

impl<B: CrossEntropyOps, C: CheckpointStrategy> CrossEntropyOps for Autodiff<B, C> {
    fn cross_entropy_row_stats(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::cross_entropy_row_stats(
            logits.into_primitive(),
            target,
            in_range.into_primitive(),
        ))
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum_exp: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        smoothing: LabelSmoothing,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::cross_entropy_backward(
            logits.into_primitive(),
            max.into_primitive(),
            sum_exp.into_primitive(),
            target,
            in_range.into_primitive(),
            grad.into_primitive(),
            smoothing,
        ))
    }
}
