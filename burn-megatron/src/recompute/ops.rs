//! The recomputed region as a Burn backend extension: forward hands on the output of the
//! region's untracked first forward; backward runs the region's forward again on a graph of
//! its own, backpropagates the incoming gradient through it, and registers the gradients of
//! the region's input and parameters in the outer backward.
//!
//! Burn lets a backward step run an inner backward as long as the inner graph shares no
//! node with the outer one (the outer graph stays locked meanwhile): the replay therefore
//! runs on fresh leaves (a detached copy of the input, the parameters re-leafed), and the
//! parameters' gradients are registered under the original leaves' node ids.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, TensorMetadata, backend_extension};
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// What the replay of a region returns to its backward step (all untracked).
pub struct Replayed {
    /// The gradient of the region's input (`None`: the input is untracked or unused).
    pub input_grad: Option<DispatchTensor>,
    /// Each trained parameter's original value (the outer graph's leaf) and its gradient.
    pub params: Vec<(DispatchTensor, DispatchTensor)>,
}

type ReplayFn = Box<dyn FnOnce(DispatchTensor) -> Replayed + Send>;

/// A region's replay, run at most once, by the backward step.
#[derive(Clone)]
pub struct Region(Arc<Mutex<Option<ReplayFn>>>);

impl Region {
    pub(crate) fn new(replay: ReplayFn) -> Self {
        Self(Arc::new(Mutex::new(Some(replay))))
    }

    fn replay(&self, grad: DispatchTensor) -> Replayed {
        let replay = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("Burn runs each backward step once, and a region's graph holds one step");
        replay(grad)
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Region")
    }
}

/// Recomputed regions (activation recomputation).
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait RecomputeOps: Backend {
    /// Returns `output` (the region's untracked result), tracked with `input` and `anchor`
    /// (a trained parameter, so that the region is tracked when its input is not) as
    /// parents; in backward, `region` runs again to produce their gradients.
    fn recompute_region(
        output: FloatTensor<Self>,
        input: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        region: Region,
    ) -> FloatTensor<Self>;

    /// A zero scalar (`[1]`) whose backward hands `grad` to `tensor` as its gradient:
    /// backward from it is backward from `tensor` with the incoming gradient `grad` (as
    /// PyTorch's `tensor.backward(grad)`), without forming `Σ tensor ⊙ grad` and its
    /// gradient. `grad` has `tensor`'s shape and dtype.
    fn gradient_sink(tensor: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The sink's forward value on a plain backend.
fn zero_scalar<B: Backend>(tensor: &FloatTensor<B>) -> FloatTensor<B> {
    B::float_zeros([1].into(), &tensor.device(), tensor.dtype().into())
}

impl RecomputeOps for Flex {
    fn gradient_sink(tensor: FloatTensor<Self>, _: FloatTensor<Self>) -> FloatTensor<Self> {
        zero_scalar::<Self>(&tensor)
    }

    fn recompute_region(
        output: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: Region,
    ) -> FloatTensor<Self> {
        output
    }
}

#[cfg(feature = "cube")]
impl RecomputeOps for burn::backend::Cube {
    fn gradient_sink(tensor: FloatTensor<Self>, _: FloatTensor<Self>) -> FloatTensor<Self> {
        zero_scalar::<Self>(&tensor)
    }

    fn recompute_region(
        output: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: Region,
    ) -> FloatTensor<Self> {
        output
    }
}

struct RegionBackward<C>(PhantomData<C>);

impl<C> std::fmt::Debug for RegionBackward<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RegionBackward")
    }
}

/// An untracked tensor of the region's replay, as `B`'s primitive.
fn primitive<B: Backend>(tensor: DispatchTensor) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(tensor)
        .expect("a region's gradients live on the backend its output came from")
        .float()
}

impl<B, C> Backward<B, 2> for RegionBackward<C>
where
    B: Backend,
    C: CheckpointStrategy,
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    type State = Region;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [input, _anchor] = ops.parents;
        // The incoming gradient, untracked but in the region's autodiff context (its
        // checkpointing strategy included), so that the replay can multiply it in.
        let grad = <Autodiff<B, C> as AutodiffBackend>::from_inner(grads.consume::<B>(&ops.node));
        let grad = <DispatchTensor as DispatchKindConversion<Autodiff<B, C>>>::from_backend(
            BackendTensor::Float(grad),
        );
        let replayed = ops.state.replay(grad);
        if let (Some(input), Some(g)) = (input, replayed.input_grad) {
            grads.register::<B>(input.id, primitive::<B>(g));
        }
        for (leaf, g) in replayed.params {
            let leaf =
                <DispatchTensor as DispatchKindConversion<Autodiff<B, C>>>::try_into_backend(leaf)
                    .expect("a region's parameters are tracked on the backend of its output")
                    .float();
            grads.register::<B>(leaf.id(), primitive::<B>(g));
        }
    }
}

#[derive(Debug)]
struct SinkBackward;

impl<B: Backend> Backward<B, 1> for SinkBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        // The incoming gradient (ones) is dropped: `state` is the tensor's gradient.
        let _ = grads.consume::<B>(&ops.node);
        if let [Some(tensor)] = ops.parents {
            grads.register::<B>(tensor.id, ops.state);
        }
    }
}

impl<B: RecomputeOps, C: CheckpointStrategy> RecomputeOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    fn gradient_sink(tensor: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let grad = grad.into_primitive();
        let (_, node) = tensor.clone().into_parts();
        let out = zero_scalar::<B>(&tensor.into_primitive());
        match SinkBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(grad, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn recompute_region(
        output: FloatTensor<Self>,
        input: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        region: Region,
    ) -> FloatTensor<Self> {
        let output = output.into_primitive();
        let (_, input) = input.into_parts();
        let (_, anchor) = anchor.into_parts();
        match RegionBackward::<C>(PhantomData)
            .prepare::<C>([input, anchor])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(region, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}
