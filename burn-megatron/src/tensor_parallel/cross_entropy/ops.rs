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
/// rank's slice, else 0. Returns `[N]` f32 losses.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait VocabParallelCrossEntropyOps: CrossEntropyOps {
    /// See the trait documentation.
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        label_smoothing: f32,
        comm: Comm,
    ) -> FloatTensor<Self>;
}

impl VocabParallelCrossEntropyOps for Flex {
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        label_smoothing: f32,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(logits, target, in_range, label_smoothing, &comm).loss
    }
}

#[cfg(feature = "cube")]
impl VocabParallelCrossEntropyOps for burn::backend::Cube {
    fn vocab_parallel_cross_entropy_loss(
        logits: FloatTensor<Self>,
        target: IntTensor<Self>,
        in_range: FloatTensor<Self>,
        label_smoothing: f32,
        comm: Comm,
    ) -> FloatTensor<Self> {
        forward::<Self>(logits, target, in_range, label_smoothing, &comm).loss
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
    label_smoothing: f32,
    comm: &Comm,
) -> Saved<B> {
    let dims = logits.shape().to_vec();
    let (n, local_vocab) = (dims[0], dims[1]);
    let global_vocab = local_vocab * comm.group().size();
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
    let [sum_exp, predicted, sum_logits, owned] = all_reduce_many::<B, 4>(
        [local_sum_exp, column(2), column(3), in_range.clone()],
        ReduceOp::Sum,
        comm,
    );
    // Shifted by the global max: z_t − M where some rank owns the target (`owned` is 1),
    // and Σ_v (z_v − M) over the global vocabulary.
    let predicted = B::float_sub(predicted, B::float_mul(max.clone(), owned));
    let sum_logits = B::float_sub(
        sum_logits,
        B::float_mul_scalar(max.clone(), Scalar::from(global_vocab as f64)),
    );

    // (1 − ε)·(lse − z_t) + ε·(lse − mean_k z_k), the mean over the *global* vocabulary
    // (z shifted by the row max, which cancels).
    let lse = B::float_log(sum_exp.clone());
    let nll = B::float_sub(lse.clone(), predicted);
    let loss = if label_smoothing > 0.0 {
        let mean = B::float_mul_scalar(sum_logits, Scalar::from(1.0 / global_vocab as f64));
        let smooth = B::float_sub(lse, mean);
        B::float_add(
            B::float_mul_scalar(nll, Scalar::from(1.0 - f64::from(label_smoothing))),
            B::float_mul_scalar(smooth, Scalar::from(f64::from(label_smoothing))),
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
        smoothing: LabelSmoothing {
            epsilon: label_smoothing,
            global_vocab,
        },
    }
}

/// `(softmax − (1 − ε)·one_hot − ε / V) · grad`, in the logits' dtype: one fused op.
fn backward<B: CrossEntropyOps>(saved: Saved<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    let grad = B::float_cast(grad, FloatDType::F32);
    B::cross_entropy_backward(
        saved.logits,
        saved.max,
        saved.sum_exp,
        saved.target,
        saved.in_range,
        grad,
        saved.smoothing,
    )
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
        label_smoothing: f32,
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
                let saved = forward::<B>(logits, target, in_range, label_smoothing, &comm);
                let loss = saved.loss.clone();
                prep.finish(saved, loss)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(forward::<B>(logits, target, in_range, label_smoothing, &comm).loss)
            }
        }
    }
}
