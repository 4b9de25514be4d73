//! [`from_env`](super::from_env) on NCCL: where the unique ids come from, and the run.
//!
//! Under mpirun (Open MPI or a PMI launcher) with the `mpi` feature, MPI hands the ids
//! round. Otherwise rank 0 serves a [`TcpStore`](crate::comm::TcpStore) at `MASTER_ADDR`:
//! on `MASTER_PORT`, or on `MASTER_PORT + 1` under torchrun, whose agent already serves its
//! own store on `MASTER_PORT` (it says so with `TORCHELASTIC_USE_AGENT_STORE=True`). Rank 0
//! must run on `MASTER_ADDR`'s host, as it does under torchrun's static rendezvous.

use super::env::{LaunchEnv, Launcher};
#[cfg(feature = "cuda")]
use super::{LaunchError, LaunchOptions, RankContext};
#[cfg(feature = "cuda")]
use crate::topology::ParallelState;

/// The host and port of the rendezvous store, from the launch environment and torchrun's
/// `TORCHELASTIC_USE_AGENT_STORE`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn store_addr(
    env: &LaunchEnv,
    agent_store: Option<&str>,
) -> Result<(String, u16), String> {
    let Some(master) = &env.master else {
        return Err(format!(
            "the nccl backend needs MASTER_ADDR and MASTER_PORT (rank 0's host and a free port) \
             for its rendezvous{}",
            if matches!(env.launcher, Launcher::OpenMpi | Launcher::Pmi) {
                ", or burn-megatron built with the `mpi` feature to use MPI for it"
            } else {
                ""
            }
        ));
    };
    let port = if agent_store.is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        master.port.checked_add(1).ok_or_else(|| {
            "MASTER_PORT is 65535: torchrun's agent holds it, and there is no next port for \
             the nccl rendezvous"
                .to_string()
        })?
    } else {
        master.port
    };
    Ok((master.addr.clone(), port))
}

#[cfg(feature = "cuda")]
pub(crate) fn run_nccl<T, E: std::fmt::Display>(
    env: &LaunchEnv,
    state: ParallelState,
    options: &LaunchOptions,
    f: impl FnOnce(RankContext) -> Result<T, E>,
) -> Result<T, LaunchError<E>> {
    use super::panic_message;
    use crate::comm::nccl::{ABORT_CODE, Bootstrap, NcclWorld};
    use crate::comm::{TcpStore, World};
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;

    let rank = env.rank;
    let setup = |source| LaunchError::Comm { rank, source };
    #[cfg(feature = "mpi")]
    let mpi = if matches!(env.launcher, Launcher::OpenMpi | Launcher::Pmi) {
        let world = crate::comm::mpi::MpiWorld::init(options.timeout).map_err(setup)?;
        world.barrier();
        Some(world)
    } else {
        None
    };
    #[cfg(not(feature = "mpi"))]
    let mpi: Option<std::convert::Infallible> = None;
    let bootstrap = match &mpi {
        #[cfg(feature = "mpi")]
        Some(world) => Bootstrap::World(Arc::new(world.clone())),
        #[cfg(not(feature = "mpi"))]
        Some(never) => match *never {},
        None => {
            let agent = std::env::var("TORCHELASTIC_USE_AGENT_STORE").ok();
            let (host, port) = store_addr(env, agent.as_deref()).map_err(LaunchError::Backend)?;
            let store = if rank == 0 {
                TcpStore::serve(([0, 0, 0, 0], port).into())
            } else {
                TcpStore::connect(format!("{host}:{port}"), options.timeout)
            };
            Bootstrap::Store(store.map_err(|e| LaunchError::Backend(e.to_string()))?)
        }
    };
    let ordinal = device_ordinal(env.local_rank).map_err(LaunchError::Backend)?;
    let world =
        NcclWorld::new(ordinal, rank, env.world_size, bootstrap, options.timeout).map_err(setup)?;
    // More ranks than GPUs (a correctness run on one GPU): NCCL needs them on hosts of their
    // own. Every rank takes part, before any communicator exists.
    world.separate_shared_devices().map_err(setup)?;
    let device = options.device_or(rank, || burn::tensor::Device::cuda(ordinal).autodiff());
    let shared: Arc<dyn World> = Arc::new(world);
    // Once communicators exist a failing rank must end the job: its peers would wait for it.
    let fatal = |reason: String| -> ! {
        crate::comm::last_words(format_args!(
            "burn-megatron: global rank {rank}: {reason}; ending the job"
        ));
        #[cfg(feature = "mpi")]
        if let Some(world) = &mpi {
            world.abort(&reason);
        }
        std::process::exit(ABORT_CODE)
    };
    let ctx = RankContext::new(state, shared, device)
        .unwrap_or_else(|e| fatal(format!("communicator setup failed: {e}")));
    match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(Ok(v)) => {
            #[cfg(feature = "mpi")]
            if let Some(world) = mpi {
                world.finalize();
            }
            Ok(v)
        }
        Ok(Err(e)) => fatal(format!("failed: {e}")),
        Err(payload) => fatal(format!("panicked: {}", panic_message(payload.as_ref()))),
    }
}

/// A rank's CUDA device: its local rank's, or with more local ranks than devices, the local
/// rank modulo the devices (ranks then share them; see
/// [`NcclWorld::separate_shared_devices`](crate::comm::nccl::NcclWorld::separate_shared_devices)).
#[cfg(feature = "cuda")]
fn device_ordinal(local_rank: usize) -> Result<usize, String> {
    use cudarc::driver::result;
    if !crate::cuda::cuda_libraries().driver {
        return Err("the nccl backend needs the CUDA driver (libcuda), not found here".into());
    }
    result::init().map_err(|e| format!("the CUDA driver failed to start: {e:?}"))?;
    let count = result::device::get_count().map_err(|e| format!("counting CUDA devices: {e:?}"))?;
    match usize::try_from(count) {
        Ok(n) if n > 0 => Ok(local_rank % n),
        _ => Err("the nccl backend needs a CUDA device; the driver sees none".into()),
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn run_nccl<T, E>(
    _: &LaunchEnv,
    _: crate::topology::ParallelState,
    _: &super::LaunchOptions,
    _: impl FnOnce(super::RankContext) -> Result<T, E>,
) -> Result<T, super::LaunchError<E>> {
    Err(super::LaunchError::Backend(
        "the nccl backend needs burn-megatron built with the `cuda` feature".into(),
    ))
}

#[cfg(test)]
mod tests;
