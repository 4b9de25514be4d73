//! A Llama checkpoint in Meta's own format (`params.json`, `consolidated.NN.pth` in bfloat16,
//! Meta's names and rotary layout) in the user's Llama, against `transformers` holding the same
//! weights (`tests/fixtures/make_meta_llama.py`): one file, and the same weights split over two
//! model-parallel files as fairscale holds them, each at TP 1, 2 and 4.

use super::{
    Error, agrees_with_transformers, grads_checkpoint, kept, meta, parallel, pipeline, run,
};
use crate::dropin::load::{scratch, write_safetensors};
use crate::dropin::model_parallel::{Named, halves, write_parts};
use burn::tensor::Device;
use burn_megatron::comm::Comm;
use burn_megatron::dropin::RecordSource;
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::{fixture, read_safetensors, tp_ranks};

/// Llama 3.2's factor, which the fixture's params.json does not give (as Meta's do not).
const FACTOR: Option<f32> = Some(32.0);

fn matches(weights: &str, sizes: &[usize]) -> Result<(), Error> {
    let checkpoint = meta::Checkpoint::open(&fixture(weights), FACTOR)?;
    let load = |tp: &Comm, device: &Device| checkpoint.load(tp, device);
    let (config, options) = (&checkpoint.config, meta::Checkpoint::options()?);
    agrees_with_transformers(weights, config, load, &options, "meta_llama_tiny", sizes)
}

/// One `consolidated.00.pth`: no rotary permutation, the feed-forward width from Meta's
/// `multiple_of` and `ffn_dim_multiplier`, Llama 3's scaling with the factor given.
#[test]
fn a_meta_llama_in_the_users_llama_gives_transformers_numbers() -> Result<(), Error> {
    matches("meta_llama_tiny", &[1, 2, 4])
}

/// Two model-parallel files (Llama 3 70B's form, at MP 2): joined as the model holds each
/// tensor (the embedding's and the column layers' rows, the row layers' columns, the norms
/// whole), then cut at TP 1 (joined whole), 2 (each rank one file's part) and 4 (half of one).
#[test]
fn a_model_parallel_meta_llama_loads_at_any_tp_size() -> Result<(), Error> {
    assert!(matches!(
        RecordSource::from_meta(fixture("meta_llama_tiny_mp2"))?,
        RecordSource::ModelParallel(files) if files.len() == 2
    ));
    matches("meta_llama_tiny_mp2", &[1, 2, 4])
}

/// Pipeline stages read the model-parallel files as the one file: at TP 2 × PP 2, each stage
/// loads the same shards of its layers from both.
#[test]
fn pipeline_stages_read_a_model_parallel_meta_llama_as_its_one_file() -> Result<(), Error> {
    let checkpoint = meta::Checkpoint::open(&fixture("meta_llama_tiny"), FACTOR)?;
    let (config, options) = (&checkpoint.config, meta::Checkpoint::options()?);
    let one = RecordSource::from_meta(fixture("meta_llama_tiny"))?;
    let parts = RecordSource::from_meta(fixture("meta_llama_tiny_mp2"))?;
    let layout = ParallelConfig::new(4, 2, 2);
    let ranks = launch::threads(&layout, LaunchOptions::default(), |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let plan = pipeline::Llama::pp_plan(config);
        let stage = plan.stage(PipelinePosition::of(&ctx.state, 0))?;
        let load = |w: &RecordSource| pipeline::Llama::load(config, w, &options, &stage, g, d);
        let (from_one, from_parts) = (load(&one)?, load(&parts)?);
        Ok::<_, Error>((gathered(&from_one, None, g), gathered(&from_parts, None, g)))
    })?;
    for (rank, (from_one, from_parts)) in ranks.into_iter().enumerate() {
        assert!(!from_one.is_empty(), "rank {rank} holds parameters");
        assert_eq!(from_one, from_parts, "rank {rank}");
    }
    Ok(())
}

/// The factor the files do not give changes the logits (Llama 3.1's 8 for 3.2's 32: by more
/// than the tests' bound), so it is asked for, not assumed; params.json's own, where given,
/// comes first.
#[test]
fn meta_llama_3s_rope_scaling_factor_is_asked_for() -> Result<(), Error> {
    let dir = fixture("meta_llama_tiny");
    let e = meta::Checkpoint::open(&dir, None).err().expect("refused");
    assert!(e.contains("use_scaled_rope") && e.contains("32"), "{e}");
    let expected = read_safetensors(&dir.join("expected.safetensors"));
    let wrong = meta::Checkpoint::open(&dir, Some(8.0))?;
    let vocab = wrong.config.vocab_size;
    let want = kept(&expected["logits"].1, &expected, vocab);
    let ranks = tp_ranks(1, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        Ok::<_, Error>(run(&wrong.load(g, d)?, &expected, vocab, g, d)?.0)
    })?;
    let off = super::super::max_abs_diff(&ranks[0], &want);
    assert!(off > 1e-3, "factor 8: logits off by only {off}");
    let copy = scratch("meta-factor");
    let mut params: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("params.json"))?)?;
    params["rope_scaling_factor"] = serde_json::json!(32.0);
    std::fs::write(copy.join("params.json"), params.to_string())?;
    let given = meta::Checkpoint::open(&copy, Some(8.0))?;
    let want = meta::Checkpoint::open(&dir, FACTOR)?;
    assert_eq!(given.config.to_string(), want.config.to_string());
    std::fs::remove_dir_all(copy)?;
    Ok(())
}

/// What the Llama cannot read is refused naming the setting or the files: Llama 2's
/// vocabulary of -1 without a tokenizer (with one, its size), key/value heads that do not divide the heads, no `consolidated.00.pth`,
/// a gap in the ranks.
#[test]
fn a_meta_directory_the_users_llama_cannot_read_is_an_error_naming_it() -> Result<(), Error> {
    let dir = scratch("meta-refusals");
    let mut params: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        fixture("meta_llama_tiny").join("params.json"),
    )?)?;
    params["vocab_size"] = serde_json::json!(-1);
    std::fs::write(dir.join("params.json"), params.to_string())?;
    let e = meta::Checkpoint::open(&dir, FACTOR).err().expect("refused");
    assert!(
        e.contains("vocab_size") && e.contains("tokenizer.model"),
        "{e}"
    );
    // Llama 2's -1 is the size of the tokenizer beside it.
    let tokenizer = fixture("meta_llama_tiny").join("tokenizer.model");
    std::fs::copy(&tokenizer, dir.join("tokenizer.model"))?;
    let from_tokenizer = meta::Checkpoint::open(&dir, FACTOR)?;
    assert_eq!(from_tokenizer.config.vocab_size, 576);
    std::fs::remove_file(dir.join("tokenizer.model"))?;
    params["vocab_size"] = serde_json::json!(576);
    params["n_kv_heads"] = serde_json::json!(3);
    std::fs::write(dir.join("params.json"), params.to_string())?;
    let e = meta::Checkpoint::open(&dir, FACTOR).err().expect("refused");
    assert!(e.contains("n_kv_heads"), "{e}");
    let e = RecordSource::from_meta(&dir).unwrap_err().to_string();
    assert!(e.contains("consolidated") && e.contains("[]"), "{e}");
    let part = fixture("meta_llama_tiny_mp2").join("consolidated.00.pth");
    std::fs::copy(&part, dir.join("consolidated.00.pth"))?;
    std::fs::copy(&part, dir.join("consolidated.02.pth"))?;
    let e = RecordSource::from_meta(&dir).unwrap_err().to_string();
    assert!(e.contains("[0, 2]"), "{e}");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A model-parallel checkpoint of safetensors files reads as its whole record does, its
/// vocabulary of 570 padded to 576 (at TP 2, rank 0's rows overlap both files' parts, rank 1's
/// one part and the padding), and parts that do not make the model's tensor are errors
/// naming it: a tensor one file lacks, a part one row short.
#[test]
fn model_parallel_parts_join_as_the_whole_record_or_name_what_does_not_fit() -> Result<(), Error> {
    let checkpoint = meta::Checkpoint::open(&fixture("meta_llama_tiny"), FACTOR)?;
    let mut config = checkpoint.config.clone();
    config.vocab_size = 570;
    let (config, options) = (&config, meta::Checkpoint::options()?);
    let expected = read_safetensors(&fixture("meta_llama_tiny").join("expected.safetensors"));
    let dir = scratch("meta-parts");
    // The gradients as a record in Meta's names, their vocabulary cut to 570, whole and split
    // over two files.
    let tensors: Vec<Named> = (read_safetensors(&grads_checkpoint(&expected, &dir)).into_iter())
        .map(|(k, (mut shape, v))| {
            let mut v: Vec<f32> = v.into_iter().map(|x| x as f32).collect();
            if k == "tok_embeddings.weight" || k == "output.weight" {
                shape[0] = 570;
                v.truncate(570 * shape[1]);
            }
            (k, shape, v)
        })
        .collect();
    let whole = dir.join("whole.safetensors");
    write_safetensors(&whole, &tensors);
    // Each rank's part of each tensor, as fairscale splits Llama 3: the norms whole, `wo` and
    // `w2` by columns, the rest by rows.
    let [first, second] = halves(&tensors, |_, name, shape| {
        let row = name.contains(".wo.") || name.contains(".w2.");
        (shape.len() > 1).then_some(usize::from(row))
    });
    let joined = write_parts(&dir, "joined", &[first.clone(), second.clone()]);
    let mut lacking = second.clone();
    lacking.retain(|(name, ..)| name != "norm.weight");
    let lacking = write_parts(&dir, "lacking", &[first.clone(), lacking]);
    let mut short = second;
    for (_, shape, v) in short.iter_mut().filter(|(n, ..)| n == "output.weight") {
        shape[0] -= 1;
        v.truncate(shape[0] * shape[1]);
    }
    let short = write_parts(&dir, "short", &[first, short]);
    let whole = RecordSource::from_path(&whole);
    let ranks = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let load = |w: &RecordSource| parallel::Llama::load(config, w, &options, g, d);
        let (a, b) = (load(&whole)?, load(&joined)?);
        let errors = [&lacking, &short].map(|w| load(w).err().map(|e| e.to_string()));
        Ok::<_, Error>((gathered(&a, None, g), gathered(&b, None, g), errors))
    })?;
    for (whole, joined, [lacking, short]) in ranks {
        assert_eq!(whole, joined);
        let lacking = lacking.expect("a file lacking a tensor is refused");
        assert!(
            lacking.contains("`norm.weight` is in") && lacking.contains("lacking.1"),
            "{lacking}"
        );
        let short = short.expect("a part one row short is refused");
        assert!(
            short.contains("output.weight") && short.contains("[284, 64]"),
            "{short}"
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
