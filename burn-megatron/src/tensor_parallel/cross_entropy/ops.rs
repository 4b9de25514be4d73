//! The vocab-parallel cross-entropy as a backend extension with a handwritten backward.

use super::super::mappings::host::all_reduce_many;
use crate::comm::{Comm, ReduceOp};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Flex, Scalar, TensorMetadata, backend_extension};
use burn::tensor::{FloatDType, Shape, Slice};
use burn_megatron_kernels::{CrossEntropyOps, LabelSmoothing};

/// Loss of each token given this rank's slice of the logits.
///
/// `logits`: `[N, V / tp]`; `target`: `[N]`, this rank's local column of each target (any
/// value where the target lies elsewhere); `in_range`: `[N]`, 1 where the target lies in this
/// rank's slice, else 0; `smoothing`: `ε` and the real vocabulary size it spreads over (the
/// first `global_vocab` columns of the `V` the ranks hold). Returns `[N]` f32 losses.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait VocabParallelCrossEntropyOps: CrossEntropyOps {
    /// See the trait documentation.
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        smoothing: LabelSmoothing,
        comm: Comm,
    ) -> FloatTensor<Self>;
}

impl VocabParallelCrossEntropyOps for Flex {
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        smoothing: LabelSmoothing,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(logits, target, in_range, smoothing, &comm).loss
    }
}

#[cfg(feature = "cube")]
impl VocabParallelCrossEntropyOps for burn::backend::Cube {
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        smoothing: LabelSmoothing,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(logits, target, in_range, smoothing, &comm).loss
    }
}

/// What the forward leaves for the backward: the logits and two `[N]` row statistics, from
/// which the backward kernel recomputes the softmax (no `[N, V / tp]` f32 copy is kept).
#[derive(Debug, Clone)]
pub(crate) struct Saved<B: Backend> {
    loss: FloatTensor<B>,
    /// `[N, V / tp]` in the model's dtype.
    logits: FloatTensor<B>,
    /// `[N]` f32 global row max and sum of `exp(logit − max)`.
    max: FloatTensor<B>,
    sum_exp: FloatTensor<B>,
    /// `[N]` local target columns.
    target: IntTensor<B>,
    /// `[N]` 1 where the target is in this slice.
    in_range: FloatTensor<B>,
    smoothing: LabelSmoothing,
    /// This rank's columns beyond the real vocabulary, which take no smoothing mass.
    padding: Option<std::ops::Range<usize>>,
}

/// One fused pass over the logits ([`CrossEntropyOps::cross_entropy_row_stats`]: local max
/// `m_l`, `Σ exp(z − m_l)`, raw target logit, raw sum of logits), then two all-reduces: the
/// max `M` of the `m_l`, and one packed sum of `(Σ exp(z − m_l)·exp(m_l − M), z_target,
/// Σ z, in_range)`. `m_l ≤ M` on every rank (a max is exact), so `exp(m_l − M) ≤ 1`: a rank
/// whose slice is all masked padding (−10⁴) contributes a finite ~0, never ∞ or NaN.
pub(crate) fn forward<B: CrossEntropyOps>(
    logits: FloatTensor<B>,
    target: IntTensor<B>,
    in_range: FloatTensor<B>,
    smoothing: LabelSmoothing,
    comm: &Comm,
) -> Saved<B> {
    let dims = logits.shape().to_vec();
    let (n, local_vocab) = (dims[0], dims[1]);
    let real_vocab = smoothing.global_vocab;
    let padding = padding_columns(local_vocab, real_vocab, comm);
    let in_range = B::float_cast(in_range, FloatDType::F32);

    let stats = B::cross_entropy_row_stats(logits.clone(), target.clone(), in_range.clone());
    let column = |c: usize| {
        let col = B::float_slice(stats.clone(), &[Slice::from(0..n), Slice::from(c..c + 1)]);
        B::float_reshape(col, Shape::from([n]))
    };
    let local_max = column(0);
    let [max] = all_reduce_many::<B, 1>([local_max.clone()], ReduceOp::Max, comm);
    // Σ exp(z − m_l) re-shifted to the global max.
    let rescale = B::float_exp(B::float_sub(local_max, max.clone()));
    let local_sum_exp = B::float_mul(column(1), rescale);
    // The smoothing's sum of logits runs over the real vocabulary: a rank holding padding
    // sums its real columns again (summed with the padding, −10⁴ a column, the real sum
    // would keep only the f32 ulps of the total). Only smoothing reads the sum.
    let local_sum_logits = match padding.clone() {
        Some(pad) if smoothing.epsilon > 0.0 => {
            let real = B::float_slice(
                logits.clone(),
                &[Slice::from(0..n), Slice::from(0..pad.start)],
            );
            let real = B::float_sum_dim(B::float_cast(real, FloatDType::F32), 1);
            B::float_reshape(real, Shape::from([n]))
        }
        _ => column(3),
    };
    let [sum_exp, predicted, sum_logits, owned] = all_reduce_many::<B, 4>(
        [local_sum_exp, column(2), local_sum_logits, in_range.clone()],
        ReduceOp::Sum,
        comm,
    );
    // Shifted by the global max: z_t − M where some rank owns the target (`owned` is 1),
    // and Σ_v (z_v − M) over the real vocabulary.
    let predicted = B::float_sub(predicted, B::float_mul(max.clone(), owned));
    let sum_logits = B::float_sub(
        sum_logits,
        B::float_mul_scalar(max.clone(), Scalar::from(real_vocab as f64)),
    );

    // (1 − ε)·(lse − z_t) + ε·(lse − mean_k z_k), the mean over the real vocabulary (z
    // shifted by the row max, which cancels).
    let lse = B::float_log(sum_exp.clone());
    let nll = B::float_sub(lse.clone(), predicted);
    let epsilon = smoothing.epsilon;
    let loss = if epsilon > 0.0 {
        let mean = B::float_mul_scalar(sum_logits, Scalar::from(1.0 / real_vocab as f64));
        let smooth = B::float_sub(lse, mean);
        B::float_add(
            B::float_mul_scalar(nll, Scalar::from(1.0 - f64::from(epsilon))),
            B::float_mul_scalar(smooth, Scalar::from(f64::from(epsilon))),
        )
    } else {
        nll
    };
    Saved {
        loss,
        logits,
        max,
        sum_exp,
        target,
        in_range,
        smoothing,
        padding,
    }
}

/// This rank's local columns beyond the real vocabulary, if it holds any.
fn padding_columns(
    local_vocab: usize,
    real_vocab: usize,
    comm: &Comm,
) -> Option<std::ops::Range<usize>> {
    let start = comm.group().rank() * local_vocab;
    let first = real_vocab.saturating_sub(start).min(local_vocab);
    (first < local_vocab).then_some(first..local_vocab)
}

/// `(softmax − (1 − ε)·one_hot − ε / V) · grad`, in the logits' dtype: one fused op, `V` the
/// real vocabulary. The kernel spreads `ε / V` over every column; a rank holding padding
/// gives it back on those columns, whose target mass is zero.
fn backward<B: CrossEntropyOps>(saved: Saved<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    let grad = B::float_cast(grad, FloatDType::F32);
    let n = grad.shape()[0];
    let smoothing = saved.smoothing;
    let out = B::cross_entropy_backward(
        saved.logits,
        saved.max,
        saved.sum_exp,
        saved.target,
        saved.in_range,
        grad.clone(),
        smoothing,
    );
    match saved.padding {
        Some(pad) if smoothing.epsilon > 0.0 => {
            let slices = [Slice::from(0..n), Slice::from(pad.clone())];
            let share = f64::from(smoothing.epsilon) / smoothing.global_vocab as f64;
            let give_back = B::float_expand(
                B::float_reshape(
                    B::float_mul_scalar(grad, Scalar::from(share)),
                    Shape::from([n, 1]),
                ),
                Shape::from([n, pad.len()]),
            );
            let dtype = out.dtype();
            let cols = B::float_slice(out.clone(), &slices);
            let cols = B::float_add(cols, B::float_cast(give_back, dtype.into()));
            B::float_slice_assign(out, &slices, cols)
        }
        _ => out,
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: CrossEntropyOps> Backward<B, 1> for CrossEntropyBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, backward::<B>(ops.state, grad));
        }
    }
}

impl<B: VocabParallelCrossEntropyOps, C: CheckpointStrategy> VocabParallelCrossEntropyOps
    for Autodiff<B, C>
{
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        smoothing: LabelSmoothing,
        comm: Comm,
    ) -> FloatTensor<Self> {
        let (logits, node) = logits.into_parts();
        let in_range = in_range.into_primitive();
        match CrossEntropyBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let saved = forward::<B>(logits, target, in_range, smoothing, &comm);
                let loss = saved.loss.clone();
                prep.finish(saved, loss)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(forward::<B>(logits, target, in_range, smoothing, &comm).loss)
            }
        }
    }
}
