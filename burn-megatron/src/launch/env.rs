//! Rank, world size and local rank from the variables a launcher sets.
//!
//! Four launchers are recognised. When several have set variables (mpirun inside a Slurm
//! allocation, torchrun under srun), the innermost one wins, which is the first of:
//!
//! | launcher | rank | world size | local rank | also |
//! |---|---|---|---|---|
//! | torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `MASTER_ADDR`, `MASTER_PORT` |
//! | Open MPI's mpirun | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | |
//! | MPICH / PMI | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` or `PMI_LOCAL_RANK` | |
//! | Slurm's srun | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | |
//!
//! A launcher counts as present when its rank variable is set; then all its variables must
//! be, and hold numbers that make sense, or the error names the ones that do not.

use std::fmt;

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// PyTorch's `torchrun` (or anything that sets its variables).
    Torchrun,
    /// Open MPI's `mpirun` / `mpiexec`.
    OpenMpi,
    /// MPICH's Hydra, or another PMI launcher.
    Pmi,
    /// Slurm's `srun`.
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "PMI",
            Launcher::Slurm => "Slurm",
        })
    }
}

/// The rendezvous address torchrun publishes (`MASTER_ADDR`, `MASTER_PORT`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterAddr {
    /// Host name or address of rank 0.
    pub addr: String,
    /// Its port.
    pub port: u16,
}

/// Where this process sits in the job, as its launcher says.
///
/// ```
/// use burn_megatron::launch::{LaunchEnv, Launcher};
/// let vars = [("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4"),
///             ("OMPI_COMM_WORLD_LOCAL_RANK", "1")];
/// let env = LaunchEnv::from_vars(|k| {
///     vars.iter().find(|(name, _)| *name == k).map(|(_, v)| v.to_string())
/// })
/// .unwrap();
/// assert_eq!((env.launcher, env.rank, env.world_size, env.local_rank),
///            (Launcher::OpenMpi, 3, 4, 1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher whose variables were read.
    pub launcher: Launcher,
    /// Global rank of this process.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes on this node (the GPU index, conventionally).
    pub local_rank: usize,
    /// torchrun's rendezvous address, when set.
    pub master: Option<MasterAddr>,
}

/// Why the launch environment cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// No launcher's rank variable is set.
    #[error(
        "no launcher found: none of RANK (torchrun), OMPI_COMM_WORLD_RANK (mpirun), PMI_RANK \
         (MPICH/PMI), SLURM_PROCID (srun) is set; start the job with one of them"
    )]
    NoLauncher,
    /// The launcher was recognised but some of its variables are missing.
    #[error("{launcher} launch: missing {}", vars.join(", "))]
    Missing {
        /// The launcher.
        launcher: Launcher,
        /// The variables that are not set.
        vars: Vec<&'static str>,
    },
    /// A variable holds something unusable.
    #[error("{launcher} launch: {var}={value:?} {reason}")]
    Invalid {
        /// The launcher.
        launcher: Launcher,
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The launcher started another number of processes than the layout has ranks.
    #[error(
        "{launcher} started {launched} processes but the layout needs {layout} \
         (tensor × pipeline × data parallel sizes)"
    )]
    WorldSize {
        /// The launcher.
        launcher: Launcher,
        /// Processes started.
        launched: usize,
        /// Ranks of the layout.
        layout: usize,
    },
}

struct Vars {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    /// Candidates for the local rank, the first set one wins.
    local: &'static [&'static str],
}

const LAUNCHERS: [Vars; 4] = [
    Vars {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local: &["LOCAL_RANK"],
    },
    Vars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local: &["OMPI_COMM_WORLD_LOCAL_RANK"],
    },
    Vars {
        launcher: Launcher::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
    },
    Vars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local: &["SLURM_LOCALID"],
    },
];

impl LaunchEnv {
    /// Reads this process's environment.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (the process environment in
    /// [`from_env`](Self::from_env); a table in tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let vars = LAUNCHERS
            .iter()
            .find(|v| get(v.rank).is_some())
            .ok_or(EnvError::NoLauncher)?;
        let launcher = vars.launcher;
        let local_var = vars.local.iter().copied().find(|k| get(k).is_some());
        let mut missing: Vec<&'static str> = [vars.size]
            .into_iter()
            .filter(|k| get(k).is_none())
            .collect();
        if local_var.is_none() {
            missing.extend(vars.local);
        }
        let master = [
            ("MASTER_ADDR", get("MASTER_ADDR")),
            ("MASTER_PORT", get("MASTER_PORT")),
        ];
        if launcher == Launcher::Torchrun {
            missing.extend(master.iter().filter(|(_, v)| v.is_none()).map(|(k, _)| *k));
        }
        if !missing.is_empty() {
            return Err(EnvError::Missing {
                launcher,
                vars: missing,
            });
        }
        let number = |var: &'static str| -> Result<usize, EnvError> {
            let value = get(var).unwrap_or_default();
            value.trim().parse().map_err(|_| EnvError::Invalid {
                launcher,
                var,
                value,
                reason: "is not a non-negative integer".into(),
            })
        };
        let invalid = |var: &'static str, reason: String| EnvError::Invalid {
            launcher,
            var,
            value: get(var).unwrap_or_default(),
            reason,
        };
        let (rank, world_size) = (number(vars.rank)?, number(vars.size)?);
        let local_var = local_var.expect("checked above");
        let local_rank = number(local_var)?;
        if world_size == 0 {
            return Err(invalid(vars.size, "must be at least 1".into()));
        }
        if rank >= world_size {
            return Err(invalid(
                vars.rank,
                format!("is not below {}={world_size}", vars.size),
            ));
        }
        if local_rank >= world_size {
            return Err(invalid(
                local_var,
                format!("is not below {}={world_size}", vars.size),
            ));
        }
        let master = match master {
            [(_, Some(addr)), (_, Some(port))] => Some(MasterAddr {
                port: port
                    .trim()
                    .parse()
                    .map_err(|_| invalid("MASTER_PORT", "is not a port number (0-65535)".into()))?,
                addr,
            }),
            _ => None,
        };
        Ok(Self {
            launcher,
            rank,
            world_size,
            local_rank,
            master,
        })
    }
}
