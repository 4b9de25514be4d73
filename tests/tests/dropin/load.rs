//! Shard-on-load: a record Burn's encoder saved (burnpack through `save_file`, safetensors
//! with PyTorch's names and `[out, in]` linears) loads into each rank's shards of the drop-in
//! encoder split by a plan, its own draws from another seed; the gathered weights are the plain ones
//! bit for bit and the output is the plain output. Records that do not fit are errors naming
//! the path.

use super::{
    B, D_MODEL, Error, S, config, encoder_record, padding, plain_encoder, solo, split_encoder,
};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::tensor::{Device, Tensor};
use burn_megatron::dropin::nn::transformer::TransformerEncoderInput as TpInput;
use burn_megatron::dropin::{LoadOptions, RecordSource, load_sharded};
use burn_megatron_tests::data;
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;
use std::path::{Path, PathBuf};

/// Each float parameter: its path, shape and values.
pub(super) fn params<M: Module>(module: &M) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    struct All(Vec<String>, Vec<(String, Vec<usize>, Vec<f32>)>);
    impl ModuleVisitor for All {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val();
            let values = burn_megatron_tests::values(t.clone());
            self.1.push((self.0.join("."), t.dims().to_vec(), values));
        }
    }
    let mut all = All(Vec::new(), Vec::new());
    module.visit(&mut all);
    all.1
}

/// Writes `tensors` (name, shape, f32 values) as a safetensors file.
pub(super) fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b);
            (name.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// `[rows, cols]` row-major values, transposed.
pub(super) fn transposed(shape: &[usize], v: &[f32]) -> Vec<f32> {
    let (r, c) = (shape[0], shape[1]);
    (0..c * r).map(|i| v[(i % r) * c + i / r]).collect()
}

pub(super) fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bm-dropin-load-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Burn's encoder saved as Burn writes it (`bpk`), and as a PyTorch port would (`encoder.`
/// prefix, `layer` for `layers`, linear weights `[out, in]`), whole and sharded by an index,
/// and with PyTorch's names for the norms' parameters too (`weight` and `bias` for `gamma`
/// and `beta`), read by the PyTorch adapter instead of patterns. Returns the sources with
/// the options that read them.
fn records(
    config: &TransformerEncoderConfig,
    bpk: &Path,
    dir: &Path,
) -> Vec<(RecordSource, LoadOptions)> {
    let plain = plain_encoder(config, bpk, &Device::flex());
    let torch: Vec<_> = params(&plain)
        .into_iter()
        .map(|(path, shape, v)| {
            let name = format!("encoder.{}", path.replace("layers.", "layer."));
            match shape.len() == 2 && path.ends_with(".weight") {
                true => (name, vec![shape[1], shape[0]], transposed(&shape, &v)),
                false => (name, shape, v),
            }
        })
        .collect();
    let st = dir.join("encoder.safetensors");
    write_safetensors(&st, &torch);
    // The same, sharded over two files as Hugging Face shards a checkpoint, with its index.
    let (a, b): (Vec<_>, Vec<_>) = torch
        .iter()
        .cloned()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [("shard-1.safetensors", a), ("shard-2.safetensors", b)] {
        let part: Vec<_> = part.into_iter().map(|(_, t)| t).collect();
        for (name, ..) in &part {
            weight_map.insert(name.clone(), file.into());
        }
        write_safetensors(&dir.join(file), &part);
    }
    let index = dir.join("model.safetensors.index.json");
    let json = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(&index, json.to_string()).unwrap();
    let torch_options = LoadOptions::default()
        .with_key_remap(r"^encoder\.layer\.", "layers.")
        .unwrap();
    let torch_names: Vec<_> = torch
        .iter()
        .map(|(name, shape, v)| {
            let name = name.replace(".gamma", ".weight").replace(".beta", ".bias");
            (name, shape.clone(), v.clone())
        })
        .collect();
    let named = dir.join("encoder-torch-names.safetensors");
    write_safetensors(&named, &torch_names);
    let adapter = torch_options.clone().with_pytorch_adapter(true);
    let torch_options = torch_options.with_transposed(r"\.weight$").unwrap();
    vec![
        (RecordSource::from_path(bpk), LoadOptions::default()),
        (RecordSource::from_path(&st), torch_options.clone()),
        (RecordSource::from_path(&index), torch_options),
        (RecordSource::from_path(&named), adapter),
    ]
}

#[test]
fn a_plain_record_loads_into_each_ranks_shards() -> Result<(), Error> {
    let config = config(true, 0.0);
    let dir = scratch("parity");
    let bpk = encoder_record(&config, &dir, "encoder.bpk");
    let sources = records(&config, &bpk, &dir);
    let device = Device::flex();
    let plain = plain_encoder(&config, &bpk, &device);
    let whole = gathered(&plain, None, &solo());
    let x = |d: &Device| data([B, S, D_MODEL], 0, 1, d);
    let y_plain = burn_megatron_tests::values(
        plain.forward(TransformerEncoderInput::new(x(&device)).mask_pad(padding(S, &device))),
    );
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            // The plan's own draws: every value must come from the record.
            let fresh = split_encoder(&config, g, 99, d)?;
            let ids: Vec<_> = params_ids(&fresh);
            let local: u64 = params(&fresh).iter().map(|p| 4 * p.2.len() as u64).sum();
            let mut runs = Vec::new();
            for (source, options) in &sources {
                let (encoder, report) = load_sharded(fresh.clone(), source, g, options)?;
                assert_eq!(params_ids(&encoder), ids, "the parameters keep their ids");
                assert_eq!(report.shard_bytes, local, "{source:?}");
                assert!(report.missing.is_empty() && report.unused.is_empty());
                let input = TpInput::new(x(d)).mask_pad(padding(S, d));
                let y = burn_megatron_tests::values(encoder.forward(input));
                runs.push((gathered(&encoder, None, g), y, report));
            }
            Ok::<_, Error>(runs)
        })?;
        for (rank, runs) in out.iter().enumerate() {
            for (i, (weights, y, report)) in runs.iter().enumerate() {
                let what = format!("TP {tp}, rank {rank}, {:?}", sources[i].0);
                assert_eq!(
                    weights, &whole,
                    "{what}: the gathered weights are the plain ones"
                );
                let dy = super::max_abs_diff(y, &y_plain);
                assert!(dy < 1e-5, "{what}: output off by {dy}");
                // A shard that is not a run of rows reads its whole tensor's pages: the widest
                // is the feed-forward's [16, 32] (Burn's column shard of linear_inner; in the
                // transposed file, the row shard of linear_outer).
                let largest = (D_MODEL * super::D_FF * 4) as u64;
                assert_eq!(report.largest_whole_tensor_bytes, largest, "{what}");
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

fn params_ids<M: Module>(module: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(p.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// PyTorch checkpoints written by torch (`tests/fixtures/pytorch_encoder`, see
/// `make_pytorch_checkpoints.py`): the ZIP and the legacy containers, a state dict at the top
/// level and one under `state_dict`, a bf16 tensor and a strided view among them. Each loads
/// into every rank's shards exactly as the same tensors in safetensors do (another reader,
/// the mapped path), at TP 1 and 2; a key that is not there is an error naming the file.
#[test]
fn pytorch_checkpoints_load_into_each_ranks_shards_as_their_safetensors() -> Result<(), Error> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/pytorch_encoder");
    let config = config(true, 0.0);
    let options = LoadOptions::default()
        .with_key_remap(r"^encoder\.layer\.", "layers.")?
        .with_transposed(r"\.weight$")?;
    let pytorch = |file: &str, key: Option<&str>| RecordSource::Pytorch {
        path: dir.join(file),
        top_level_key: key.map(str::to_string),
    };
    // An index naming PyTorch files (as `pytorch_model.bin.index.json` does), beside a copy.
    let sharded = scratch("pytorch-index");
    std::fs::copy(dir.join("encoder.pt"), sharded.join("part.bin"))?;
    let bytes = std::fs::read(dir.join("encoder.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let weight_map: serde_json::Map<_, _> = (st.names().into_iter())
        .map(|k| (k.to_string(), "part.bin".into()))
        .collect();
    let index = sharded.join("pytorch_model.bin.index.json");
    std::fs::write(
        &index,
        serde_json::json!({ "weight_map": weight_map }).to_string(),
    )?;
    let sources = [
        RecordSource::from_path(dir.join("encoder.pt")),
        pytorch("checkpoint.pt", Some("state_dict")),
        RecordSource::from_path(dir.join("encoder_legacy.pt")),
        RecordSource::from_path(&index),
    ];
    assert_eq!(sources[0], pytorch("encoder.pt", None));
    let reference = RecordSource::from_path(dir.join("encoder.safetensors"));
    let d = Device::flex();
    let fresh = |g: &burn_megatron::comm::Comm, d: &Device| split_encoder(&config, g, 99, d);
    let (want, _) = load_sharded(fresh(&solo(), &d)?, &reference, &solo(), &options)?;
    let want = gathered(&want, None, &solo());
    for tp in [1, 2] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let mut got = Vec::new();
            for source in &sources {
                let (encoder, report) = load_sharded(fresh(g, d)?, source, g, &options)?;
                assert!(report.missing.is_empty() && report.unused.is_empty());
                // Every tensor of a PyTorch checkpoint is read whole: the largest is
                // the feed-forward's 16 x 32 in f32.
                let largest = (D_MODEL * super::D_FF * 4) as u64;
                assert_eq!(report.largest_whole_tensor_bytes, largest, "{source:?}");
                got.push(gathered(&encoder, None, g));
            }
            Ok::<_, Error>(got)
        })?;
        for (rank, got) in out.iter().enumerate() {
            for (weights, source) in got.iter().zip(&sources) {
                assert_eq!(weights, &want, "TP {tp}, rank {rank}: {source:?}");
            }
        }
    }
    let e = load_sharded(
        fresh(&solo(), &d)?,
        &pytorch("checkpoint.pt", Some("model")),
        &solo(),
        &options,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("checkpoint.pt"), "{e}");
    std::fs::remove_dir_all(sharded)?;
    Ok(())
}

#[test]
fn a_record_that_does_not_fit_is_an_error_naming_the_path() -> Result<(), Error> {
    let dir = scratch("errors");
    let d = Device::flex();
    let two = config(true, 0.0);
    let one = TransformerEncoderConfig::new(D_MODEL, super::D_FF, super::HEADS, 1);
    let wide = TransformerEncoderConfig::new(D_MODEL, 2 * super::D_FF, super::HEADS, 2);
    let save = |config: &TransformerEncoderConfig, name: &str| {
        let path = dir.join(name);
        config.init(&d).save_file(&path).unwrap();
        RecordSource::from_path(path)
    };
    let (two_rec, one_rec, wide_rec) = (
        save(&two, "two.bpk"),
        save(&one, "one.bpk"),
        save(&wide, "wide.bpk"),
    );
    let model = |config| split_encoder(config, &solo(), 1, &d).unwrap();
    let load = |config, source: &RecordSource, options: &LoadOptions| {
        load_sharded(model(config), source, &solo(), options).map(|(_, report)| report)
    };
    let strict = LoadOptions::default();
    // Two layers wanted, one saved.
    let e = load(&two, &one_rec, &strict).unwrap_err().to_string();
    assert!(
        e.contains("layers.1.") && e.contains("not in the record"),
        "{e}"
    );
    let report = load(&two, &one_rec, &strict.clone().with_allow_missing(true))?;
    assert!(report.missing.iter().all(|p| p.starts_with("layers.1.")));
    assert_eq!(report.missing.len(), report.loaded.len());
    // One layer wanted, two saved.
    let e = load(&one, &two_rec, &strict).unwrap_err().to_string();
    assert!(
        e.contains("no parameter takes") && e.contains("layers.1.mha.query.weight"),
        "{e}"
    );
    let report = load(&one, &two_rec, &strict.clone().with_allow_unused(true))?;
    assert_eq!(report.unused.len(), report.loaded.len());
    // The feed-forward saved twice as wide.
    let e = load(&two, &wide_rec, &strict).unwrap_err().to_string();
    assert!(
        e.contains("layers.0.pwff.linear_inner.weight")
            && e.contains("[16, 64]")
            && e.contains("[16, 32]"),
        "{e}"
    );
    // Renames that send two tensors to one path; a rule that is not a pattern.
    let clash = strict
        .clone()
        .with_key_remap(r"\.(gamma|beta)$", ".gamma")?;
    let e = load(&two, &two_rec, &clash).unwrap_err().to_string();
    assert!(
        e.contains("both map to the module path") && e.contains("norm_1.gamma"),
        "{e}"
    );
    assert!(LoadOptions::default().with_transposed("[").is_err());
    // Transposing a 1-D tensor is refused, naming it.
    let e = load(&two, &two_rec, &strict.clone().with_transposed("gamma")?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("norm_1.gamma") && e.contains("not 2"), "{e}");
    let e = load(
        &two,
        &RecordSource::from_path(dir.join("absent.bpk")),
        &strict,
    )
    .unwrap_err();
    assert!(e.to_string().contains("absent.bpk"), "{e}");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A Hugging Face Llama stores its query and key projections for `rotate_half`: each head's
/// features in two halves, where Burn's `RotaryEncoding` pairs adjacent ones. Written so
/// (linears `[out, in]`), the record loads into Burn's layout at TP 1, 2 and 4 (split by
/// heads) through `rotary_half_to_interleaved`, bit for bit; without it, it does not.
#[test]
fn a_rotary_layout_is_rearranged_while_it_loads() -> Result<(), Error> {
    use burn_megatron::dropin::rotary_half_to_interleaved;
    let config = config(true, 0.0);
    let dir = scratch("rotary");
    let bpk = encoder_record(&config, &dir, "encoder.bpk");
    let plain = plain_encoder(&config, &bpk, &Device::flex());
    let whole = gathered(&plain, None, &solo());
    // Burn's interleaved features of each head, back in Hugging Face's halves.
    let d = D_MODEL / super::HEADS;
    let to_halves = |shape: &[usize], v: &[f32]| -> Vec<f32> {
        let last = shape[shape.len() - 1];
        let mut out = v.to_vec();
        for (row_in, row_out) in v.chunks(last).zip(out.chunks_mut(last)) {
            for (f, value) in row_in.iter().enumerate() {
                let (h, i) = (f / d, f % d);
                row_out[h * d + (i % 2) * (d / 2) + i / 2] = *value;
            }
        }
        out
    };
    let rotary = |p: &str| p.ends_with("query.weight") || p.ends_with("key.weight");
    let rotary_bias = |p: &str| p.ends_with("query.bias") || p.ends_with("key.bias");
    let hf: Vec<(String, Vec<usize>, Vec<f32>)> = params(&plain)
        .into_iter()
        .map(
            |(name, shape, v)| match (rotary(&name), rotary_bias(&name)) {
                (true, _) => {
                    let v = transposed(&shape, &to_halves(&shape, &v));
                    (name, vec![shape[1], shape[0]], v)
                }
                (_, true) => (name.clone(), shape.clone(), to_halves(&shape, &v)),
                _ => (name, shape, v),
            },
        )
        .collect();
    let path = dir.join("hf-rotary.safetensors");
    write_safetensors(&path, &hf);
    let source = RecordSource::from_path(&path);
    let stored = LoadOptions::default().with_transposed(r"\.(query|key)\.weight$")?;
    let options = stored.clone().with_transform(
        r"\.(query|key)\.(weight|bias)$",
        rotary_half_to_interleaved(super::HEADS),
    )?;
    for tp in [1, 2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let fresh = split_encoder(&config, g, 99, d)?;
            let (rearranged, _) = load_sharded(fresh.clone(), &source, g, &options)?;
            let (as_stored, _) = load_sharded(fresh, &source, g, &stored)?;
            Ok::<_, Error>((
                gathered(&rearranged, None, g),
                gathered(&as_stored, None, g),
            ))
        })?;
        for (rank, (rearranged, as_stored)) in out.iter().enumerate() {
            assert_eq!(
                rearranged, &whole,
                "TP {tp}, rank {rank}: the plain weights"
            );
            assert_ne!(
                as_stored, &whole,
                "TP {tp}, rank {rank}: not without the transform"
            );
        }
    }
    // A transform that changes the shape is an error naming the path.
    let bad = LoadOptions::default().with_transform(r"\.query\.weight$", |_| {
        Ok(burn::tensor::TensorData::new(vec![0f32], [1]))
    })?;
    let e = tp_ranks(1, |ctx| {
        let fresh = split_encoder(&config, &ctx.groups.tp, 99, &ctx.device)?;
        load_sharded(fresh, &source, &ctx.groups.tp, &bad).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("query.weight: the transform returned [1]"),
        "{e}"
    );
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A language model whose output layer a tied checkpoint does not hold: its fields in an
/// order that visits the output before the embedding it is tied to, and each part optional,
/// as a pipeline stage holds it.
#[derive(burn::module::Module, Debug)]
struct TiedLm {
    output: Option<burn_megatron::dropin::nn::Linear>,
    layers: Vec<burn_megatron::dropin::nn::Linear>,
    embed: Option<burn_megatron::dropin::nn::Embedding>,
}

impl TiedLm {
    fn new(output: bool, layers: usize, embed: bool, device: &Device) -> Self {
        use burn_megatron::dropin::nn::{EmbeddingConfig, LinearConfig};
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        Self {
            output: output.then(|| linear(TIED_D, TIED_V)),
            layers: (0..layers).map(|_| linear(TIED_D, TIED_D)).collect(),
            embed: embed.then(|| EmbeddingConfig::new(TIED_V, TIED_D).init(device)),
        }
    }
}

const TIED_V: usize = 10;
const TIED_D: usize = 4;

/// `with_tied`: a parameter the record lacks reads another path's tensor, in its own layout
/// and split: an output layer `[d, V]` from a tied checkpoint's table `[V, d]`, at TP 1 and 2,
/// visited before its source, and on the last pipeline stage, where the first holds the
/// embedding. Without it, or tied to a path the record lacks, the error names both. Where the
/// record holds the parameter's own tensor, that one. And `with_skipped`: a tensor the model
/// lacks, skipped and listed, not an error.
#[test]
fn a_tied_parameter_reads_its_sources_tensor() -> Result<(), Error> {
    use burn_megatron::dropin::{PpPlan, TpPlan};
    use burn_megatron::topology::PipelinePosition;
    let table: Vec<f32> = (0..TIED_V * TIED_D).map(|i| i as f32 * 0.1).collect();
    let layer: Vec<f32> = (0..TIED_D * TIED_D).map(|i| i as f32).collect();
    let dir = scratch("tied");
    let path = dir.join("tied.safetensors");
    let tensor =
        |name: &str, shape: &[usize], v: &[f32]| (name.to_string(), shape.to_vec(), v.to_vec());
    write_safetensors(
        &path,
        &[
            tensor("embed.weight", &[TIED_V, TIED_D], &table),
            tensor("layers.0.weight", &[TIED_D, TIED_D], &layer),
            tensor("layers.1.weight", &[TIED_D, TIED_D], &layer),
        ],
    );
    let source = RecordSource::from_path(&path);
    let untied = LoadOptions::default().with_pytorch_adapter(true);
    let options = untied.clone().with_tied("output.weight", "embed.weight");
    let tied = vec![("output.weight".to_string(), "embed.weight".to_string())];
    // The output's weight in Burn's `[in, out]`: the table transposed.
    let output = transposed(&[TIED_V, TIED_D], &table);
    for tp in [1, 2] {
        let ranks = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let plan = TpPlan::new().vocab(&["embed", "output"])?;
            let model = plan.apply(TiedLm::new(true, 2, true, d), g)?;
            let (model, report) = load_sharded(model, &source, g, &options)?;
            Ok::<_, Error>((gathered(&model, None, g), report))
        })?;
        for (rank, (weights, report)) in ranks.iter().enumerate() {
            assert_eq!(weights["output.weight"], output, "TP {tp}, rank {rank}");
            assert_eq!(weights["embed.weight"], table, "TP {tp}, rank {rank}");
            assert_eq!(report.tied, tied, "TP {tp}, rank {rank}");
            assert!(report.unused.is_empty(), "{:?}", report.unused);
        }
    }
    let plan = PpPlan::new("layers", 2).first(&["embed"]).last(&["output"]);
    let last = plan.stage(PipelinePosition::new(2, 1, 1, 0))?;
    let stage = TiedLm::new(true, 1, false, &Device::flex());
    let (stage, report) =
        load_sharded(stage, &source, &solo(), &last.load_options(options.clone()))?;
    assert_eq!(gathered(&stage, None, &solo())["output.weight"], output);
    assert_eq!(report.tied, tied);
    let mut elsewhere = report.elsewhere;
    elsewhere.sort();
    assert_eq!(elsewhere, ["embed.weight", "layers.0.weight"]);
    let whole = || TiedLm::new(true, 2, true, &Device::flex());
    let e = load_sharded(whole(), &source, &solo(), &untied).unwrap_err();
    assert!(
        e.to_string().contains("output.weight: not in the record"),
        "{e}"
    );
    let absent = untied.clone().with_tied("output.weight", "head.weight");
    let e = load_sharded(whole(), &source, &solo(), &absent).unwrap_err();
    assert!(e.to_string().contains("nor `head.weight`"), "{e}");
    // A model without the source's own parameter: the tensor is used, not unused.
    let headless = TiedLm::new(true, 2, false, &Device::flex());
    let (_, report) = load_sharded(headless, &source, &solo(), &options)?;
    assert!(
        report.unused.is_empty() && report.tied == tied,
        "{report:?}"
    );
    // Tied within the layer stack, by the whole model's names: the last stage's only layer
    // (its `layers.0`) is the model's `layers.1`, and reads the first stage's `layers.0`.
    let stack = untied
        .clone()
        .with_tied("layers.1.weight", "layers.0.weight");
    let partial = dir.join("partial.safetensors");
    write_safetensors(
        &partial,
        &[tensor("layers.0.weight", &[TIED_D, TIED_D], &layer)],
    );
    let stage = TiedLm::new(false, 1, false, &Device::flex());
    let options = last.load_options(stack.with_allow_unused(true));
    let (stage, report) =
        load_sharded(stage, &RecordSource::from_path(&partial), &solo(), &options)?;
    let read = gathered(&stage, None, &solo())["layers.0.weight"].clone();
    assert_eq!(read, transposed(&[TIED_D, TIED_D], &layer));
    let pair = ("layers.1.weight".to_string(), "layers.0.weight".to_string());
    assert_eq!(report.tied, [pair]);
    // Its own tensor, where the record holds one, comes first.
    let own: Vec<f32> = (0..TIED_D * TIED_V).map(|i| -(i as f32)).collect();
    let full = dir.join("untied.safetensors");
    write_safetensors(
        &full,
        &[
            tensor("embed.weight", &[TIED_V, TIED_D], &table),
            tensor("output.weight", &[TIED_V, TIED_D], &own),
            tensor("layers.0.weight", &[TIED_D, TIED_D], &layer),
            tensor("layers.1.weight", &[TIED_D, TIED_D], &layer),
            tensor("pooler.weight", &[TIED_D, TIED_D], &layer),
        ],
    );
    // With a pooler the model lacks: an error naming it, unless skipped.
    let full = RecordSource::from_path(&full);
    let options = untied.with_tied("output.weight", "embed.weight");
    let e = load_sharded(whole(), &full, &solo(), &options).unwrap_err();
    assert!(
        e.to_string().contains("no parameter takes: pooler.weight"),
        "{e}"
    );
    let options = options.with_skipped(r"^pooler\.")?;
    let (model, report) = load_sharded(whole(), &full, &solo(), &options)?;
    let read = gathered(&model, None, &solo())["output.weight"].clone();
    assert_eq!(
        (read, report.tied),
        (transposed(&[TIED_V, TIED_D], &own), vec![])
    );
    assert_eq!(report.skipped, ["pooler.weight"]);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
