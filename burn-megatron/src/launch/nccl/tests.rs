use super::*;
use crate::launch::MasterAddr;

fn env(launcher: Launcher, master: Option<(&str, u16)>) -> LaunchEnv {
    LaunchEnv {
        launcher,
        rank: 1,
        world_size: 2,
        local_rank: 1,
        master: master.map(|(addr, port)| MasterAddr {
            addr: addr.into(),
            port,
        }),
    }
}

#[test]
fn the_store_is_on_master_port_or_the_next_one_under_torchruns_agent() {
    let e = env(Launcher::Slurm, Some(("node0", 29500)));
    assert_eq!(store_addr(&e, None).unwrap(), ("node0".into(), 29500));
    assert_eq!(
        store_addr(&e, Some("False")).unwrap(),
        ("node0".into(), 29500)
    );
    let t = env(Launcher::Torchrun, Some(("node0", 29500)));
    assert_eq!(
        store_addr(&t, Some("True")).unwrap(),
        ("node0".into(), 29501)
    );
    let full = env(Launcher::Torchrun, Some(("node0", 65535)));
    assert!(
        store_addr(&full, Some("True"))
            .unwrap_err()
            .contains("65535")
    );
}

#[test]
fn without_master_addr_the_error_says_what_to_set() {
    let e = store_addr(&env(Launcher::Slurm, None), None).unwrap_err();
    assert!(e.contains("MASTER_ADDR and MASTER_PORT"), "{e}");
    assert!(!e.contains("mpi"), "{e}");
    let e = store_addr(&env(Launcher::OpenMpi, None), None).unwrap_err();
    assert!(e.contains("`mpi` feature"), "{e}");
}
