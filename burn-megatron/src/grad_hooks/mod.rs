//! Gradient-ready hooks: the mechanism the parallel layers and the overlapped data-parallel
//! reduction meet in, below both.
//!
//! A layer wraps each of its parameters with [`hook_param`] in forward. While a sink is
//! active on the thread ([`activate`]), the wrapped parameter carries a hook in the autodiff
//! graph, and backward hands its gradient to the sink as soon as the op consuming the
//! parameter has produced it. Parameters a live sink has claimed ([`claim`]) but used while
//! no sink is active are hooked too, only to count their gradients: the sink can then tell
//! that a micro-batch ran without it (its gradients would otherwise be lost silently).

mod ops;

pub use ops::GradHookOps;

use burn::backend::Dispatch;
use burn::module::{Param, ParamId};
use burn::tensor::Tensor;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Gradient work that keeps pace with a chunk's backwards (Megatron's `grad_sync_func`):
/// the data-parallel `OverlapReducer` implements it, so its bucket reductions start during
/// the chunk's last backward instead of after the whole schedule.
pub trait GradSync {
    /// Entered around each forward and backward of one model chunk and left when the
    /// returned guard drops; `last` once the chunk's final forward of the step has started,
    /// so that the backwards that follow complete its gradients.
    fn enter(&self, last: bool) -> Box<dyn std::any::Any>;
}

/// Where hooked gradients go.
pub(crate) trait GradSink: Send + Sync + std::fmt::Debug {
    /// Forward, with this sink active: whether to hook `id` (a parameter it reduces), the
    /// use counted when `count` (a recomputed region counts its uses in its first forward
    /// and hooks them when it runs again in backward).
    fn hook(&self, id: ParamId, count: bool) -> bool;
    /// Backward of a parameter hooked while this sink was active: its gradient, flat,
    /// untracked and in its own dtype, where backward left it (nothing is read back).
    /// Returns whether the sink keeps it: Burn's gradients then get no copy of it (as
    /// Megatron's `param.grad` stays empty once the main gradient has it), so it is held
    /// once, not twice, until the step's reduction writes the result back.
    fn deliver(&self, id: ParamId, grad: Tensor<1>) -> bool;
    /// Backward of a parameter this sink claimed, hooked while no sink was active.
    fn deliver_inactive(&self, id: ParamId);
}

thread_local! {
    static ACTIVE: RefCell<Option<Arc<dyn GradSink>>> = const { RefCell::new(None) };
    static PHASE: RefCell<Phase> = const { RefCell::new(Phase::Normal) };
}

/// Which forward of a recomputed region is running on this thread.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Not inside a recomputed region.
    #[default]
    Normal,
    /// The region's first forward, untracked: its activations are dropped. The parameters
    /// it detached (those that train) count a use with the active sink, so that a reducer
    /// knows a gradient is still to come.
    Discard(HashSet<ParamId>),
    /// The region's forward again, in backward: its hooks deliver the uses counted before.
    Replay,
}

/// Restores the previous phase on drop.
#[derive(Debug)]
pub(crate) struct PhaseGuard(Option<Phase>);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.0.take() {
            PHASE.with(|p| *p.borrow_mut() = previous);
        }
    }
}

/// Runs this thread in `phase` until the guard drops.
pub(crate) fn enter_phase(phase: Phase) -> PhaseGuard {
    PhaseGuard(Some(
        PHASE.with(|p| std::mem::replace(&mut *p.borrow_mut(), phase)),
    ))
}

/// Whether this thread runs the first, discarded forward of a recomputed region.
pub(crate) fn in_discard() -> bool {
    PHASE.with(|p| matches!(*p.borrow(), Phase::Discard(_)))
}

/// Which live sinks claimed each parameter (several when ranks of one process share
/// parameter ids, e.g. a model loaded from one checkpoint).
type Claims = HashMap<ParamId, Vec<Weak<dyn GradSink>>>;

/// The claims of every live sink, keyed by parameter.
static CLAIMS: Mutex<Option<Claims>> = Mutex::new(None);
/// Number of live claims: with none, [`hook_param`] outside a sink costs one atomic load.
static CLAIMED: AtomicUsize = AtomicUsize::new(0);

fn claims() -> std::sync::MutexGuard<'static, Option<Claims>> {
    CLAIMS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A sink's claim on its parameters, released on drop.
#[derive(Debug)]
pub(crate) struct Claim {
    sink: Weak<dyn GradSink>,
    ids: Vec<ParamId>,
}

/// Claims `ids` for `sink`: their gradients computed while no sink is active on the thread
/// are reported to it ([`GradSink::deliver_inactive`]).
pub(crate) fn claim(sink: &Arc<dyn GradSink>, ids: Vec<ParamId>) -> Claim {
    let weak = Arc::downgrade(sink);
    let mut claims = claims();
    let map = claims.get_or_insert_with(HashMap::new);
    for id in &ids {
        map.entry(*id).or_default().push(weak.clone());
    }
    CLAIMED.fetch_add(1, Ordering::SeqCst);
    Claim { sink: weak, ids }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claims = claims();
        if let Some(map) = claims.as_mut() {
            for id in &self.ids {
                if let Some(sinks) = map.get_mut(id) {
                    sinks.retain(|s| !Weak::ptr_eq(s, &self.sink));
                    if sinks.is_empty() {
                        map.remove(id);
                    }
                }
            }
        }
        CLAIMED.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The live sinks that claimed `id`.
fn claimants(id: ParamId) -> Vec<Arc<dyn GradSink>> {
    if CLAIMED.load(Ordering::SeqCst) == 0 {
        return Vec::new();
    }
    claims()
        .as_ref()
        .and_then(|map| map.get(&id))
        .map(|sinks| sinks.iter().filter_map(Weak::upgrade).collect())
        .unwrap_or_default()
}

/// Where a hook reports.
#[derive(Clone)]
enum Target {
    /// The sink active when the parameter was used: it gets the gradient.
    Active(Arc<dyn GradSink>),
    /// No sink was active; these claimed the parameter and are told a gradient came.
    Inactive(Vec<Arc<dyn GradSink>>),
}

/// A parameter's gradient-ready hook, carried in the autodiff graph.
#[derive(Clone)]
pub struct Hook {
    target: Target,
    id: ParamId,
}

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let active = matches!(self.target, Target::Active(_));
        f.debug_struct("Hook")
            .field("param", &self.id)
            .field("active", &active)
            .finish()
    }
}

impl Hook {
    /// Reports the gradient; `flat` runs only if a sink takes it. Returns whether the sink
    /// kept it (see [`GradSink::deliver`]): the caller then registers no gradient.
    fn deliver(&self, flat: impl FnOnce() -> Tensor<1>) -> bool {
        match &self.target {
            Target::Active(sink) => sink.deliver(self.id, flat()),
            Target::Inactive(sinks) => {
                sinks.iter().for_each(|s| s.deliver_inactive(self.id));
                false
            }
        }
    }
}

/// `param`'s value, wrapped in a gradient-ready hook anchored at `anchor` (the layer's input)
/// when the parameter is trained and a sink (an `OverlapReducer`) is active on this thread
/// or has claimed it.
pub fn hook_param<const D: usize, const E: usize>(
    param: &Param<Tensor<D>>,
    anchor: &Tensor<E>,
) -> Tensor<D> {
    let value = param.val();
    // `None` in a discarded forward: whether it counts a use instead of hooking.
    let (discarded, count) = PHASE.with(|p| match &*p.borrow() {
        Phase::Discard(trained) => (Some(trained.contains(&param.id)), false),
        Phase::Replay => (None, false),
        Phase::Normal => (None, true),
    });
    if let Some(trained) = discarded {
        if trained && let Some(sink) = ACTIVE.with(|a| a.borrow().clone()) {
            sink.hook(param.id, true);
        }
        return value;
    }
    if !value.is_require_grad() {
        return value;
    }
    let target = match ACTIVE.with(|a| a.borrow().clone()) {
        Some(sink) => {
            if !sink.hook(param.id, count) {
                return value;
            }
            Target::Active(sink)
        }
        None => {
            let sinks = claimants(param.id);
            if sinks.is_empty() {
                return value;
            }
            Target::Inactive(sinks)
        }
    };
    let hook = Hook {
        target,
        id: param.id,
    };
    Tensor::from_dispatch(Dispatch::grad_ready_hook(
        value.into_dispatch(),
        anchor.clone().into_dispatch(),
        hook,
    ))
}

/// Delivers `grad`, the gradient of `param` that a recomputed region's replay formed itself
/// (a product, not a hooked value's backward), to the sink that would have hooked it: the
/// use was counted in the region's first forward, as [`hook_param`] counts it. Returns
/// whether the sink kept it (the region then pairs no gradient with the parameter).
pub(crate) fn deliver_formed<const D: usize>(param: &Param<Tensor<D>>, grad: &Tensor<D>) -> bool {
    if !param.is_require_grad() {
        return false;
    }
    let target = match ACTIVE.with(|a| a.borrow().clone()) {
        Some(sink) => {
            if !sink.hook(param.id, false) {
                return false;
            }
            Target::Active(sink)
        }
        None => {
            let sinks = claimants(param.id);
            if sinks.is_empty() {
                return false;
            }
            Target::Inactive(sinks)
        }
    };
    let hook = Hook {
        target,
        id: param.id,
    };
    hook.deliver(|| {
        let n = grad.shape().num_elements();
        grad.clone().inner().reshape([n])
    })
}

/// Keeps a sink active on this thread; dropping it deactivates.
#[derive(Debug)]
pub struct ActiveGuard(());

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.borrow_mut().take());
    }
}

/// Makes `sink` this thread's active sink until the guard drops.
pub(crate) fn activate(sink: Arc<dyn GradSink>) -> ActiveGuard {
    ACTIVE.with(|a| *a.borrow_mut() = Some(sink));
    ActiveGuard(())
}
