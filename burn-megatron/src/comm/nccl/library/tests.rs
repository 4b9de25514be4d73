use super::*;

/// A library that is not there is an error naming it, what to do, and the variable.
#[test]
fn a_missing_library_is_an_error_saying_where_to_look() {
    let missing = "/nonexistent/burn-megatron/libnccl.so.2";
    let e = load(&[missing.into()])
        .err()
        .expect("nothing is loaded from a missing path");
    assert!(e.contains(missing), "{e}");
    assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
    assert!(e.contains(crate::cuda::NCCL_LIBRARY_VAR), "{e}");
}

/// A library that loads but is not NCCL is refused by the first entry point it lacks.
#[test]
fn a_library_without_ncclgetversion_is_refused() {
    let e = load(&["libc.so.6".into()]).err().expect("libc is not NCCL");
    assert!(e.contains("libc.so.6 has no ncclGetVersion"), "{e}");
}

/// The probe that reports the libraries and the loader agree: NCCL is usable exactly where
/// it is reported found, and a loaded NCCL answers its version (2.18 or newer has
/// `ncclGetLastError`, which the loader requires).
#[test]
fn the_probe_and_the_loader_agree() {
    let found = crate::cuda::cuda_libraries().nccl;
    match nccl() {
        Ok(nccl) => {
            assert!(found, "loaded {} but the probe did not find it", nccl.name);
            let v = nccl.version().expect("ncclGetVersion");
            assert!(v >= 21800, "NCCL {v}");
            eprintln!("loaded {} (NCCL {v})", nccl.name);
        }
        Err(e) => {
            assert!(!found, "the probe found NCCL, the loader did not: {e}");
            eprintln!("no NCCL here: {e}");
        }
    }
}
