//! Re-saving an iteration, a rank that never finished, crafted indexes and the fallback to
//! the newest checkpoint that verifies.

use super::{fresh, load, optimizer_for, reseal, save, step, tmp, values};
use crate::checkpoint::advanced::*;
use crate::checkpoint::*;
use crate::optimizer::MegatronOptimizer;
use burn::nn::Linear;
use burn::tensor::DType;
use serde_json::{Value, json};

fn rank(tp_rank: usize) -> CheckpointRank<'static> {
    CheckpointRank {
        layout: super::layout(2),
        tensor_model_parallel_rank: tp_rank,
        pipeline_model_parallel_rank: 0,
        expert_model_parallel_rank: 0,
        share: crate::checkpoint::SaveShare::ALL,
        names: &|p: &str| p.to_string(),
    }
}

/// Both ranks of TP 2 save `iteration` and one commits.
fn save_tp2(root: &Path, iteration: usize, model: &Linear, optim: &MegatronOptimizer<Linear>) {
    begin_checkpoint(root, iteration).unwrap();
    for r in 0..2 {
        save_checkpoint(root, iteration, &rank(r), model, optim, Value::Null).unwrap();
    }
    commit_checkpoint(root, iteration).unwrap();
}

fn load_tp2(root: &Path, iteration: usize) -> Result<Restored<Linear>, CheckpointError> {
    load_checkpoint(
        root,
        iteration,
        &rank(0),
        fresh(9, DType::F32, true).0,
        |m| Ok(optimizer_for(true)(m)),
        true,
    )
}

#[test]
fn re_committing_an_iteration_keeps_the_old_copy_until_the_new_one_is_in() {
    let dir = tmp("recommit");
    let (old, mut optim) = fresh(1, DType::F32, true);
    save(&dir, 1, &old, &optim);
    let new = step(old.clone(), &mut optim, 0);
    assert_ne!(values(&new), values(&old));
    let stage = |model: &Linear, optim: &MegatronOptimizer<Linear>| {
        begin_checkpoint(&dir, 1).unwrap();
        save_checkpoint(&dir, 1, &solo_rank(), model, optim, json!({"note": 7})).unwrap();
    };
    let loaded = |dir: &Path| {
        values(
            &load(dir, 1, fresh(2, DType::F32, true).0, true)
                .unwrap()
                .model,
        )
    };
    // Staged, not committed: the old copy is iteration 1.
    stage(&new, &optim);
    assert_eq!(loaded(&dir), values(&old));
    // The commit's first step renames the old copy aside; a crash right after leaves only
    // `iter_0000001.old`, which still loads as iteration 1 and is found as the newest.
    std::fs::rename(iteration_dir(&dir, 1), dir.join("iter_0000001.old")).unwrap();
    assert_eq!(loaded(&dir), values(&old));
    let found = latest_loadable_checkpoint(&dir).unwrap().unwrap();
    assert_eq!((found.iteration, found.skipped.len()), (1, 0));
    // The next save's begin puts it back.
    begin_checkpoint(&dir, 1).unwrap();
    assert!(iteration_dir(&dir, 1).is_dir() && !dir.join("iter_0000001.old").exists());
    assert!(!dir.join("iter_0000001.tmp").exists());
    // A whole re-commit: the new copy loads, nothing is left aside.
    stage(&new, &optim);
    commit_checkpoint(&dir, 1).unwrap();
    assert_eq!(loaded(&dir), values(&new));
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| !n.ends_with(".old") && !n.ends_with(".tmp")),
        "{names:?}"
    );
    assert_eq!(read_latest(&dir).unwrap(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn solo_rank() -> CheckpointRank<'static> {
    super::solo()
}

#[test]
fn a_rank_directory_without_its_index_is_named_and_the_previous_checkpoint_loads() {
    let dir = tmp("no-index");
    let (model, mut optim) = fresh(1, DType::F32, true);
    save_tp2(&dir, 1, &model, &optim);
    let later = step(model.clone(), &mut optim, 0);
    save_tp2(&dir, 2, &later, &optim);
    let lost = iteration_dir(&dir, 2).join("mp_rank_01/index.json");
    std::fs::remove_file(&lost).unwrap();
    let Err(e) = load_tp2(&dir, 2) else {
        panic!("a rank without its index must not load")
    };
    let e = e.to_string();
    assert!(
        e.contains("iter_0000002/mp_rank_01/index.json") && e.contains("missing"),
        "{e}"
    );
    let found = latest_loadable_checkpoint(&dir).unwrap().unwrap();
    assert_eq!(found.iteration, 1);
    assert_eq!(found.skipped.len(), 1);
    assert_eq!(found.skipped[0].0, 2);
    assert!(
        found.skipped[0]
            .1
            .to_string()
            .contains("mp_rank_01/index.json")
    );
    assert_eq!(values(&load_tp2(&dir, 1).unwrap().model), values(&model));
    // Chosen explicitly, a checkpoint that does not verify is an error, no fallback.
    assert!(verify_checkpoint(&dir, 2).is_err());
    // With no checkpoint left that verifies, an error naming each.
    std::fs::remove_file(iteration_dir(&dir, 1).join("mp_rank_00/model.safetensors")).unwrap();
    let e = latest_loadable_checkpoint(&dir).unwrap_err().to_string();
    assert!(
        e.contains("iteration 2") && e.contains("iteration 1") && e.contains("model.safetensors"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Edits to one rank's index, sealed again as a crafted checkpoint would be: each is an
/// error naming what is wrong, never a panic or a huge allocation.
#[test]
fn crafted_indexes_are_errors_not_panics() {
    let dir = tmp("crafted");
    let (model, optim) = fresh(1, DType::F32, true);
    save_tp2(&dir, 1, &model, &optim);
    let iter = iteration_dir(&dir, 1);
    let path = |r: &str| iter.join(r).join("index.json");
    let pristine: Vec<Vec<u8>> = ["mp_rank_00", "mp_rank_01"]
        .map(|r| std::fs::read(path(r)).unwrap())
        .to_vec();
    fn weight(v: &Value) -> usize {
        let tensors = v["tensors"].as_array().unwrap();
        tensors
            .iter()
            .position(|t| t["set"] == "model" && t["name"] == "weight")
            .unwrap()
    }
    type Edit = Box<dyn Fn(&mut Value, &mut Value)>;
    let big = u64::MAX;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "two directories of one rank",
            Box::new(|_, r1| r1["tensor_model_parallel_rank"] = json!(0)),
            "holds the index of mp_rank_00",
        ),
        (
            "a rank outside the layout",
            Box::new(|_, r1| r1["tensor_model_parallel_rank"] = json!(7)),
            "outside its layout",
        ),
        (
            "ranks at different steps",
            Box::new(|_, r1| r1["state"]["iteration"] = json!(5)),
            "training state",
        ),
        (
            "another layout on one rank",
            Box::new(|_, r1| r1["layout"]["tensor_model_parallel_size"] = json!(3)),
            "the other ranks at",
        ),
        (
            "a layout with a rank more",
            Box::new(|r0, r1| {
                r0["layout"]["tensor_model_parallel_size"] = json!(3);
                r1["layout"]["tensor_model_parallel_size"] = json!(3);
            }),
            "mp_rank_02 missing",
        ),
        (
            "an overflowing layout",
            Box::new(move |r0, r1| {
                for r in [r0, r1] {
                    r["layout"]["tensor_model_parallel_size"] = json!(big);
                    r["layout"]["pipeline_model_parallel_size"] = json!(2);
                }
            }),
            "impossible layout",
        ),
        (
            "a volume that overflows",
            Box::new(move |r0, _| {
                let w = weight(r0);
                r0["tensors"][w]["global_shape"] = json!([big / 2, big / 2]);
                r0["tensors"][w]["shape"] = json!([big / 2, big / 2]);
            }),
            "overflows",
        ),
        (
            "an offset that overflows",
            Box::new(move |r0, _| {
                let w = weight(r0);
                r0["tensors"][w]["offset"] = json!([big, 0]);
            }),
            "outside the global shape",
        ),
        (
            "a shard outside its global shape",
            Box::new(|r0, _| {
                let w = weight(r0);
                r0["tensors"][w]["offset"] = json!([1, 0]);
            }),
            "outside the global shape",
        ),
        (
            "a tensor larger than its file",
            Box::new(|r0, _| {
                let w = weight(r0);
                r0["tensors"][w]["global_shape"] = json!([1u64 << 40, 2]);
                r0["tensors"][w]["shape"] = json!([1u64 << 40, 2]);
            }),
            "cannot hold its tensors",
        ),
        (
            "a hole",
            Box::new(|r0, _| {
                let w = weight(r0);
                r0["tensors"][w]["shape"] = json!([2, 2]);
            }),
            "cover 4 of the 6 elements",
        ),
        (
            "overlapping shards summing to the whole",
            Box::new(|r0, r1| {
                let w = weight(r0);
                r0["tensors"][w]["shape"] = json!([2, 2]);
                let mut second = r0["tensors"][w].clone();
                second["offset"] = json!([1, 0]);
                r1["tensors"].as_array_mut().unwrap().push(second);
                // TP rank 1 wrote no tensor of a layer that is not tensor-parallel.
                r1["files"]["model.safetensors"] = r0["files"]["model.safetensors"].clone();
            }),
            "overlaps",
        ),
        (
            "a tensor in another set's file",
            Box::new(|r0, _| {
                let tensors = r0["tensors"].as_array_mut().unwrap();
                let t = tensors.iter_mut().find(|t| t["set"] == "exp_avg").unwrap();
                t["file"] = json!("exp_avg_sq.safetensors");
            }),
            "should be exp_avg.safetensors",
        ),
        (
            "a file outside the rank directory",
            Box::new(|r0, _| {
                let files = r0["files"].as_object_mut().unwrap();
                let entry = files["model.safetensors"].clone();
                files.insert("../../etc/passwd".into(), entry);
            }),
            "lists the file",
        ),
        (
            "a shard listed twice",
            Box::new(|r0, _| {
                let w = weight(r0);
                let copy = r0["tensors"][w].clone();
                r0["tensors"].as_array_mut().unwrap().push(copy);
            }),
            "listed twice",
        ),
    ];
    for (what, edit, expected) in cases {
        let mut v: Vec<Value> = pristine
            .iter()
            .map(|b| serde_json::from_slice(b).unwrap())
            .collect();
        let (r0, r1) = v.split_at_mut(1);
        edit(&mut r0[0], &mut r1[0]);
        for (r, v) in ["mp_rank_00", "mp_rank_01"].iter().zip(&v) {
            std::fs::write(path(r), serde_json::to_vec_pretty(v).unwrap()).unwrap();
        }
        reseal(&iter);
        let e = CheckpointIndex::read(&iter).unwrap_err().to_string();
        assert!(e.contains(expected), "{what}: {e}");
        let e = load_tp2(&dir, 1).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains(expected)), "{what}");
    }
    for (r, b) in ["mp_rank_00", "mp_rank_01"].iter().zip(&pristine) {
        std::fs::write(path(r), b).unwrap();
    }
    reseal(&iter);
    assert_eq!(values(&load_tp2(&dir, 1).unwrap().model), values(&model));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A saved index edited after the commit no longer matches `metadata.json`; a checkpoint
/// without one never finished its commit.
#[test]
fn indexes_are_sealed_by_the_commit() {
    let dir = tmp("sealed");
    let (model, optim) = fresh(1, DType::F32, true);
    save(&dir, 1, &model, &optim);
    let iter = iteration_dir(&dir, 1);
    let index = iter.join("mp_rank_00/index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    // Whitespace changes no value, but the bytes are sealed.
    std::fs::write(&index, format!("{text}\n")).unwrap();
    let e = verify_checkpoint(&dir, 1).unwrap_err().to_string();
    assert!(e.contains("metadata.json says"), "{e}");
    reseal(&iter);
    assert_eq!(
        values(
            &load(&dir, 1, fresh(2, DType::F32, true).0, true)
                .unwrap()
                .model
        ),
        values(&model)
    );
    std::fs::remove_file(iter.join(METADATA)).unwrap();
    let e = verify_checkpoint(&dir, 1).unwrap_err().to_string();
    assert!(e.contains("not a committed checkpoint"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
