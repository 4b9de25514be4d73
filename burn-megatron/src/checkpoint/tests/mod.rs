//! Checkpoint round trips at one layout (bit-identical resumption for both optimizers), the
//! integrity checks, and the errors. Resharding across layouts is tested end to end by
//! `bert_pretrain` (examples/tests/reshard.rs).

use super::*;
use crate::checkpoint::advanced::*;
use crate::comm::{Comm, LocalWorld};
use crate::optimizer::MegatronOptimizer;
use crate::optimizer::{FusedAdamConfig, cast_params, megatron_param_groups};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor, TensorData};
use std::sync::Arc;

pub(super) fn step(model: Linear, optim: &mut MegatronOptimizer<Linear>, k: usize) -> Linear {
    let device = model.weight.val().device();
    let x = Tensor::<2>::from_data(
        TensorData::new(
            (0..6)
                .map(|i| (i * (k + 1)) as f32 * 0.1)
                .collect::<Vec<_>>(),
            [2, 3],
        ),
        &device,
    )
    .cast(model.weight.val().dtype());
    let loss = model.forward(x).powi_scalar(2).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(1e-2, model, grads).unwrap().0
}

pub(super) fn optimizer_for(fused: bool) -> impl Fn(&Linear) -> MegatronOptimizer<Linear> {
    move |model| {
        let comm: Comm = Arc::new(LocalWorld::new(1).communicator("mp", vec![0], 0).unwrap());
        if fused {
            // Weight and bias land in two flat groups (decay 0.5 and none).
            let adam = FusedAdamConfig::new().with_weight_decay(0.5);
            return MegatronOptimizer::new(adam.init().unwrap(), model, comm, 0);
        }
        // Biases without weight decay: an id-based group, which must match after loading.
        let adamw = AdamWConfig::new().with_weight_decay(0.5);
        let groups = megatron_param_groups(
            model,
            adamw.build(),
            adamw.with_weight_decay(0.0).build(),
            None,
        );
        MegatronOptimizer::new(groups, model, comm, 0)
    }
}

pub(super) fn fresh(seed: u64, dtype: DType, fused: bool) -> (Linear, MegatronOptimizer<Linear>) {
    let device = Device::flex().autodiff();
    Device::seed(&device, seed);
    let model = cast_params(LinearConfig::new(3, 2).init(&device), dtype);
    let optim = optimizer_for(fused)(&model);
    (model, optim)
}

/// A single-rank layout, names as the module's paths.
pub(super) fn solo() -> CheckpointRank<'static> {
    CheckpointRank {
        layout: layout(1),
        tensor_model_parallel_rank: 0,
        pipeline_model_parallel_rank: 0,
        expert_model_parallel_rank: 0,
        share: super::SaveShare::ALL,
        names: &|p: &str| p.to_string(),
    }
}

pub(super) fn layout(tp: usize) -> SavedLayout {
    SavedLayout {
        tensor_model_parallel_size: tp,
        pipeline_model_parallel_size: 1,
        virtual_pipeline_model_parallel_size: 1,
        data_parallel_size: 1,
        distributed_optimizer: false,
        expert_model_parallel_size: 1,
    }
}

/// A fresh directory, in memory where there is a tmpfs (the fuzz test writes thousands of
/// files).
pub(super) fn tmp(name: &str) -> std::path::PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("bm-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Rewrites the `metadata.json` of the iteration directory `dir` to seal its indexes as
/// they are now: what a crafted checkpoint would do, so that the checks behind the seal are
/// the ones tested.
pub(super) fn reseal(dir: &Path) {
    let path = dir.join(METADATA);
    let mut meta: CommitMetadata = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for (name, seal) in meta.indexes.iter_mut() {
        let bytes = std::fs::read(dir.join(name).join("index.json")).unwrap_or_default();
        *seal = FileEntry {
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        };
    }
    std::fs::write(&path, serde_json::to_string(&meta).unwrap()).unwrap();
}

/// One rank's save and commit.
pub(super) fn save(
    root: &Path,
    iteration: usize,
    model: &Linear,
    optim: &MegatronOptimizer<Linear>,
) {
    begin_checkpoint(root, iteration).unwrap();
    save_checkpoint(
        root,
        iteration,
        &solo(),
        model,
        optim,
        serde_json::json!({"note": 7}),
    )
    .unwrap();
    commit_checkpoint(root, iteration).unwrap();
}

pub(super) fn load(
    root: &Path,
    iteration: usize,
    model: Linear,
    fused: bool,
) -> Result<Restored<Linear>, CheckpointError> {
    load_checkpoint(
        root,
        iteration,
        &solo(),
        model,
        |m| Ok(optimizer_for(fused)(m)),
        true,
    )
}

pub(super) fn values(m: &Linear) -> Vec<f32> {
    let mut v: Vec<f32> = m
        .weight
        .val()
        .cast(DType::F32)
        .into_data()
        .iter::<f32>()
        .collect();
    v.extend(
        m.bias
            .as_ref()
            .unwrap()
            .val()
            .cast(DType::F32)
            .into_data()
            .iter::<f32>(),
    );
    v
}

#[test]
fn a_loaded_run_continues_bit_identically() {
    for (dtype, fused) in [
        (DType::F32, false),
        (DType::BF16, false),
        (DType::F32, true),
        (DType::BF16, true),
    ] {
        let dir = tmp(&format!("resume-{dtype:?}-{fused}"));
        let (mut model, mut optim) = fresh(1, dtype, fused);
        for k in 0..3 {
            model = step(model, &mut optim, k);
        }
        save(&dir, 3, &model, &optim);
        assert_eq!(read_latest(&dir).unwrap(), Some(3));
        let mut cont = model;
        for k in 3..5 {
            cont = step(cont, &mut optim, k);
        }
        let (other, _) = fresh(2, dtype, fused);
        let r = load(&dir, 3, other, fused).unwrap();
        assert_eq!((r.iteration, r.extra["note"].as_u64()), (3, Some(7)));
        assert_eq!(r.saved_at, layout(1));
        let (mut resumed, mut optim) = (r.model, r.optimizer);
        for k in 3..5 {
            resumed = step(resumed, &mut optim, k);
        }
        assert_eq!(values(&resumed), values(&cont), "{dtype:?} fused {fused}");
        assert_ne!(
            values(&resumed),
            values(&fresh(2, dtype, fused).0),
            "it trained"
        );
        assert_eq!(resumed.weight.id, cont.weight.id, "same layout: ids kept");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn two_saves_of_the_same_state_are_byte_identical() {
    let (a, b) = (tmp("bytes-a"), tmp("bytes-b"));
    let (model, optim) = fresh(1, DType::BF16, true);
    save(&a, 1, &model, &optim);
    save(&b, 1, &model, &optim);
    let files = |root: &Path| {
        let dir = iteration_dir(root, 1).join("mp_rank_00");
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|n| (n.clone(), std::fs::read(dir.join(n)).unwrap()))
            .collect::<Vec<_>>()
    };
    let (fa, fb) = (files(&a), files(&b));
    assert_eq!(fa.len(), 5, "model, master, exp_avg, exp_avg_sq, index");
    assert_eq!(fa, fb);
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn flipped_truncated_or_foreign_files_and_missing_shards_are_named() {
    let dir = tmp("integrity");
    let (model, optim) = fresh(1, DType::F32, true);
    save(&dir, 1, &model, &optim);
    let rank = iteration_dir(&dir, 1).join("mp_rank_00");
    let file = rank.join("exp_avg.safetensors");
    let good = std::fs::read(&file).unwrap();
    let attempt = || {
        load(&dir, 1, fresh(2, DType::F32, true).0, true)
            .err()
            .map(|e| e.to_string())
    };

    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    std::fs::write(&file, &flipped).unwrap();
    let e = attempt().expect("a flipped byte must not load");
    assert!(
        e.contains("exp_avg.safetensors") && e.contains("corrupted"),
        "{e}"
    );

    std::fs::write(&file, &good[..good.len() - 7]).unwrap();
    let e = attempt().expect("a truncated file must not load");
    assert!(
        e.contains("exp_avg.safetensors") && e.contains("truncated"),
        "{e}"
    );

    // Another checkpoint's file: valid safetensors, but not the one indexed.
    let other = tmp("integrity-other");
    let (m2, mut o2) = fresh(3, DType::F32, true);
    let m2 = step(m2, &mut o2, 0);
    save(&other, 1, &m2, &o2);
    let foreign =
        std::fs::read(iteration_dir(&other, 1).join("mp_rank_00/exp_avg.safetensors")).unwrap();
    std::fs::write(&file, &foreign).unwrap();
    let e = attempt().expect("a foreign file must not load");
    assert!(e.contains("exp_avg.safetensors"), "{e}");

    std::fs::write(&file, &good).unwrap();
    assert!(attempt().is_none(), "restored, it loads again");

    // A tensor the index no longer lists for this set: a missing shard. Edited after the
    // commit, the index no longer matches metadata.json; sealed again (a crafted index),
    // the missing shard itself is the error.
    let index_path = rank.join("index.json");
    let text = std::fs::read_to_string(&index_path).unwrap();
    let mut index: RankIndex = serde_json::from_str(&text).unwrap();
    index
        .tensors
        .retain(|t| !(t.set == "exp_avg_sq" && t.name == "bias"));
    std::fs::write(&index_path, serde_json::to_string(&index).unwrap()).unwrap();
    let e = attempt().expect("an edited index must not load");
    assert!(
        e.contains("index.json") && e.contains("metadata.json"),
        "{e}"
    );
    reseal(&iteration_dir(&dir, 1));
    let e = attempt().expect("a missing shard must not load");
    assert!(
        e.contains("exp_avg_sq tensor bias") && e.contains("not in the checkpoint"),
        "{e}"
    );
    std::fs::write(&index_path, &text).unwrap();
    reseal(&iteration_dir(&dir, 1));
    assert!(attempt().is_none(), "restored, it loads again");

    std::fs::write(&index_path, "{ not json").unwrap();
    reseal(&iteration_dir(&dir, 1));
    let e = attempt().expect("a broken index must not load");
    assert!(
        e.contains("index.json") && e.contains("not a checkpoint index"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&other).unwrap();
}

/// Two tensor-parallel ranks save; the second fails before writing its index. The commit
/// refuses, `latest` still names the previous checkpoint, and that one still loads.
#[test]
fn a_save_that_fails_on_one_rank_leaves_the_previous_checkpoint_latest() {
    let dir = tmp("atomic");
    let (model, optim) = fresh(1, DType::F32, true);
    let rank = |tp_rank| CheckpointRank {
        layout: layout(2),
        tensor_model_parallel_rank: tp_rank,
        pipeline_model_parallel_rank: 0,
        expert_model_parallel_rank: 0,
        share: super::SaveShare::ALL,
        names: &|p: &str| p.to_string(),
    };
    for (iteration, ranks) in [(1, 2), (2, 1)] {
        begin_checkpoint(&dir, iteration).unwrap();
        for r in 0..ranks {
            save_checkpoint(
                &dir,
                iteration,
                &rank(r),
                &model,
                &optim,
                serde_json::Value::Null,
            )
            .unwrap();
        }
        let committed = commit_checkpoint(&dir, iteration);
        if ranks == 2 {
            committed.unwrap();
        } else {
            let e = committed.unwrap_err().to_string();
            assert!(e.contains("a shard is missing"), "{e}");
        }
    }
    assert_eq!(read_latest(&dir).unwrap(), Some(1));
    assert!(!iteration_dir(&dir, 2).exists());
    let r = load_checkpoint(
        &dir,
        1,
        &rank(0),
        fresh(2, DType::F32, true).0,
        |m| Ok(optimizer_for(true)(m)),
        true,
    )
    .unwrap();
    assert_eq!(values(&r.model), values(&model));
    // The next attempt clears what the failed one left.
    begin_checkpoint(&dir, 2).unwrap();
    assert!(!dir.join("iter_0000002.tmp").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn another_architecture_is_a_mismatch_naming_the_tensor() {
    let dir = tmp("mismatch");
    let (model, optim) = fresh(1, DType::F32, false);
    save(&dir, 1, &model, &optim);
    let device = Device::flex().autodiff();
    let wider = LinearConfig::new(3, 4).init(&device);
    let Err(e) = load(&dir, 1, wider, false) else {
        panic!("a wider layer must not load")
    };
    assert!(
        e.to_string()
            .contains("model tensor weight: saved with global shape [3, 2]"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_loads_only_into_the_optimizer_kind_that_saved_it() {
    for fused in [false, true] {
        let dir = tmp(&format!("kind-{fused}"));
        let (model, optim) = fresh(1, DType::F32, fused);
        save(&dir, 1, &model, &optim);
        let Err(e) = load(&dir, 1, fresh(2, DType::F32, fused).0, !fused) else {
            panic!("fused {fused}: the other optimizer kind must not load")
        };
        let expected = if fused {
            "saved by the fused Adam, loading into a burn-optim optimizer"
        } else {
            "saved by a burn-optim optimizer, loading into the fused Adam"
        };
        assert!(e.to_string().contains(expected), "{e}");
        // The weights alone load into either.
        let r = load_checkpoint(
            &dir,
            1,
            &solo(),
            fresh(2, DType::F32, fused).0,
            |m| Ok(optimizer_for(!fused)(m)),
            false,
        )
        .unwrap();
        assert_eq!(values(&r.model), values(&model));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A vocabulary padded differently at each layout: a table of 8 rows saved whole (as every
/// checkpoint was before the padding was left out) loads into one padded to 12 with 6 real
/// rows, whose checkpoint holds only those 6, and that loads into a table of 8 again; the
/// real rows move, the padding reads as zeros, the fused Adam's moments move along.
#[test]
fn a_vocabulary_loads_at_another_padding() {
    use crate::tensor_parallel::{VocabParallelEmbedding, VocabParallelEmbeddingConfig};
    let device = Device::flex().autodiff();
    let comm: Comm = Arc::new(LocalWorld::new(1).communicator("mp", vec![0], 0).unwrap());
    let table = |rows: usize, real: Option<usize>, seed: u64| {
        VocabParallelEmbeddingConfig::new(rows, 3)
            .with_unpadded_size(real)
            .with_seed(seed)
            .init(&comm, &device)
            .unwrap()
    };
    let optimizer = |m: &VocabParallelEmbedding| {
        MegatronOptimizer::new(FusedAdamConfig::new().init().unwrap(), m, comm.clone(), 0)
    };
    let rows = |m: &VocabParallelEmbedding| -> Vec<Vec<f32>> {
        let v: Vec<f32> = m.weight.val().into_data().iter::<f32>().collect();
        v.chunks(3).map(<[f32]>::to_vec).collect()
    };
    let save_loaded = |dir: &Path, model: &VocabParallelEmbedding, step: bool| {
        let mut optim = optimizer(model);
        let mut model = model.clone();
        if step {
            let ids = Tensor::<2, burn::tensor::Int>::from_data([[0, 5, 2]], &device);
            let loss = model.forward(ids).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads).unwrap().0;
        }
        begin_checkpoint(dir, 1).unwrap();
        save_checkpoint(dir, 1, &solo(), &model, &optim, serde_json::json!({})).unwrap();
        commit_checkpoint(dir, 1).unwrap();
        model
    };
    let load_into = |dir: &Path, model: VocabParallelEmbedding| {
        load_checkpoint(dir, 1, &solo(), model, |m| Ok(optimizer(m)), true)
            .unwrap()
            .model
    };
    let (old, new) = (tmp("vocab-old"), tmp("vocab-new"));
    let whole = save_loaded(&old, &table(8, None, 1), true);
    let padded = load_into(&old, table(12, Some(6), 2));
    let (w, p) = (rows(&whole), rows(&padded));
    assert_eq!(&p[..6], &w[..6]);
    assert!(p[6..].iter().flatten().all(|&x| x == 0.0), "{p:?}");
    save_loaded(&new, &padded, false);
    let index = CheckpointIndex::read(&committed_dir(&new, 1)).unwrap();
    let shapes: Vec<_> = index
        .shards("model")
        .values()
        .map(|f| (f[0].1.global_shape.clone(), f[0].1.padded_dim))
        .collect();
    assert_eq!(
        shapes,
        vec![(vec![6, 3], Some(0))],
        "only the real rows are saved"
    );
    let back = rows(&load_into(&new, table(8, Some(6), 3)));
    assert_eq!(&back[..6], &w[..6]);
    assert!(back[6..].iter().flatten().all(|&x| x == 0.0), "{back:?}");
    // A checkpoint that states its real vocabulary is no older padded one: another
    // vocabulary (5 tokens) is a mismatch, not a cut.
    let (smaller, make) = (table(8, Some(5), 4), |m: &VocabParallelEmbedding| {
        Ok(optimizer(m))
    });
    let Err(e) = load_checkpoint(&new, 1, &solo(), smaller, make, true) else {
        panic!("a checkpoint of 6 real tokens loaded into a vocabulary of 5")
    };
    assert!(e.to_string().contains("global shape [6, 3]"), "{e}");
    for dir in [old, new] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

mod durability;

mod fuzz;
