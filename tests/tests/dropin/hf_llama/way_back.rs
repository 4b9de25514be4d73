//! The way back: the user's Llama, split, writes the Hugging Face checkpoint it read, through
//! the example's `save_options`, one file, shards, or a file per pipeline stage.

use super::{Error, hf, parallel, pipeline};
use crate::dropin::load::scratch;
use burn_megatron::dropin::{RecordSource, SaveOptions, save_safetensors, save_safetensors_stages};
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::{fixture, read_safetensors, tp_ranks};
use std::collections::BTreeMap;
use std::path::Path;

type Tensors = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

/// Every tensor of the checkpoint `transformers` wrote in `dir` (its shards together).
fn checkpoint_tensors(dir: &Path) -> Result<Tensors, Error> {
    let mut all = BTreeMap::new();
    for f in std::fs::read_dir(dir)? {
        let f = f?.path();
        let file = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if file.starts_with("model") && file.ends_with(".safetensors") {
            all.extend(read_safetensors(&f));
        }
    }
    Ok(all)
}

/// The way back: the model loaded at TP 2 and written with `save_safetensors` through the
/// example's `save_options` is, tensor for tensor and bit for bit, the checkpoint
/// `transformers` wrote (its four shards together; the tied one without an output layer),
/// under its names and layouts (the query and key heads back in `rotate_half`'s halves).
#[test]
fn the_users_llama_writes_back_the_hugging_face_checkpoint_it_read() -> Result<(), Error> {
    for name in ["hf_llama_tiny", "hf_llama_tied_tiny"] {
        let checkpoint = hf::Checkpoint::open(&fixture(name))?;
        let out = scratch(&format!("hf-save-{name}"));
        tp_ranks(2, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = checkpoint.load(g, d)?;
            checkpoint.save(&model, &out, g)
        })?;
        let want = checkpoint_tensors(&fixture(name))?;
        let got = read_safetensors(&out.join("model.safetensors"));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, w) in &want {
            assert!(got[k] == *w, "{name}: {k} differs");
        }
        let config = |dir: &Path| std::fs::read_to_string(dir.join("config.json"));
        assert_eq!(config(&out)?, config(&fixture(name))?);
        // Sharded as `save_pretrained(max_shard_size="100KB")` shards it: the same tensors
        // over the files the index names, each at most 100 kB of tensors, the single file
        // gone; read back through the index, the model holds what it read from the fixture.
        let options = checkpoint.save_options()?.with_max_shard_bytes(100_000);
        let ranks = tp_ranks(2, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = checkpoint.load(g, d)?;
            save_safetensors(&model, out.join("model.safetensors"), g, &options)?;
            let index = RecordSource::from_hugging_face(&out)?;
            let reread =
                parallel::Llama::load(&checkpoint.config, &index, &checkpoint.options()?, g, d)?;
            Ok::<_, Error>((gathered(&reread, None, g), gathered(&model, None, g)))
        })?;
        for (reread, model) in ranks {
            assert_eq!(reread, model, "{name}: read back through the index");
        }
        let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
            out.join("model.safetensors.index.json"),
        )?)?;
        let mut files = BTreeMap::new();
        for (tensor, file) in index["weight_map"].as_object().expect("a weight map") {
            let file = file.as_str().expect("a file name").to_string();
            files
                .entry(file)
                .or_insert_with(Vec::new)
                .push(tensor.clone());
        }
        assert!(
            files.len() >= 2 && !out.join("model.safetensors").exists(),
            "{files:?}"
        );
        let mut got = BTreeMap::new();
        for (file, tensors) in &files {
            let part = read_safetensors(&out.join(file));
            let bytes: usize = part.values().map(|(_, v)| 4 * v.len()).sum();
            assert!(bytes <= 100_000 || part.len() == 1, "{file}: {bytes} bytes");
            assert_eq!(
                part.keys().collect::<Vec<_>>(),
                tensors.iter().collect::<Vec<_>>()
            );
            got.extend(part);
        }
        assert!(
            got == want,
            "{name}: the shards hold the checkpoint's tensors"
        );
        stale_files_go(&checkpoint, &out, files.len())?;
        std::fs::remove_dir_all(out)?;
    }
    Ok(())
}

/// A save over an earlier one in `out` (`earlier` shards of 100 kB) leaves only its own
/// files, as `save_pretrained` does: shards of 200 kB (fewer) remove the shards their index no
/// longer names, and one file removes the index and every shard. Files not named as this
/// checkpoint's shards stay.
fn stale_files_go(checkpoint: &hf::Checkpoint, out: &Path, earlier: usize) -> Result<(), Error> {
    let foreign = [
        "other-00001-of-00002.safetensors",
        "model-00001-of-00002.safetensors.bak",
    ];
    for f in foreign {
        std::fs::write(out.join(f), b"not ours")?;
    }
    let shards = || -> Result<Vec<String>, Error> {
        let mut names = Vec::new();
        for f in std::fs::read_dir(out)? {
            let name = f?.file_name().to_string_lossy().into_owned();
            if name.starts_with("model-") && name.ends_with(".safetensors") {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    };
    let save = |options: &SaveOptions| {
        tp_ranks(2, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            save_safetensors(
                &checkpoint.load(g, d)?,
                out.join("model.safetensors"),
                g,
                options,
            )?;
            Ok::<_, Error>(())
        })
    };
    save(&checkpoint.save_options()?.with_max_shard_bytes(200_000))?;
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        out.join("model.safetensors.index.json"),
    )?)?;
    let mut named: Vec<String> = (index["weight_map"].as_object().expect("a weight map"))
        .values()
        .map(|f| f.as_str().expect("a file name").to_string())
        .collect();
    named.sort();
    named.dedup();
    assert!(named.len() < earlier, "{named:?}, {earlier} before");
    assert_eq!(shards()?, named);
    save(&checkpoint.save_options()?)?;
    assert_eq!(shards()?, Vec::<String>::new());
    assert!(!out.join("model.safetensors.index.json").exists());
    assert!(out.join("model.safetensors").exists());
    for f in foreign {
        assert!(out.join(f).exists(), "{f} stays");
    }
    Ok(())
}

/// Split into two pipeline stages at TP 2 × PP 2 (the tied checkpoint; the last stage's
/// output layer read from the first's table), each stage writes its own file and the first
/// the index: together, `transformers`' tensors bit for bit, the index naming each in its
/// stage's file, and read back through the index, the model of the one file.
#[test]
fn pipeline_stages_write_back_a_sharded_hugging_face_checkpoint() -> Result<(), Error> {
    let name = "hf_llama_tied_tiny";
    let checkpoint = hf::Checkpoint::open(&fixture(name))?;
    let (config, out) = (&checkpoint.config, scratch("hf-save-stages"));
    let (load, save) = (checkpoint.options()?, checkpoint.save_options()?);
    let weights = RecordSource::from_hugging_face(&checkpoint.dir)?;
    let layout = ParallelConfig::new(4, 2, 2);
    launch::threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let stage = pipeline::Llama::pp_plan(config).stage(PipelinePosition::of(&ctx.state, 0))?;
        let model = pipeline::Llama::load(config, &weights, &load, &stage, g, d)?;
        let (chunks, stages) = (std::slice::from_ref(&model), std::slice::from_ref(&stage));
        let path = out.join("model.safetensors");
        save_safetensors_stages(chunks, stages, path, g, &ctx.groups.pp, &save)?;
        Ok::<_, Error>(())
    })?;
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        out.join("model.safetensors.index.json"),
    )?)?;
    let mut got = BTreeMap::new();
    for stage in 1..=2 {
        let file = format!("model-0000{stage}-of-00002.safetensors");
        let part = read_safetensors(&out.join(&file));
        for tensor in part.keys() {
            assert_eq!(
                index["weight_map"][tensor],
                serde_json::json!(file),
                "{tensor}"
            );
        }
        got.extend(part);
    }
    assert!(got.keys().any(|k| k.starts_with("model.layers.1.")));
    assert!(
        got == checkpoint_tensors(&fixture(name))?,
        "transformers' tensors"
    );
    let reread = RecordSource::from_hugging_face(&out)?;
    assert!(matches!(reread, RecordSource::Index(_)), "{reread:?}");
    let ranks = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let from_index = parallel::Llama::load(config, &reread, &load, g, d)?;
        let from_one = checkpoint.load(g, d)?;
        Ok::<_, Error>((gathered(&from_index, None, g), gathered(&from_one, None, g)))
    })?;
    for (from_index, from_one) in ranks {
        assert_eq!(from_index, from_one);
    }
    std::fs::remove_dir_all(out)?;
    Ok(())
}

/// A write that cannot happen is an error on every rank, not a hang: a directory that does
/// not exist (TP rank 0 cannot create its scratch file, and still runs the gathers), and two
/// parameters renamed to one name (the second found while rank 0 writes).
#[test]
fn a_write_that_fails_is_an_error_on_every_rank() -> Result<(), Error> {
    let checkpoint = hf::Checkpoint::open(&fixture("hf_llama_tiny"))?;
    let out = scratch("hf-save-errors");
    let options = checkpoint.save_options()?;
    let one_name = options
        .clone()
        .with_key_remap(r"\.(gate|up)_proj\.", ".mlp_proj.")?;
    let cases = [
        (
            out.join("missing").join("model.safetensors"),
            options,
            "missing",
        ),
        (out.join("model.safetensors"), one_name, "written as"),
    ];
    for (path, options, what) in cases {
        let errors = tp_ranks(2, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = checkpoint.load(g, d)?;
            let saved = save_safetensors(&model, &path, g, &options);
            Ok::<_, Error>(saved.err().map(|e| e.to_string()))
        })?;
        for (rank, e) in errors.into_iter().enumerate() {
            let e = e.unwrap_or_else(|| panic!("rank {rank}: {what}: written"));
            assert!(e.contains(&*path.to_string_lossy()), "rank {rank}: {e}");
            if rank == 0 {
                assert!(e.contains(what), "{e}");
            }
        }
        assert!(!path.exists());
    }
    let left: Vec<_> = std::fs::read_dir(&out)?.collect();
    assert!(left.is_empty(), "scratch files left: {left:?}");
    std::fs::remove_dir_all(out)?;
    Ok(())
}

/// A stage that cannot write its file fails the save on every rank of every stage, and the
/// first stage writes no index over the files that were written (a transform that fails on
/// the second stage's layer only).
#[test]
fn a_stage_that_fails_leaves_no_index() -> Result<(), Error> {
    let checkpoint = hf::Checkpoint::open(&fixture("hf_llama_tied_tiny"))?;
    let (config, out) = (&checkpoint.config, scratch("hf-save-stage-fails"));
    let load = checkpoint.options()?;
    let failing = (checkpoint.save_options()?)
        .with_transform(r"^layers\.1\.ffn_norm\.", |_| Err("refused".to_string()))?;
    let weights = RecordSource::from_hugging_face(&checkpoint.dir)?;
    let ranks = launch::threads(
        &ParallelConfig::new(4, 2, 2),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let stage =
                pipeline::Llama::pp_plan(config).stage(PipelinePosition::of(&ctx.state, 0))?;
            let model = pipeline::Llama::load(config, &weights, &load, &stage, g, d)?;
            let (chunks, stages) = (std::slice::from_ref(&model), std::slice::from_ref(&stage));
            let path = out.join("model.safetensors");
            let saved = save_safetensors_stages(chunks, stages, path, g, &ctx.groups.pp, &failing);
            Ok::<_, Error>((stage.is_last(), saved.err().map(|e| e.to_string())))
        },
    )?;
    for (rank, (last, e)) in ranks.into_iter().enumerate() {
        let e = e.unwrap_or_else(|| panic!("rank {rank}: saved"));
        if last && rank % 2 == 0 {
            assert!(e.contains("refused"), "rank {rank}: {e}");
        }
    }
    assert!(!out.join("model.safetensors.index.json").exists());
    assert!(!out.join("model-00002-of-00002.safetensors").exists());
    std::fs::remove_dir_all(out)?;
    Ok(())
}
