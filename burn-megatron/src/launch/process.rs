//! One process per rank: [`from_env`] reads the launcher's variables, starts the engine and
//! runs the closure once, in this process.

use super::env::{EnvError, LaunchEnv};
use super::{LaunchError, LaunchOptions, RankContext};
use crate::topology::{ParallelConfig, ParallelState};
use std::fmt;
use std::str::FromStr;

/// What carries the ranks' messages (Megatron's `--distributed-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DistributedBackend {
    /// Every rank a thread of one process ([`threads`](super::threads)).
    #[default]
    Threads,
    /// One process per rank over MPI (feature `mpi`).
    Mpi,
    /// One process per GPU over NCCL (feature `cuda`).
    Nccl,
}

impl fmt::Display for DistributedBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DistributedBackend::Threads => "threads",
            DistributedBackend::Mpi => "mpi",
            DistributedBackend::Nccl => "nccl",
        })
    }
}

impl FromStr for DistributedBackend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "threads" => Ok(Self::Threads),
            "mpi" => Ok(Self::Mpi),
            "nccl" => Ok(Self::Nccl),
            _ => Err(format!(
                "unknown distributed backend {s:?}: expected threads, mpi or nccl"
            )),
        }
    }
}

/// Runs `f` once, as the rank of `config` this process is, in a job of one process per rank
/// started by mpirun, srun or torchrun (see [`LaunchEnv`] for the variables read and which
/// launcher wins). Everything is checked before any communication: the layout, the launch
/// variables, the world size against `config`'s and, for MPI, against MPI's own.
///
/// Pre-launch failures are returned (every process meets the same ones). Once the ranks
/// communicate, a rank whose closure fails or panics prints the error with its rank and ends
/// the whole job, since its peers would otherwise wait for it: under MPI that is
/// `MPI_Abort`, and this function does not return.
///
/// ```no_run
/// use burn_megatron::launch::{DistributedBackend, LaunchOptions, from_env};
/// use burn_megatron::topology::ParallelConfig;
/// // mpirun -np 4 ./train
/// let options = LaunchOptions::default().with_backend(DistributedBackend::Mpi);
/// let loss = from_env(&ParallelConfig::new(4, 2, 1), options, |ctx| {
///     Ok::<_, String>(ctx.state.global_rank())
/// });
/// ```
pub fn from_env<T, E, F>(
    config: &ParallelConfig,
    options: LaunchOptions,
    f: F,
) -> Result<T, LaunchError<E>>
where
    E: fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E>,
{
    run_in(LaunchEnv::from_env(), config, options, f)
}

/// [`from_env`] for the launch environment `env` (read, or why it could not be).
pub(crate) fn run_in<T, E, F>(
    env: Result<LaunchEnv, EnvError>,
    config: &ParallelConfig,
    options: LaunchOptions,
    f: F,
) -> Result<T, LaunchError<E>>
where
    E: fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E>,
{
    // A bad layout is reported before a bad environment.
    let config = config.clone().validate()?;
    let env = env?;
    check_world_size(&env, config.world_size())?;
    let state = ParallelState::new(&config, env.rank)?;
    match options.backend {
        DistributedBackend::Threads => Err(LaunchError::Backend(
            "the threads backend runs every rank in this process: use launch::threads, or \
             choose mpi for one process per rank"
                .into(),
        )),
        DistributedBackend::Mpi => run_mpi(&env, state, &options, f),
        DistributedBackend::Nccl => super::nccl::run_nccl(&env, state, &options, f),
    }
}

/// The launcher's world size must be the layout's.
fn check_world_size(env: &LaunchEnv, world_size: usize) -> Result<(), EnvError> {
    if env.world_size != world_size {
        return Err(EnvError::WorldSize {
            launcher: env.launcher,
            launched: env.world_size,
            layout: world_size,
        });
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn run_mpi<T, E: fmt::Display>(
    env: &LaunchEnv,
    state: ParallelState,
    options: &LaunchOptions,
    f: impl FnOnce(RankContext) -> Result<T, E>,
) -> Result<T, LaunchError<E>> {
    use super::panic_message;
    use crate::comm::World;
    use crate::comm::mpi::MpiWorld;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let world = MpiWorld::init(options.timeout).map_err(|source| LaunchError::Comm {
        rank: env.rank,
        source,
    })?;
    if (world.rank(), world.size()) != (env.rank, env.world_size) {
        return Err(LaunchError::Backend(format!(
            "MPI sees rank {} of {}, the {} variables say rank {} of {}: was this process \
             started by another launcher than mpirun/srun?",
            world.rank(),
            world.size(),
            env.launcher,
            env.rank,
            env.world_size
        )));
    }
    let rank = env.rank;
    // Group creation cannot be bounded in MPI: start it only once every process is here.
    world.barrier();
    let device = options.device_or(rank, super::flex);
    let shared: std::sync::Arc<dyn World> = std::sync::Arc::new(world.clone());
    let ctx = match RankContext::new(state, shared, device) {
        Ok(ctx) => ctx,
        Err(source) => world.abort(&source),
    };
    match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(Ok(v)) => {
            world.finalize();
            Ok(v)
        }
        Ok(Err(e)) => world.abort(&format!("failed: {e}")),
        Err(payload) => world.abort(&format!("panicked: {}", panic_message(payload.as_ref()))),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi<T, E>(
    _: &LaunchEnv,
    _: ParallelState,
    _: &LaunchOptions,
    _: impl FnOnce(RankContext) -> Result<T, E>,
) -> Result<T, LaunchError<E>> {
    Err(LaunchError::Backend(
        "the mpi backend needs burn-megatron built with the `mpi` feature".into(),
    ))
}
