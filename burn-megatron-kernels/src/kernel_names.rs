//! Every CubeCL kernel of the crate has a name of its own: CubeCL's profiler names kernels by
//! their function alone, so two `forward_kernel`s in different modules would be one row of
//! the GPU bench's profile table (`scripts/gpu_bench.py`), in the wrong group.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("the crate's sources are readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `(kernel name, file)` of every `#[cube(launch…)]` function under `dir`.
fn kernels(dir: &Path) -> Vec<(String, String)> {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a readable source");
        let mut pending = false;
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with("#[cube(launch") {
                pending = true;
            } else if pending && let Some(at) = line.find("fn ") {
                let name: String = line[at + 3..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                found.push((name, file.display().to_string()));
                pending = false;
            }
        }
    }
    found
}

#[test]
fn every_kernel_name_is_unique() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = kernels(&src);
    // The scan finds the kernels (about thirty), or the test would pass on nothing.
    assert!(
        found.len() >= 25,
        "only {} kernels found: {found:?}",
        found.len()
    );
    let mut by_name: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, file) in &found {
        by_name.entry(name).or_default().push(file);
    }
    let repeated: Vec<_> = by_name
        .iter()
        .filter(|(_, files)| files.len() > 1)
        .collect();
    assert!(repeated.is_empty(), "kernel names used twice: {repeated:?}");
}
