//! Run one closure per rank: as threads of this process ([`threads`]), or once in each
//! process of a job started by mpirun, srun or torchrun ([`from_env`]).
//!
//! Each rank gets a [`RankContext`]: its [`ParallelState`], a communicator on each of its
//! groups, and its own Burn device. The model code is the same under both.
//!
//! # Ranks must not share autodiff-tracked tensors
//!
//! Burn's autodiff merges the graphs of tensors that meet in one operation, under one lock.
//! If two rank threads touch the same tracked tensor (a parameter built once and cloned into
//! every rank, say), their graphs merge, and the first collective inside backward waits for
//! a peer that is blocked on that lock: a deadlock. Each rank must build (or load) its own
//! parameters inside the closure, from the same seed where they must agree. Plain data
//! (`TensorData`, `Vec`s, configs) may be shared freely.

mod context;
mod env;
mod nccl;
mod process;

pub use context::{RankContext, RankGroups};
pub use env::{EnvError, LaunchEnv, Launcher, MasterAddr};
pub use process::{DistributedBackend, from_env};

use crate::comm::{CommError, LocalWorld, World};
use crate::topology::{ParallelConfig, ParallelState, TopologyError};
use burn::tensor::Device;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How [`threads`] runs the ranks.
#[derive(Clone)]
pub struct LaunchOptions {
    /// Bound on every collective (default 300 s).
    pub timeout: Duration,
    /// The device of each global rank. Default: `Device::flex().autodiff()`, except under
    /// NCCL, where it is `Device::cuda(local_rank).autodiff()` (NCCL's GPU for the rank).
    pub device: Option<std::sync::Arc<dyn Fn(usize) -> Device + Send + Sync>>,
    /// Stack size of each rank thread, in bytes (default 32 MiB: deep autodiff graphs
    /// recurse in backward).
    pub stack_size: usize,
    /// The engine [`from_env`] starts (ignored by [`threads`]).
    pub backend: DistributedBackend,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        Self {
            timeout: crate::comm::DEFAULT_TIMEOUT,
            device: None,
            stack_size: 32 << 20,
            backend: DistributedBackend::default(),
        }
    }
}

impl LaunchOptions {
    /// These options with another collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with the engine [`from_env`] starts.
    pub fn with_backend(mut self, backend: DistributedBackend) -> Self {
        self.backend = backend;
        self
    }

    /// These options with a device chosen per global rank.
    pub fn with_device(mut self, device: impl Fn(usize) -> Device + Send + Sync + 'static) -> Self {
        self.device = Some(std::sync::Arc::new(device));
        self
    }

    /// The device of global rank `rank`, or `default` when none was chosen.
    pub(crate) fn device_or(&self, rank: usize, default: impl FnOnce() -> Device) -> Device {
        self.device.as_ref().map_or_else(default, |d| d(rank))
    }
}

impl fmt::Debug for LaunchOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaunchOptions")
            .field("timeout", &self.timeout)
            .field("stack_size", &self.stack_size)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// Why a launch failed. A failing rank aborts the world, so its peers fail too; the error
/// returned is the first failure, with its rank.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError<E> {
    /// The layout is invalid; no rank was started.
    #[error("invalid parallel layout: {0}")]
    Topology(#[from] TopologyError),
    /// The launch environment does not describe this job; nothing was started.
    #[error("launch environment: {0}")]
    Env(#[from] EnvError),
    /// The communication engine is unavailable or disagrees with the launcher.
    #[error("distributed backend: {0}")]
    Backend(String),
    /// Setting up a rank's communicators failed.
    #[error("rank {rank}: communicator setup failed: {source}")]
    Comm {
        /// The global rank.
        rank: usize,
        /// What failed.
        source: CommError,
    },
    /// A rank's closure returned an error.
    #[error("rank {rank} failed: {error}")]
    Failed {
        /// The global rank.
        rank: usize,
        /// The closure's error.
        error: E,
    },
    /// A rank's closure panicked.
    #[error("rank {rank} panicked: {message}")]
    Panicked {
        /// The global rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
}

enum Outcome<T, E> {
    Done(T),
    Failed(E),
    Panicked(String),
    Setup(CommError),
}

/// Runs `f` on every rank of `config` as threads of this process and returns each rank's
/// result in global rank order, or the first failure (panics included) with its rank.
///
/// The layout is validated before any thread starts.
///
/// ```
/// # // ANCHOR: first_look
/// use burn_megatron::comm::{CommunicatorExt, ReduceOp};
/// use burn_megatron::launch::{self, LaunchOptions};
/// use burn_megatron::topology::ParallelConfig;
///
/// let config = ParallelConfig::new(4, 2, 1); // world 4, tp 2, pp 1 → dp 2
/// let out = launch::threads(&config, LaunchOptions::default(), |ctx| {
///     let mut v = vec![ctx.state.tensor_model_parallel_rank() as i64];
///     ctx.groups.tp.all_reduce_vec(&mut v, ReduceOp::Sum)?;
///     Ok::<_, burn_megatron::comm::CommError>(v[0])
/// })
/// .unwrap();
/// assert_eq!(out, vec![1, 1, 1, 1]);
/// # // ANCHOR_END: first_look
/// ```
pub fn threads<T, E, F>(
    config: &ParallelConfig,
    options: LaunchOptions,
    f: F,
) -> Result<Vec<T>, LaunchError<E>>
where
    T: Send,
    E: fmt::Display + Send,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    let config = config.clone().validate()?;
    let world_size = config.world_size();
    let states: Vec<ParallelState> = (0..world_size)
        .map(|rank| ParallelState::new(&config, rank))
        .collect::<Result<_, _>>()?;
    let world = LocalWorld::with_timeout(world_size, options.timeout);
    let outcomes: Vec<Mutex<Option<Outcome<T, E>>>> =
        (0..world_size).map(|_| Mutex::new(None)).collect();

    std::thread::scope(|scope| {
        for (rank, state) in states.into_iter().enumerate() {
            let (world, f, options, slot) = (&world, &f, &options, &outcomes[rank]);
            let run = move || {
                let shared: Arc<dyn World> = Arc::new(world.clone());
                let outcome = match RankContext::new(state, shared, options.device_or(rank, flex)) {
                    Err(e) => Outcome::Setup(e),
                    Ok(ctx) => match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
                        Ok(Ok(v)) => Outcome::Done(v),
                        Ok(Err(e)) => Outcome::Failed(e),
                        Err(payload) => Outcome::Panicked(panic_message(payload.as_ref())),
                    },
                };
                match &outcome {
                    Outcome::Done(_) => world.mark_exited(rank),
                    Outcome::Failed(e) => world.abort(rank, e.to_string()),
                    Outcome::Panicked(m) => world.abort(rank, format!("panicked: {m}")),
                    Outcome::Setup(e) => world.abort(rank, e.to_string()),
                }
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
            };
            std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .stack_size(options.stack_size)
                .spawn_scoped(scope, run)
                .expect("spawning a rank thread");
        }
    });

    let mut outcomes: Vec<Outcome<T, E>> = outcomes
        .into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("every rank thread records its outcome")
        })
        .collect();
    if let Some((first, _)) = world.failure() {
        return Err(match outcomes.swap_remove(first) {
            Outcome::Failed(error) => LaunchError::Failed { rank: first, error },
            Outcome::Panicked(message) => LaunchError::Panicked {
                rank: first,
                message,
            },
            Outcome::Setup(source) => LaunchError::Comm {
                rank: first,
                source,
            },
            Outcome::Done(_) => unreachable!("a rank that aborted the world did not succeed"),
        });
    }
    Ok(outcomes
        .into_iter()
        .map(|o| match o {
            Outcome::Done(v) => v,
            _ => unreachable!("no failure was recorded"),
        })
        .collect())
}

fn flex() -> Device {
    Device::flex().autodiff()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

#[cfg(test)]
mod tests;
