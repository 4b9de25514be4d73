//! 10,000 seeded random corruptions of two small checkpoints (TP 2 with the fused Adam,
//! and one rank in bf16 with AdamW), each fed to the loader. A corruption that changes
//! anything the loader reads must be an error; one that changes nothing it means
//! (whitespace in `metadata.json`, a file swapped with an identical one, a number replaced
//! by itself) must load the same state; none may panic.
//!
//! What counts as a change: every byte of a data file, index or `metadata.json` is covered
//! by a size and a CRC-32 (which catches every single-bit flip). Edits to an index *with*
//! its seal recomputed (a crafted checkpoint) are limited to what the loader must check:
//! the layout's TP and PP sizes, the ranks, the format, the iteration, the optimizer kind,
//! every tensor entry's set, name, file and geometry, and the file table. The descriptive
//! fields (the data-parallel size, the caller's `extra`, parameter ids, a burn-optim step
//! count) are trusted once sealed: changing them is a different checkpoint, not a corrupt
//! one.

use super::{fresh, optimizer_for, reseal, save, step, tmp, values};
use crate::checkpoint::advanced::*;
use crate::checkpoint::*;
use crate::optimizer::MegatronOptimizer;
use burn::nn::Linear;
use burn::tensor::DType;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use serde_json::Value;
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

/// What a corruption is allowed to do.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Expect {
    Error,
    Identical,
    ErrorOrIdentical,
}

struct Fixture {
    root: PathBuf,
    iter: PathBuf,
    rank: CheckpointRank<'static>,
    fused: bool,
    dtype: DType,
    /// Every file the loader reads, by path, as saved.
    pristine: BTreeMap<PathBuf, Vec<u8>>,
    /// The loaded weights, and the weights one step later (the optimizer state's witness).
    reference: (Vec<f32>, Vec<f32>),
}

impl Fixture {
    fn new(name: &str, tp: usize, dtype: DType, fused: bool) -> Self {
        let root = tmp(name);
        let (model, mut optim) = fresh(1, dtype, fused);
        let model = step(model, &mut optim, 0);
        let rank = |r: usize| CheckpointRank {
            layout: super::layout(tp),
            tensor_model_parallel_rank: r,
            pipeline_model_parallel_rank: 0,
            expert_model_parallel_rank: 0,
            share: crate::checkpoint::SaveShare::ALL,
            names: &|p: &str| p.to_string(),
        };
        if tp == 1 {
            save(&root, 1, &model, &optim);
        } else {
            begin_checkpoint(&root, 1).unwrap();
            for r in 0..tp {
                save_checkpoint(&root, 1, &rank(r), &model, &optim, Value::Null).unwrap();
            }
            commit_checkpoint(&root, 1).unwrap();
        }
        let iter = iteration_dir(&root, 1);
        let index = CheckpointIndex::read(&iter).unwrap();
        let mut paths = vec![iter.join(METADATA)];
        for (d, r) in &index.ranks {
            paths.push(d.join("index.json"));
            paths.extend(r.files.keys().map(|f| d.join(f)));
        }
        let pristine = paths
            .into_iter()
            .map(|p| {
                let b = std::fs::read(&p).unwrap();
                (p, b)
            })
            .collect();
        let mut f = Self {
            root,
            iter,
            rank: rank(0),
            fused,
            dtype,
            pristine,
            reference: (Vec::new(), Vec::new()),
        };
        let (model, mut optim) = f.load().unwrap();
        let next = step(model.clone(), &mut optim, 1);
        f.reference = (values(&model), values(&next));
        f
    }

    fn load(&self) -> Result<(Linear, MegatronOptimizer<Linear>), CheckpointError> {
        let fused = self.fused;
        let r = load_checkpoint(
            &self.root,
            1,
            &self.rank,
            fresh(2, self.dtype, fused).0,
            |m| Ok(optimizer_for(fused)(m)),
            true,
        )?;
        Ok((r.model, r.optimizer))
    }

    fn restore(&self) {
        for (p, b) in &self.pristine {
            if std::fs::read(p).ok().as_deref() != Some(b.as_slice()) {
                std::fs::write(p, b).unwrap();
            }
        }
    }

    fn files(&self) -> Vec<&PathBuf> {
        self.pristine.keys().collect()
    }
}

/// The JSON pointers of an index's fields a crafted edit may change (see the module docs).
fn editable(v: &Value, at: String, out: &mut Vec<String>) {
    let checked = |p: &str| {
        let parts: Vec<&str> = p.split('/').skip(1).collect();
        matches!(
            parts.as_slice(),
            ["format"]
                | [
                    "layout",
                    "tensor_model_parallel_size" | "pipeline_model_parallel_size"
                ]
                | ["tensor_model_parallel_rank" | "pipeline_model_parallel_rank"]
                | ["state", "iteration" | "fused_adam_steps"]
                | ["tensors", _]
                | [
                    "tensors",
                    _,
                    "set" | "name" | "file" | "global_shape" | "offset" | "shape"
                ]
                | ["tensors", _, "global_shape" | "offset" | "shape", _]
                | ["files", _]
                | ["files", _, "bytes" | "crc32"]
                | ["iteration"]
                | ["indexes", _]
                | ["indexes", _, "bytes" | "crc32"]
        )
    };
    if checked(&at) {
        out.push(at.clone());
    }
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                editable(x, format!("{at}/{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                editable(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// A random edit of the field at `pointer`.
fn mutate(doc: &mut Value, pointer: &str, rng: &mut ChaCha8Rng) {
    let strings = [
        "",
        "model",
        "exp_avg",
        "weight",
        "bias",
        "x",
        "../index.json",
    ];
    let numbers = [0u64, 1, 2, 3, 7, 1 << 32, 1 << 40, 1 << 63, u64::MAX];
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let target = doc.pointer_mut(pointer).unwrap();
    match target {
        Value::Number(n) => {
            let v = n.as_u64().unwrap_or(0);
            *target = match rng.random_range(0..5) {
                0 => Value::from(v.wrapping_add(1)),
                1 => Value::from(v.saturating_sub(1)),
                2 => Value::from(numbers[rng.random_range(0..numbers.len())]),
                3 => Value::from(rng.random::<u64>()),
                _ => Value::from(-1.5),
            };
        }
        Value::String(s) => {
            *target = match rng.random_range(0..3) {
                0 => Value::from(format!("{s}x")),
                1 => Value::from(strings[rng.random_range(0..strings.len())]),
                _ => Value::from(1),
            };
        }
        Value::Array(a) if rng.random_bool(0.5) && !a.is_empty() => {
            a.pop();
        }
        Value::Array(a) => a.push(Value::from(rng.random_range(0..4u64))),
        Value::Null => *target = Value::from(rng.random_range(0..4u64)),
        _ => {
            // An entry of `tensors`, `files` or `indexes`: removed, or renamed.
            match doc.pointer_mut(parent).unwrap() {
                Value::Array(a) => {
                    a.remove(key.parse::<usize>().unwrap());
                }
                Value::Object(m) => {
                    let v = m.remove(key).unwrap();
                    m.insert(format!("{key}x"), v);
                }
                _ => unreachable!("a pointer's parent holds it"),
            }
        }
    }
}

/// `text` with spaces and newlines added between tokens (outside strings).
fn respace(text: &str, rng: &mut ChaCha8Rng) -> String {
    let mut out = String::new();
    let mut in_string = false;
    let mut escaped = false;
    for c in text.chars() {
        out.push(c);
        if in_string {
            escaped = !escaped && c == '\\';
            in_string = escaped || c != '"';
            continue;
        }
        in_string = c == '"';
        if matches!(c, ',' | ':' | '[' | '{') && rng.random_bool(0.3) {
            out.push_str([" ", "\n", "\t ", "  \n"][rng.random_range(0..4)]);
        }
    }
    out
}

/// One random corruption of `f`'s files; what it may do.
fn corrupt(f: &Fixture, rng: &mut ChaCha8Rng) -> (&'static str, Expect) {
    let files = f.files();
    let pick = |rng: &mut ChaCha8Rng| files[rng.random_range(0..files.len())].clone();
    let is_json = |p: &Path| p.extension().is_some_and(|e| e == "json");
    let indexes: Vec<&PathBuf> = files
        .iter()
        .copied()
        .filter(|p| p.ends_with("index.json"))
        .collect();
    match rng.random_range(0..8) {
        0 => {
            let p = pick(rng);
            let mut b = f.pristine[&p].clone();
            let i = rng.random_range(0..b.len());
            b[i] ^= 1 << rng.random_range(0..8);
            std::fs::write(&p, b).unwrap();
            ("bit flip", Expect::Error)
        }
        1 => {
            let p = pick(rng);
            let b = &f.pristine[&p];
            std::fs::write(&p, &b[..rng.random_range(0..b.len())]).unwrap();
            ("truncation", Expect::Error)
        }
        2 => {
            let (a, b) = (pick(rng), pick(rng));
            let (x, y) = (&f.pristine[&a], &f.pristine[&b]);
            std::fs::write(&a, y).unwrap();
            std::fs::write(&b, x).unwrap();
            let same = x == y;
            (
                "swapped files",
                if same {
                    Expect::Identical
                } else {
                    Expect::Error
                },
            )
        }
        3 => {
            std::fs::remove_file(pick(rng)).unwrap();
            ("deleted file", Expect::Error)
        }
        4 | 5 => {
            // A crafted index (or metadata.json), sealed again.
            let metadata = rng.random_bool(0.2);
            let p = if metadata {
                f.iter.join(METADATA)
            } else {
                indexes[rng.random_range(0..indexes.len())].clone()
            };
            let doc: Value = serde_json::from_slice(&f.pristine[&p]).unwrap();
            let mut fields = Vec::new();
            editable(&doc, String::new(), &mut fields);
            let mut edited = doc.clone();
            mutate(&mut edited, &fields[rng.random_range(0..fields.len())], rng);
            std::fs::write(&p, serde_json::to_vec_pretty(&edited).unwrap()).unwrap();
            if !metadata {
                reseal(&f.iter);
            }
            let what = if metadata {
                "metadata.json edit"
            } else {
                "sealed index edit"
            };
            (
                what,
                if edited == doc {
                    Expect::Identical
                } else {
                    Expect::Error
                },
            )
        }
        6 => {
            // Whitespace: meaningless in metadata.json; sealed in an index unless resealed.
            let p = files
                .iter()
                .copied()
                .filter(|p| is_json(p))
                .collect::<Vec<_>>();
            let p = p[rng.random_range(0..p.len())].clone();
            let text = String::from_utf8(f.pristine[&p].clone()).unwrap();
            let spaced = respace(&text, rng);
            std::fs::write(&p, &spaced).unwrap();
            let changed = spaced != text;
            if p.ends_with(METADATA) || !changed {
                ("whitespace", Expect::Identical)
            } else if rng.random_bool(0.5) {
                reseal(&f.iter);
                ("whitespace, sealed", Expect::Identical)
            } else {
                ("whitespace in an index", Expect::Error)
            }
        }
        _ => {
            // A data file's safetensors header edited, its index entry and seal redone.
            let data: Vec<&PathBuf> = files.iter().copied().filter(|p| !is_json(p)).collect();
            let p = data[rng.random_range(0..data.len())].clone();
            let mut b = f.pristine[&p].clone();
            let header = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let i = rng.random_range(0..header.min(b.len()));
            b[i] ^= 1 << rng.random_range(0..8);
            std::fs::write(&p, &b).unwrap();
            let index_path = p.parent().unwrap().join("index.json");
            let mut index: RankIndex = serde_json::from_slice(&f.pristine[&index_path]).unwrap();
            let name = p.file_name().unwrap().to_str().unwrap();
            index.files.insert(
                name.to_string(),
                FileEntry {
                    bytes: b.len() as u64,
                    crc32: crc32fast::hash(&b),
                },
            );
            std::fs::write(&index_path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
            reseal(&f.iter);
            ("sealed safetensors header edit", Expect::ErrorOrIdentical)
        }
    }
}

#[test]
fn ten_thousand_random_corruptions_are_errors_or_identical_loads_never_panics() {
    let fixtures = [
        Fixture::new("fuzz-tp2", 2, DType::F32, true),
        Fixture::new("fuzz-bf16", 1, DType::BF16, false),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let mut tally: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut failures = Vec::new();
    const CASES: usize = 10_000;
    for case in 0..CASES {
        let f = &fixtures[case % fixtures.len()];
        let (what, expect) = corrupt(f, &mut rng);
        let verified = catch_unwind(AssertUnwindSafe(|| verify_checkpoint(&f.root, 1)));
        let loaded = catch_unwind(AssertUnwindSafe(|| {
            f.load().map(|(model, mut optim)| {
                let next = step(model.clone(), &mut optim, 1);
                (values(&model), values(&next))
            })
        }));
        let outcome = match (&verified, &loaded) {
            (Err(_), _) | (_, Err(_)) => "panic",
            (Ok(v), Ok(Ok(state))) if *state == f.reference => {
                if v.is_ok() {
                    "identical"
                } else {
                    "verify refused an identical load"
                }
            }
            (Ok(_), Ok(Ok(_))) => "loaded other values",
            (Ok(Ok(_)), Ok(Err(_))) => "error (load only)",
            (Ok(Err(_)), Ok(Err(_))) => "error",
        };
        let fine = match expect {
            // The optimizer kind and the model's shapes are for the loader to check.
            Expect::Error => matches!(outcome, "error" | "error (load only)"),
            Expect::Identical => outcome == "identical",
            Expect::ErrorOrIdentical => {
                matches!(outcome, "error" | "error (load only)" | "identical")
            }
        };
        if !fine {
            let e = loaded.ok().and_then(|l| l.err()).map(|e| e.to_string());
            failures.push(format!(
                "case {case} ({what}, expected {expect:?}): {outcome} {e:?}"
            ));
        }
        *tally.entry((what, outcome)).or_default() += 1;
        f.restore();
    }
    println!("{CASES} corruptions: {tally:#?}");
    assert!(
        failures.is_empty(),
        "{} failures: {:#?}",
        failures.len(),
        &failures[..failures.len().min(20)]
    );
    for f in &fixtures {
        assert!(f.load().is_ok(), "restored, each loads");
        std::fs::remove_dir_all(&f.root).unwrap();
    }
}
