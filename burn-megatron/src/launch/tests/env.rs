use crate::launch::env::*;

fn env(vars: &[(&str, &str)]) -> Result<LaunchEnv, EnvError> {
    LaunchEnv::from_vars(|k| {
        vars.iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v.to_string())
    })
}

fn ok(vars: &[(&str, &str)]) -> (Launcher, usize, usize, usize) {
    let e = env(vars).unwrap();
    (e.launcher, e.rank, e.world_size, e.local_rank)
}

#[test]
fn each_launcher_is_read() {
    let torchrun = [
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];
    assert_eq!(ok(&torchrun), (Launcher::Torchrun, 5, 8, 1));
    let master = env(&torchrun).unwrap().master.unwrap();
    assert_eq!((master.addr.as_str(), master.port), ("node0", 29500));
    let ompi = [
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ];
    assert_eq!(ok(&ompi), (Launcher::OpenMpi, 2, 4, 0));
    assert_eq!(env(&ompi).unwrap().master, None);
    let hydra = [
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("MPI_LOCALRANKID", "3"),
    ];
    assert_eq!(ok(&hydra), (Launcher::Pmi, 3, 4, 3));
    let pmi = [
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("PMI_LOCAL_RANK", "1"),
    ];
    assert_eq!(ok(&pmi), (Launcher::Pmi, 1, 2, 1));
    let slurm = [
        ("SLURM_PROCID", "7"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "3"),
    ];
    assert_eq!(ok(&slurm), (Launcher::Slurm, 7, 16, 3));
}

#[test]
fn the_innermost_launcher_wins() {
    // mpirun inside a Slurm allocation: srun's variables describe the allocation's task.
    let vars = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_LOCALID", "0"),
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
    ];
    assert_eq!(ok(&vars), (Launcher::OpenMpi, 3, 4, 3));
    // torchrun under srun.
    let vars = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("RANK", "6"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "1234"),
    ];
    assert_eq!(ok(&vars), (Launcher::Torchrun, 6, 8, 2));
}

#[test]
fn missing_and_bad_variables_are_named() {
    let msg = |vars: &[(&str, &str)]| env(vars).unwrap_err().to_string();
    let none = msg(&[("HOME", "/root")]);
    for var in ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"] {
        assert!(none.contains(var), "{none}");
    }
    assert_eq!(
        env(&[("RANK", "0")]).unwrap_err(),
        EnvError::Missing {
            launcher: Launcher::Torchrun,
            vars: vec!["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"],
        }
    );
    let m = msg(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]);
    assert!(
        m.contains("PMI launch: missing MPI_LOCALRANKID, PMI_LOCAL_RANK"),
        "{m}"
    );
    let ompi = |rank: &str, size: &str, local: &str| {
        msg(&[
            ("OMPI_COMM_WORLD_RANK", rank),
            ("OMPI_COMM_WORLD_SIZE", size),
            ("OMPI_COMM_WORLD_LOCAL_RANK", local),
        ])
    };
    let m = ompi("two", "4", "0");
    assert!(
        m.contains("OMPI_COMM_WORLD_RANK=\"two\" is not a non-negative integer"),
        "{m}"
    );
    let m = ompi("-1", "4", "0");
    assert!(m.contains("OMPI_COMM_WORLD_RANK=\"-1\""), "{m}");
    let m = ompi("4", "4", "0");
    assert!(
        m.contains("OMPI_COMM_WORLD_RANK=\"4\" is not below OMPI_COMM_WORLD_SIZE=4"),
        "{m}"
    );
    let m = ompi("0", "0", "0");
    assert!(
        m.contains("OMPI_COMM_WORLD_SIZE=\"0\" must be at least 1"),
        "{m}"
    );
    let m = ompi("1", "2", "2");
    assert!(
        m.contains("OMPI_COMM_WORLD_LOCAL_RANK=\"2\" is not below"),
        "{m}"
    );
    let m = msg(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "70000"),
    ]);
    assert!(
        m.contains("MASTER_PORT=\"70000\" is not a port number"),
        "{m}"
    );
}

#[test]
fn the_launch_is_refused_before_any_work() {
    use crate::launch::process::run_in;
    use crate::launch::{DistributedBackend, LaunchError, LaunchOptions};
    use crate::topology::ParallelConfig;
    let env = |world_size| {
        Ok(LaunchEnv {
            launcher: Launcher::OpenMpi,
            rank: 0,
            world_size,
            local_rank: 0,
            master: None,
        })
    };
    let mpi = LaunchOptions::default().with_backend(DistributedBackend::Mpi);
    let run = |env: Result<LaunchEnv, EnvError>, config: ParallelConfig, options: LaunchOptions| {
        run_in(env, &config, options, |_| -> Result<(), String> {
            panic!("no rank may start")
        })
        .unwrap_err()
    };
    let e = run(env(2), ParallelConfig::new(4, 2, 1), mpi.clone());
    assert!(
        matches!(e, LaunchError::Env(EnvError::WorldSize { .. })),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("Open MPI started 2 processes but the layout needs 4"),
        "{e}"
    );
    let e = run(env(4), ParallelConfig::new(4, 3, 1), mpi.clone());
    assert!(matches!(e, LaunchError::Topology(_)), "{e}");
    let e = run(
        env(4),
        ParallelConfig::new(4, 2, 1),
        LaunchOptions::default(),
    );
    assert!(e.to_string().contains("use launch::threads"), "{e}");
    #[cfg(not(feature = "mpi"))]
    {
        let e = run(env(4), ParallelConfig::new(4, 2, 1), mpi);
        assert!(e.to_string().contains("`mpi` feature"), "{e}");
    }
}

#[test]
fn the_nccl_backend_is_named_like_megatrons_flag_and_needs_the_cuda_feature() {
    use crate::launch::DistributedBackend;
    for b in [
        DistributedBackend::Threads,
        DistributedBackend::Mpi,
        DistributedBackend::Nccl,
    ] {
        assert_eq!(b.to_string().parse::<DistributedBackend>(), Ok(b));
    }
    let e = "gloo".parse::<DistributedBackend>().unwrap_err();
    assert!(e.contains("threads, mpi or nccl"), "{e}");
    #[cfg(not(feature = "cuda"))]
    {
        use crate::launch::LaunchOptions;
        use crate::launch::process::run_in;
        use crate::topology::ParallelConfig;
        let env = LaunchEnv {
            launcher: Launcher::Torchrun,
            rank: 0,
            world_size: 2,
            local_rank: 0,
            master: None,
        };
        let nccl = LaunchOptions::default().with_backend(DistributedBackend::Nccl);
        let e = run_in(
            Ok(env),
            &ParallelConfig::new(2, 2, 1),
            nccl,
            |_| -> Result<(), String> { panic!("no rank may start") },
        )
        .unwrap_err();
        assert!(e.to_string().contains("`cuda` feature"), "{e}");
    }
}
