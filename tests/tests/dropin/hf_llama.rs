//! A Hugging Face Llama checkpoint in the user's Llama: the llama-burn-style model of
//! `examples/examples/tp_llama_dropin`, made tensor-parallel by its imports, compiled here from
//! the example's own files. At TP 1 and 2, against `transformers` (`tests/fixtures/
//! hf_llama_tiny`: grouped-query attention, Llama 3's RoPE scaling, four safetensors shards):
//! the logits, the causal-LM loss, every gradient, and greedy generation through the cache.
//! `meta_format` holds the same model to `transformers` from checkpoints in Meta's format.

#[allow(dead_code)]
#[path = "../../../examples/examples/tp_llama_dropin/hf.rs"]
mod hf;
#[allow(dead_code)]
#[path = "../../../examples/examples/tp_llama_dropin/llama.rs"]
mod llama;
#[allow(dead_code)]
#[path = "../../../examples/examples/tp_llama_dropin/meta.rs"]
mod meta;
#[allow(dead_code)]
#[path = "../../../examples/examples/tp_llama_dropin/parallel.rs"]
mod parallel;
#[allow(dead_code)]
#[path = "../../../examples/examples/tp_llama_dropin/pipeline.rs"]
mod pipeline;

use super::Error;
use super::load::{scratch, write_safetensors};
use super::model_parallel::{Named, halves, write_parts};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::Comm;
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::dropin::{LoadOptions, RecordSource};
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::pipeline::{
    ChunkOutput, ForwardBackwardConfig, ForwardStep, P2pShapes, PipelineSchedule,
    forward_backward_func, read_losses,
};
use burn_megatron::tensor_parallel::{TpError, vocab_parallel_cross_entropy};
use burn_megatron::topology::{ParallelConfig, PipelinePosition};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::{fixture, read_safetensors, tp_ranks};
use llama::{KeyValueCache, LlamaConfig, causal_mask, repeat_kv};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Fixture = BTreeMap<String, (Vec<usize>, Vec<f64>)>;
type Values = BTreeMap<String, Vec<f32>>;

/// `transformers`' batch as the causal-LM loss reads it: the tokens `[b, s]`, and for each
/// position the label it predicts (`labels[t + 1]`) and whether it counts (the −100 labels
/// and the last position do not), with the count.
struct Batch {
    tokens: Tensor<2, Int>,
    targets: Tensor<1, Int>,
    counted: Tensor<1>,
    n: f32,
}

impl Batch {
    fn new(f: &Fixture, device: &Device) -> Self {
        let (shape, ids) = &f["input_ids"];
        let (b, s) = (shape[0], shape[1]);
        let tokens = TensorData::new(ids.iter().map(|x| *x as i64).collect(), [b, s]);
        let labels = &f["labels"].1;
        let next = |i: usize| if i % s + 1 < s { labels[i + 1] } else { -100.0 };
        let targets: Vec<i64> = (0..b * s).map(|i| next(i).max(0.0) as i64).collect();
        let counted: Vec<f32> = (0..b * s).map(|i| f32::from(next(i) >= 0.0)).collect();
        Self {
            tokens: Tensor::from_data(tokens, device),
            targets: Tensor::from_data(TensorData::new(targets, [b * s]), device),
            n: counted.iter().sum(),
            counted: Tensor::from_data(TensorData::new(counted, [b * s]), device),
        }
    }

    /// The summed cross-entropy of the counted positions of the samples `logits` (`[n, s,
    /// V / tp]`) are for, from `first`.
    fn loss_sum(&self, logits: Tensor<3>, first: usize, tp: &Comm) -> Result<Tensor<1>, Error> {
        let [n, s, v] = logits.dims();
        let (at, len) = (first * s, n * s);
        let targets = self.targets.clone().narrow(0, at, len);
        let ce = vocab_parallel_cross_entropy(logits.reshape([len, v]), targets, 0.0, tp)?;
        Ok((ce * self.counted.clone().narrow(0, at, len)).sum())
    }
}

/// The logits at the positions `transformers`' attention mask keeps (gathered over the
/// vocabulary, its padding cut), and the causal-LM loss as `transformers` computes it, the
/// mean over the counted positions, with its gradients.
fn run(
    model: &parallel::Llama,
    f: &Fixture,
    vocab: usize,
    tp: &Comm,
    device: &Device,
) -> Result<(Vec<f32>, f32, GradientsParams), Error> {
    let batch = Batch::new(f, device);
    let logits = model.forward(batch.tokens.clone(), None);
    let loss = batch.loss_sum(logits.clone(), 0, tp)? / batch.n;
    let whole = all_gather(&**tp, logits.detach(), 2)?.narrow(2, 0, vocab);
    let whole: Vec<f32> = whole.into_data().iter::<f32>().collect();
    let logits = kept(&whole, f, vocab);
    let value = loss.clone().into_scalar::<f32>();
    Ok((
        logits,
        value,
        GradientsParams::from_grads(loss.backward(), model),
    ))
}

/// `transformers`' gradients written as a checkpoint under the parameters' names: read
/// through the same options as the weights, they come in the model's layout (linears
/// `[in, out]`, query and key features paired), split as the model is.
pub(super) fn grads_checkpoint(expected: &Fixture, dir: &Path) -> PathBuf {
    let grads: Vec<(String, Vec<usize>, Vec<f32>)> = (expected.iter())
        .filter_map(|(k, (shape, v))| {
            let values = v.iter().map(|x| *x as f32).collect();
            k.strip_prefix("grad.")
                .map(|n| (n.to_string(), shape.clone(), values))
        })
        .collect();
    let path = dir.join("grads.safetensors");
    write_safetensors(&path, &grads);
    path
}

/// A tied checkpoint has one table, whose gradient is the sum of both its uses: the output
/// layer's gradient (`[d, V]`) added to the embedding's (`[V, d]`), and the output's
/// reference (the table's gradient again) dropped.
fn sum_tied(config: &LlamaConfig, grads: &mut Values, want: &mut Values) {
    let output = grads
        .remove("output.weight")
        .expect("the output's gradient");
    want.remove("output.weight");
    let (d, v) = (config.d_model, config.vocab_size);
    let table = grads.get_mut("tok_embeddings.weight").expect("the table's");
    for (at, g) in table.iter_mut().enumerate() {
        *g += output[(at % d) * v + at / d];
    }
}

/// The rows of `logits` (`[b, s, vocab]`) at the positions `f`'s attention mask keeps.
fn kept<T: Copy + Into<f64>>(logits: &[T], f: &Fixture, vocab: usize) -> Vec<f32> {
    (logits.chunks(vocab))
        .zip(&f["attention_mask"].1)
        .filter(|(_, m)| **m == 1.0)
        .flat_map(|(row, _)| row.iter().map(|x| (*x).into() as f32))
        .collect()
}

/// The largest of each gradient's `‖got − want‖ / ‖want‖`, and its parameter; every parameter
/// of `want` must be in `got`.
pub(super) fn worst_gradient(got: &Values, want: &Values) -> (f32, String) {
    let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|x| x * x).sum::<f32>().sqrt();
    let mut worst = (0f32, String::new());
    for (name, want) in want {
        let Some(got) = got.get(name).filter(|g| g.len() == want.len()) else {
            return (f32::INFINITY, format!("{name} (no gradient of its size)"));
        };
        let diff =
            norm(&mut got.iter().zip(want).map(|(a, b)| a - b)) / norm(&mut want.iter().copied());
        if diff.is_nan() || diff > worst.0 {
            worst = (
                if diff.is_nan() { f32::INFINITY } else { diff },
                name.clone(),
            );
        }
    }
    worst
}

mod meta_format;
mod way_back;

/// The checkpoint in `tests/fixtures/{weights}` at TP 1 and 2 against what `transformers`
/// computed with it (in `tests/fixtures/{name}`).
fn matches_transformers(weights: &str, name: &str) -> Result<(), Error> {
    let checkpoint = hf::Checkpoint::open(&fixture(weights))?;
    let load = |tp: &Comm, device: &Device| checkpoint.load(tp, device);
    let (config, options) = (&checkpoint.config, checkpoint.options()?);
    agrees_with_transformers(weights, config, load, &options, name, &[1, 2])
}

/// The model `load` gives at each TP size of `sizes` against what `transformers` computed
/// (in `tests/fixtures/{name}`, its gradients read through `options`): logits within 1e-4,
/// loss within 1e-5, every gradient within 1e-5 of its norm, the greedy tokens equal.
fn agrees_with_transformers(
    weights: &str,
    config: &LlamaConfig,
    load: impl Fn(&Comm, &Device) -> Result<parallel::Llama, TpError> + Sync,
    options: &LoadOptions,
    name: &str,
    sizes: &[usize],
) -> Result<(), Error> {
    let dir = fixture(name);
    let expected = read_safetensors(&dir.join("expected.safetensors"));
    let generate = read_safetensors(&dir.join("generate.safetensors"));
    let scratch = scratch(weights);
    let want_grads = RecordSource::from_path(grads_checkpoint(&expected, &scratch));
    // The fixture's one unpadded prompt, and `transformers`' ten greedy tokens after it.
    let (shape, prompts) = &generate["prompt_ids"];
    let row = |v: &[f64], width: usize| -> Vec<i64> {
        v[width..2 * width].iter().map(|x| *x as i64).collect()
    };
    let prompt = row(prompts, shape[1]);
    let greedy = row(&generate["greedy"].1, generate["greedy"].0[1]);
    let want_logits = kept(&expected["logits"].1, &expected, config.vocab_size);
    let want_loss = expected["loss"].1[0] as f32;
    // No gradient of an output layer, under Hugging Face's name or Meta's: a tied table.
    let tied = !["grad.lm_head.weight", "grad.output.weight"]
        .iter()
        .any(|k| expected.contains_key(*k));
    for &tp in sizes {
        let ranks = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let model = load(g, d)?;
            let reference = parallel::Llama::load(config, &want_grads, options, g, d)?;
            let (logits, loss, grads) = run(&model, &expected, config.vocab_size, g, d)?;
            let tokens = model.generate(config, &prompt, greedy.len())?;
            Ok::<_, Error>((
                logits,
                loss,
                gathered(&model, Some(&grads), g),
                gathered(&reference, None, g),
                tokens[prompt.len()..].to_vec(),
            ))
        })?;
        for (rank, (logits, loss, mut grads, mut want_grads, tokens)) in
            ranks.into_iter().enumerate()
        {
            let what = format!("{weights}, TP {tp}, rank {rank}");
            if tied {
                sum_tied(config, &mut grads, &mut want_grads);
            }
            let d = super::max_abs_diff(&logits, &want_logits);
            assert!(d <= 1e-4, "{what}: logits off by {d}");
            assert!(
                (loss - want_loss).abs() <= 1e-5,
                "{what}: loss {loss} vs {want_loss}"
            );
            let (worst, param) = worst_gradient(&grads, &want_grads);
            assert!(
                worst <= 1e-5,
                "{what}: {param}'s gradient off by {worst:.2e} relative"
            );
            assert_eq!(tokens, greedy, "{what}: transformers' greedy tokens");
            println!("{what}: logits within {d:.1e}, gradients within {worst:.1e} ({param})");
        }
    }
    std::fs::remove_dir_all(scratch)?;
    Ok(())
}

/// Sharded over four safetensors files, with Llama 3's RoPE scaling and 4 query heads over 2
/// key/value heads.
#[test]
fn a_hugging_face_llama_in_the_users_llama_gives_transformers_numbers() -> Result<(), Error> {
    matches_transformers("hf_llama_tiny", "hf_llama_tiny")
}

/// The same checkpoint as PyTorch pickles (`pytorch_model-*.bin` and their index), read by
/// the same options.
#[test]
fn a_hugging_face_llama_of_pytorch_files_gives_transformers_numbers() -> Result<(), Error> {
    matches_transformers("hf_llama_tiny_bin", "hf_llama_tiny")
}

/// Llama 3.2's layout: the output layer tied to the embedding (no `lm_head.weight` in the one
/// file), the default RoPE at theta 500000, 8 query heads over 2 key/value heads, 90 tokens
/// (padded at TP 2). The model's own output layer reads the table (`with_tied`).
#[test]
fn a_tied_hugging_face_llama_in_the_users_llama_gives_transformers_numbers() -> Result<(), Error> {
    matches_transformers("hf_llama_tied_tiny", "hf_llama_tied_tiny")
}

/// The tied checkpoint split into two pipeline stages, at PP 2 and TP 2 × PP 2: each stage
/// reads its layers' shards, the last its output layer from the table the first stage holds
/// (`with_tied` across stages). Through Megatron's 1F1B schedule, a microbatch per sample,
/// the loss and every gradient are `transformers`'.
#[test]
fn a_tied_hugging_face_llama_in_pipeline_stages_gives_transformers_numbers() -> Result<(), Error> {
    let name = "hf_llama_tied_tiny";
    let checkpoint = hf::Checkpoint::open(&fixture(name))?;
    let config = &checkpoint.config;
    let expected = read_safetensors(&fixture(name).join("expected.safetensors"));
    let scratch = scratch("hf-llama-pp");
    let grads_path = grads_checkpoint(&expected, &scratch);
    let options = checkpoint.options()?;
    let samples = expected["input_ids"].0[0];
    for tp in [1, 2] {
        let ranks = launch::threads(
            &ParallelConfig::new(2 * tp, tp, 2),
            LaunchOptions::default(),
            |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let plan = pipeline::Llama::pp_plan(config);
                let stage = plan.stage(PipelinePosition::of(&ctx.state, 0))?;
                let load = |weights: &RecordSource| {
                    pipeline::Llama::load(config, weights, &options, &stage, g, d)
                };
                let (model, reference) = (
                    load(&RecordSource::from_hugging_face(&checkpoint.dir)?)?,
                    load(&RecordSource::from_path(&grads_path))?,
                );
                let batch = Batch::new(&expected, d);
                let step = |s: ForwardStep<'_, pipeline::Llama, 3>| {
                    let tokens = batch.tokens.clone().narrow(0, s.microbatch, 1);
                    let out = s.model.forward(tokens, s.input, None)?;
                    if !stage.is_last() {
                        return Ok(ChunkOutput::Activation(out));
                    }
                    // Backward runs on each microbatch's loss over M: the mean over all
                    // counted positions needs the sum times M over their count.
                    let loss = batch.loss_sum(out, s.microbatch, g)?;
                    let loss = loss * (samples as f32 / batch.n);
                    Ok::<_, Error>(ChunkOutput::Loss {
                        loss,
                        report: vec![],
                    })
                };
                let schedule = PipelineSchedule::new(2, samples);
                let p2p = ctx.p2p(P2pShapes::Variable);
                let config = ForwardBackwardConfig::new(schedule);
                let out = forward_backward_func(step, std::slice::from_ref(&model), &p2p, config)?;
                let global = |v: Values| -> Values {
                    v.into_iter()
                        .map(|(k, v)| (stage.global_name(&k), v))
                        .collect()
                };
                let losses = read_losses(&out.losses).iter().map(|l| l.loss).sum::<f64>();
                Ok::<_, Error>((
                    stage.is_last().then_some(losses as f32 / samples as f32),
                    global(gathered(&model, Some(&out.grads), g)),
                    global(gathered(&reference, None, g)),
                ))
            },
        )?;
        let (mut loss, mut grads, mut want) = (None, Values::new(), Values::new());
        for (l, g, w) in ranks {
            loss = loss.or(l);
            grads.extend(g);
            want.extend(w);
        }
        sum_tied(config, &mut grads, &mut want);
        let (loss, want_loss) = (loss.expect("the last stage's loss"), expected["loss"].1[0]);
        assert!(
            (f64::from(loss) - want_loss).abs() <= 1e-5,
            "TP {tp} × PP 2: loss {loss} vs {want_loss}"
        );
        let (worst, param) = worst_gradient(&grads, &want);
        assert!(
            worst <= 1e-5,
            "TP {tp} × PP 2: {param}'s gradient off by {worst:.2e}"
        );
        println!("{name}, TP {tp} × PP 2: gradients within {worst:.1e} ({param})");
    }
    std::fs::remove_dir_all(scratch)?;
    Ok(())
}

/// The tied checkpoint with every tensor split in two over two files (alternately by rows and
/// by columns, the norms too), read as `RecordSource::ModelParallel`: at TP 1 and 2 the model
/// holds what it reads from the one file, through the query and key transforms (joined whole
/// first) and the output layer tied to the embedding's parts.
#[test]
fn model_parallel_parts_meet_transforms_and_ties() -> Result<(), Error> {
    let fixture = fixture("hf_llama_tied_tiny");
    let checkpoint = hf::Checkpoint::open(&fixture)?;
    let dir = scratch("hf-llama-parts");
    let tensors: Vec<Named> = (read_safetensors(&fixture.join("model.safetensors")).into_iter())
        .map(|(k, (shape, v))| (k, shape, v.into_iter().map(|x| x as f32).collect()))
        .collect();
    let split = |i: usize, _: &str, shape: &[usize]| Some((i % 2).min(shape.len() - 1));
    let parts = write_parts(&dir, "part", &halves(&tensors, split));
    let (config, options) = (&checkpoint.config, checkpoint.options()?);
    for tp in [1, 2] {
        let ranks = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let from_parts = parallel::Llama::load(config, &parts, &options, g, d)?;
            let from_one = checkpoint.load(g, d)?;
            Ok::<_, Error>((gathered(&from_parts, None, g), gathered(&from_one, None, g)))
        })?;
        for (rank, (from_parts, from_one)) in ranks.into_iter().enumerate() {
            assert!(from_one.contains_key("output.weight"));
            assert_eq!(from_parts, from_one, "TP {tp}, rank {rank}");
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A checkpoint `transformers` wrote before 4.31, with each attention's `rotary_emb.inv_freq`
/// beside its weights: skipped, the rest loaded as from the checkpoint without them.
#[test]
fn an_older_checkpoints_rotary_buffers_are_skipped() -> Result<(), Error> {
    let fixture = fixture("hf_llama_tied_tiny");
    let dir = scratch("hf-llama-inv-freq");
    std::fs::copy(fixture.join("config.json"), dir.join("config.json"))?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        (read_safetensors(&fixture.join("model.safetensors")).into_iter())
            .map(|(k, (shape, v))| (k, shape, v.into_iter().map(|x| x as f32).collect()))
            .collect();
    for layer in 0..2 {
        let name = format!("model.layers.{layer}.self_attn.rotary_emb.inv_freq");
        tensors.push((name, vec![4], vec![1.0, 0.1, 0.01, 0.001]));
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    let (old, new) = (hf::Checkpoint::open(&dir)?, hf::Checkpoint::open(&fixture)?);
    let ranks = tp_ranks(1, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let (old, new) = (old.load(g, d)?, new.load(g, d)?);
        Ok::<_, Error>((gathered(&old, None, g), gathered(&new, None, g)))
    })?;
    let (old, new) = &ranks[0];
    assert_eq!(old, new);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// What the Llama cannot hold is refused before anything loads, naming the setting.
#[test]
fn a_checkpoint_the_users_llama_cannot_hold_is_an_error_naming_the_setting() -> Result<(), Error> {
    let dir = scratch("hf-llama-config");
    let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        fixture("hf_llama_tiny").join("config.json"),
    )?)?;
    let cases = [
        ("model_type", serde_json::json!("qwen2")),
        ("attention_bias", serde_json::json!(true)),
        ("hidden_act", serde_json::json!("gelu")),
        ("head_dim", serde_json::json!(8)),
        ("num_key_value_heads", serde_json::json!(3)),
    ];
    for (key, value) in cases {
        let mut json = base.clone();
        json[key] = value;
        std::fs::write(dir.join("config.json"), json.to_string())?;
        let e = hf::Checkpoint::open(&dir).err().expect("refused");
        assert!(e.contains(key), "{key}: {e}");
    }
    let mut json = base.clone();
    json["rope_parameters"]["rope_type"] = serde_json::json!("yarn");
    std::fs::write(dir.join("config.json"), json.to_string())?;
    let e = hf::Checkpoint::open(&dir).err().expect("refused");
    assert!(e.contains("rope_type") && e.contains("yarn"), "{e}");
    // transformers 4's form: `rope_theta` at the top (500000 for the tied one), the scaling
    // in `rope_scaling`, or `null`.
    for name in ["hf_llama_tiny", "hf_llama_tied_tiny"] {
        let text = std::fs::read_to_string(fixture(name).join("config.json"))?;
        let mut json: serde_json::Value = serde_json::from_str(&text)?;
        let mut rope = json["rope_parameters"].take();
        json["rope_theta"] = rope["rope_theta"].take();
        let rope = rope.as_object_mut().expect("rope_parameters");
        rope.remove("rope_theta");
        let default = rope.get("rope_type").and_then(|t| t.as_str()) == Some("default");
        json["rope_scaling"] = if default {
            serde_json::Value::Null
        } else {
            rope.clone().into()
        };
        json.as_object_mut().map(|o| o.remove("rope_parameters"));
        std::fs::write(dir.join("config.json"), json.to_string())?;
        let (four, five) = (
            hf::Checkpoint::open(&dir)?,
            hf::Checkpoint::open(&fixture(name))?,
        );
        assert_eq!(four.config.to_string(), five.config.to_string(), "{name}");
    }
    let tied = hf::Checkpoint::open(&fixture("hf_llama_tied_tiny"))?;
    assert_eq!(tied.config.rope_theta, 500000.0);
    assert!(tied.config.rope_scaling.is_none() && tied.tie_word_embeddings);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
