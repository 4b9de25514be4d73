//! The stand-in must track the cubecl it stands in for. A cubecl upgrade either moves
//! `cubecl-cuda` to a version this crate was not written against (its API may have changed:
//! update the stand-in, then its version), or leaves the patch unused so that the real
//! `cubecl-llvm` and its LLVM download come back. Either fails here, loudly.

/// `(name, version, source)` of every package in the workspace's lock file.
fn locked() -> Vec<(String, String, Option<String>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock");
    let text = std::fs::read_to_string(path).expect("the workspace's Cargo.lock");
    text.split("[[package]]")
        .skip(1)
        .map(|block| {
            let field = |key: &str| {
                block.lines().find_map(|l| {
                    let v = l.strip_prefix(key)?.trim().strip_prefix('=')?.trim();
                    Some(v.trim_matches('"').to_string())
                })
            };
            let name = field("name").expect("a package name");
            let version = field("version").expect("a package version");
            (name, version, field("source"))
        })
        .collect()
}

#[test]
fn the_stand_in_matches_the_locked_cubecl_cuda_and_is_the_one_used() {
    let packages = locked();
    let version = env!("CARGO_PKG_VERSION");
    let cuda: Vec<_> = packages.iter().filter(|p| p.0 == "cubecl-cuda").collect();
    assert!(!cuda.is_empty(), "cubecl-cuda is no longer in Cargo.lock");
    for (_, v, _) in &cuda {
        assert_eq!(
            v, version,
            "cubecl-cuda {v} is locked, the cubecl-llvm stand-in was written for {version}: check \
             what cubecl-cuda {v} uses of cubecl-llvm, update cubecl-llvm-stub, then its version"
        );
    }
    let llvm: Vec<_> = packages.iter().filter(|p| p.0 == "cubecl-llvm").collect();
    assert_eq!(llvm.len(), 1, "one cubecl-llvm in Cargo.lock: {llvm:?}");
    assert_eq!(
        llvm[0].2, None,
        "the locked cubecl-llvm comes from a registry: the [patch.crates-io] stand-in is unused, \
         and the real crate downloads LLVM at build time"
    );
    for gone in ["llvm-sys", "tracel-llvm-bundler"] {
        assert!(
            packages.iter().all(|p| p.0 != gone),
            "{gone} is in Cargo.lock: something else pulls LLVM in"
        );
    }
}

/// The one thing the stand-in does at run time: refuse to compile, saying why.
#[test]
fn the_llvm_backend_refuses_with_the_reason() {
    assert!(cubecl_llvm::NO_LLVM.contains("cuda-cpp"));
    assert_eq!(
        cubecl_llvm::nvptx::ptx_version::PtxVersion::for_driver(12080),
        None
    );
}
