//! The vocab-parallel cross-entropy as a backend extension with a handwritten backward.

use super::super::mappings::host::all_reduce_many;
use crate::comm::{Comm, ReduceOp};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Flex, Scalar, TensorMetadata, backend_extension};
use burn::tensor::ops::IndexingUpdateOp;
use burn::tensor::{DType, FloatDType, Shape};

/// Loss of each token given this rank's slice of the logits.
///
/// `logits`: `[N, V / tp]`; `target`: `[N]`, this rank's local column of each target (any
/// value where the target lies elsewhere); `in_range`: `[N]`, 1 where the target lies in this
/// rank's slice, else 0. Returns `[N]` f32 losses.
#[backend_extension(Flex, Autodiff)]
pub trait VocabParallelCrossEntropyOps: Backend {
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

/// What the forward leaves for the backward.
#[derive(Debug, Clone)]
pub(crate) struct Saved<B: Backend> {
    loss: FloatTensor<B>,
    /// Local softmax over the global vocabulary, f32, `[N, V / tp]`.
    softmax: FloatTensor<B>,
    /// `[N, 1]` local target columns.
    target: IntTensor<B>,
    /// `[N, 1]` 1 where the target is in this slice.
    in_range: FloatTensor<B>,
    dtype: DType,
    label_smoothing: f32,
    global_vocab: usize,
}

/// The three all-reduces: row max; (predicted logit, sum of logits) packed in one; sum of exps.
pub(crate) fn forward<B: Backend>(
    logits: FloatTensor<B>,
    target: IntTensor<B>,
    in_range: FloatTensor<B>,
    label_smoothing: f32,
    comm: &Comm,
) -> Saved<B> {
    let dtype = logits.dtype();
    let dims = logits.shape().to_vec();
    let (n, local_vocab) = (dims[0], dims[1]);
    let global_vocab = local_vocab * comm.group().size();
    let logits = B::float_cast(logits, FloatDType::F32);
    let in_range = B::float_reshape(
        B::float_cast(in_range, FloatDType::F32),
        Shape::from([n, 1]),
    );
    let target = B::int_reshape(target, Shape::from([n, 1]));

    let max = B::float_max_dim(logits.clone(), 1);
    let [max] = all_reduce_many::<B, 1>([max], ReduceOp::Max, comm);
    let shifted = B::float_sub(logits, max);

    let predicted = B::float_mul(
        B::float_gather(1, shifted.clone(), target.clone()),
        in_range.clone(),
    );
    let sum_logits = B::float_sum_dim(shifted.clone(), 1);
    let [predicted, sum_logits] =
        all_reduce_many::<B, 2>([predicted, sum_logits], ReduceOp::Sum, comm);

    let exp = B::float_exp(shifted);
    let sum_exp = B::float_sum_dim(exp.clone(), 1);
    let [sum_exp] = all_reduce_many::<B, 1>([sum_exp], ReduceOp::Sum, comm);

    // (1 − ε)·(lse − z_t) + ε·(lse − mean_k z_k), the mean over the *global* vocabulary.
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
        loss: B::float_reshape(loss, Shape::from([n])),
        softmax: B::float_div(exp, sum_exp),
        target,
        in_range,
        dtype,
        label_smoothing,
        global_vocab,
    }
}

/// `(softmax − (1 − ε)·one_hot − ε / V) · grad`, in the logits' dtype.
fn backward<B: Backend>(saved: Saved<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    let n = saved.loss.shape()[0];
    let eps = f64::from(saved.label_smoothing);
    let hot = B::float_mul_scalar(saved.in_range, Scalar::from(1.0 - eps));
    let mut g = B::float_scatter(
        1,
        saved.softmax,
        saved.target,
        B::float_neg(hot),
        IndexingUpdateOp::Add,
    );
    if eps > 0.0 {
        g = B::float_sub_scalar(g, Scalar::from(eps / saved.global_vocab as f64));
    }
    let grad = B::float_reshape(B::float_cast(grad, FloatDType::F32), Shape::from([n, 1]));
    B::float_cast(B::float_mul(g, grad), FloatDType::from(saved.dtype))
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: Backend> Backward<B, 1> for CrossEntropyBackward {
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
