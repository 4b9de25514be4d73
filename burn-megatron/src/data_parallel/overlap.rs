//! Data-parallel reduction overlapped with backward.
//!
//! Burn has no per-parameter gradient hooks, so [`OverlapReducer::attach`] makes them: every
//! parameter of a copy of the model passes through an identity op whose backward hands the
//! parameter's gradient to a per-rank communication thread. A bucket's all-reduce starts as
//! soon as its last gradient arrives, while backward goes on with earlier layers; buckets are
//! issued in the same order on every rank. [`OverlapReducer::finish`] waits for the last
//! buckets and returns the reduced gradients, keyed by the original `ParamId`s. Gradients
//! are reduced in f32 and come back in the parameter's dtype.

use super::{DataParallelConfig, bucket_layout};
use crate::comm::tensor::{buffer_to_tensor, data_to_buffer};
use crate::comm::{Buffer, Comm, CommDType, CommError, ReduceOp};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Tensor, try_read_sync};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

enum Msg {
    Grad(usize, Buffer),
    Done,
}

/// Where parameter `index`'s gradient goes when backward reaches it.
#[derive(Clone)]
pub struct GradSink {
    index: usize,
    tx: Arc<Mutex<Sender<Msg>>>,
}

impl std::fmt::Debug for GradSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GradSink({})", self.index)
    }
}

/// Identity forward; the backward delivers the gradient to a [`GradSink`].
#[backend_extension(Flex, Autodiff)]
pub trait GradHookOps: Backend {
    /// See the trait documentation.
    fn grad_hook(x: FloatTensor<Self>, sink: GradSink) -> FloatTensor<Self>;
}

impl GradHookOps for Flex {
    fn grad_hook(x: FloatTensor<Self>, _sink: GradSink) -> FloatTensor<Self> {
        x
    }
}

#[derive(Debug)]
struct HookBackward;

impl<B: Backend> Backward<B, 1> for HookBackward {
    type State = GradSink;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = B::float_cast(grads.consume::<B>(&ops.node), FloatDType::F32);
        let data = try_read_sync(B::float_into_data(grad))
            .expect("synchronous reads are supported on this platform")
            .unwrap_or_else(|e| panic!("grad_hook: reading the gradient failed: {e:?}"));
        let buf = data_to_buffer(data).unwrap_or_else(|e| panic!("grad_hook: {e}"));
        // A send error means the reducer was dropped: nobody wants the gradient.
        let tx = ops.state.tx.lock().unwrap_or_else(|e| e.into_inner());
        let _ = tx.send(Msg::Grad(ops.state.index, buf));
    }
}

impl<B: GradHookOps, C: CheckpointStrategy> GradHookOps for Autodiff<B, C> {
    fn grad_hook(x: FloatTensor<Self>, sink: GradSink) -> FloatTensor<Self> {
        let (primitive, node) = x.into_parts();
        match HookBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(sink, primitive),
            OpsKind::UnTracked(prep) => prep.finish(primitive),
        }
    }
}

/// Shape, dtype and device of each float parameter, in visiting order.
struct Layout(Vec<(ParamId, Vec<usize>, DType, Device)>);

impl ModuleVisitor for Layout {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let v = p.val();
        self.0
            .push((p.id, v.dims().to_vec(), v.dtype(), v.device()));
    }
}

struct Hook<'a> {
    next: usize,
    tx: &'a Arc<Mutex<Sender<Msg>>>,
}

impl ModuleMapper for Hook<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, t, mapper) = p.consume();
        let sink = GradSink {
            index: self.next,
            tx: self.tx.clone(),
        };
        self.next += 1;
        let hooked = Tensor::from_dispatch(Dispatch::grad_hook(t.into_dispatch(), sink));
        Param::from_mapped_value(id, hooked, mapper)
    }
}

type Worker = JoinHandle<Result<Vec<Option<Buffer>>, CommError>>;

/// Runs a model's backward with its data-parallel gradient reduction overlapped.
///
/// ```ignore
/// let mut reducer = OverlapReducer::new(&model, dp.clone(), DataParallelConfig::default());
/// let hooked = reducer.attach(&model);   // same parameters, hooked
/// forward(&hooked).backward();           // buckets reduce while this runs
/// let grads = reducer.finish()?;         // averaged over the DP group
/// model = optim.step(lr, model, grads);
/// ```
pub struct OverlapReducer {
    layout: Vec<(ParamId, Vec<usize>, DType, Device)>,
    buckets: Arc<Vec<Vec<usize>>>,
    dp: Comm,
    op: ReduceOp,
    pending: Option<(Arc<Mutex<Sender<Msg>>>, Worker)>,
}

impl std::fmt::Debug for OverlapReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OverlapReducer")
            .field("params", &self.layout.len())
            .field("buckets", &self.buckets.len())
            .finish_non_exhaustive()
    }
}

impl OverlapReducer {
    /// Plans the buckets of `model`'s parameters for the data-parallel group `dp`.
    pub fn new<M: Module>(model: &M, dp: Comm, config: &DataParallelConfig) -> Self {
        let mut layout = Layout(Vec::new());
        model.visit(&mut layout);
        let numels: Vec<usize> = layout
            .0
            .iter()
            .map(|(_, d, _, _)| d.iter().product())
            .collect();
        let buckets = bucket_layout(&numels, config.bucket_elements(dp.group().size()));
        Self {
            layout: layout.0,
            buckets: Arc::new(buckets),
            dp,
            op: if config.average {
                ReduceOp::Avg
            } else {
                ReduceOp::Sum
            },
            pending: None,
        }
    }

    /// Number of buckets (collectives per step).
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// A copy of `model` whose parameters report their gradients to this reducer; run the
    /// forward and backward on it, then call [`finish`](Self::finish).
    pub fn attach<M: Module>(&mut self, model: &M) -> M {
        let (tx, rx) = channel();
        let tx = Arc::new(Mutex::new(tx));
        let numels: Vec<usize> = self
            .layout
            .iter()
            .map(|(_, d, _, _)| d.iter().product())
            .collect();
        let (buckets, dp, op) = (self.buckets.clone(), self.dp.clone(), self.op);
        let worker = std::thread::spawn(move || {
            let n = numels.len();
            let mut bucket_of = vec![0; n];
            for (b, members) in buckets.iter().enumerate() {
                for &i in members {
                    bucket_of[i] = b;
                }
            }
            let mut got: Vec<Option<Buffer>> = vec![None; n];
            let mut missing: Vec<usize> = buckets.iter().map(|b| b.len()).collect();
            let mut out: Vec<Option<Buffer>> = vec![None; n];
            let (mut next, mut done) = (0, false);
            while next < buckets.len() {
                if !done {
                    match rx.recv() {
                        Ok(Msg::Grad(i, buf)) => {
                            if got[i].replace(buf).is_none() {
                                missing[bucket_of[i]] -= 1;
                            }
                        }
                        Ok(Msg::Done) | Err(_) => done = true,
                    }
                }
                // Issue complete buckets strictly in order, so every rank agrees; at the end,
                // parameters that got no gradient contribute zeros.
                while next < buckets.len() && (missing[next] == 0 || done) {
                    let parts: Vec<Buffer> = buckets[next]
                        .iter()
                        .map(|&i| {
                            got[i]
                                .take()
                                .unwrap_or_else(|| Buffer::zeros(CommDType::F32, numels[i]))
                        })
                        .collect();
                    let mut flat = Buffer::concat(CommDType::F32, &parts);
                    dp.all_reduce(&mut flat, op)?;
                    let mut at = 0;
                    for &i in &buckets[next] {
                        out[i] = Some(flat.slice(at..at + numels[i]));
                        at += numels[i];
                    }
                    next += 1;
                }
            }
            Ok(out)
        });
        let hooked = model.clone().map(&mut Hook { next: 0, tx: &tx });
        self.pending = Some((tx, worker));
        hooked
    }

    /// Waits for the remaining buckets and returns the reduced gradients of the attached
    /// model's parameters (by their original ids), in each parameter's dtype.
    pub fn finish(&mut self) -> Result<GradientsParams, CommError> {
        let (tx, worker) = self
            .pending
            .take()
            .ok_or_else(|| CommError::InvalidArgument {
                group: self.dp.group().to_string(),
                op: "finish",
                reason: "finish called without attach".into(),
            })?;
        let _ = tx.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Done);
        let reduced = worker
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        let mut grads = GradientsParams::new();
        for ((id, dims, dtype, device), buf) in self.layout.iter().zip(reduced) {
            let Some(buf) = buf else { continue };
            let flat: Tensor<1> = buffer_to_tensor(buf, [dims.iter().product()], device);
            let flat = flat.cast(*dtype);
            match dims.len() {
                1 => grads.register::<1>(*id, flat),
                2 => grads.register::<2>(*id, flat.reshape([dims[0], dims[1]])),
                3 => grads.register::<3>(*id, flat.reshape([dims[0], dims[1], dims[2]])),
                _ => grads.register::<4>(*id, flat.reshape([dims[0], dims[1], dims[2], dims[3]])),
            }
        }
        Ok(grads)
    }
}
