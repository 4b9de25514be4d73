//! A vocabulary that does not split over the tensor-parallel ranks (33 tokens at TP 2 and 4)
//! padded as Megatron pads it (`make_vocab_size_divisible_by`): the embedding's rows and the
//! output layer's columns and bias are padded with zeros, the padding logits masked, and a
//! record of the real size (burnpack, or PyTorch-style safetensors with the output layer
//! `[vocab, d]`) loads into the padded shards. Loss and gathered gradients are the plain
//! model's, with the vocabulary-parallel loss over split logits and with Burn's own loss over
//! gathered ones, with and without label smoothing; the padding stays zero, with a zero
//! gradient.

use super::Error;
use super::load::{params, scratch, transposed, write_safetensors};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::Comm;
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::dropin::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron::tensor_parallel::{
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_padded,
};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;

/// Neither 2 nor 4 divides it.
const VOCAB: usize = 33;
const D: usize = 8;
/// Padded to 40 at TP 2 (20 a rank, 7 of padding on the second) and to 48 at TP 4 (12 a
/// rank: the third holds 9 real and 3 padding, the fourth only padding).
const DIVISIBLE_BY: usize = 4;
/// Label smoothing of the losses compared: none, and Burn's over the real vocabulary.
const SMOOTHING: [f32; 2] = [0.0, 0.1];

/// A language model as a Burn user writes it, with a biased output layer.
#[derive(Module, Debug)]
struct Lm {
    wte: Embedding,
    lm_head: Linear,
}

impl Lm {
    fn new(device: &Device) -> Self {
        Self {
            wte: EmbeddingConfig::new(VOCAB, D).init(device),
            lm_head: LinearConfig::new(D, VOCAB).init(device),
        }
    }

    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.lm_head.forward(self.wte.forward(ids).tanh())
    }
}

/// Ids with the last real token among them (held next to the padding).
fn ids(device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..2 * 5).map(|i| ((i * 7 + 32) % VOCAB) as i64).collect();
    Tensor::from_data(TensorData::new(v, [2, 5]), device)
}

fn labels(device: &Device) -> Tensor<1, Int> {
    ids(device).reshape([10]).flip([0])
}

/// The loss of `lm` over split logits (vocabulary-parallel, with label smoothing over the
/// real vocabulary) or whole ones (Burn's, the same smoothing), its value and gathered
/// gradients.
fn run(lm: &Lm, smoothing: f32, tp: &Comm, device: &Device) -> Result<(f32, super::Values), Error> {
    let logits = lm.forward(ids(device));
    let v = logits.dims()[2];
    let logits = logits.reshape([10, v]);
    let loss = match v == VOCAB {
        true => CrossEntropyLossConfig::new()
            .with_smoothing((smoothing > 0.0).then_some(smoothing))
            .init(device)
            .forward(logits, labels(device)),
        false => {
            let vocab = lm.lm_head.d_output();
            vocab_parallel_cross_entropy_padded(logits, labels(device), smoothing, vocab, tp)?
                .mean()
        }
    };
    let value = loss.clone().into_scalar::<f32>();
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), lm);
    Ok((value, gathered(lm, Some(&grads), tp)))
}

/// The padding of a split tensor (its entries past the real vocabulary along `dim`), gathered.
fn padding<const N: usize>(t: Tensor<N>, dim: usize, tp: &Comm) -> Vec<f32> {
    let full = all_gather(&**tp, t, dim).expect("gather");
    let n = full.dims()[dim];
    burn_megatron_tests::values(full.narrow(dim, VOCAB, n - VOCAB))
}

#[test]
fn a_vocabulary_that_does_not_split_is_padded_and_trains_as_the_plain_one() -> Result<(), Error> {
    let dir = scratch("vocab");
    let record = dir.join("lm.bpk");
    let device = Device::flex();
    device.seed(11);
    let plain = Lm::new(&device);
    plain.clone().save_file(&record)?;
    // The PyTorch layout of the same weights: `lm_head.weight` as `[vocab, d]`.
    let torch: Vec<_> = params(&plain)
        .into_iter()
        .map(|(name, shape, v)| match name.as_str() {
            "lm_head.weight" => (name, vec![shape[1], shape[0]], transposed(&shape, &v)),
            _ => (name, shape, v),
        })
        .collect();
    write_safetensors(&dir.join("lm.safetensors"), &torch);
    let sources = [
        (RecordSource::from_path(&record), LoadOptions::default()),
        (
            RecordSource::from_path(dir.join("lm.safetensors")),
            LoadOptions::default().with_transposed("^lm_head.weight$")?,
        ),
    ];
    let plain_values: std::collections::BTreeMap<_, _> = params(&plain)
        .into_iter()
        .map(|(name, _, v)| (name, v))
        .collect();
    let plain = &plain_values;
    let ad = Device::flex().autodiff();
    // Burn's loss on Burn's logits, without and with label smoothing (over the 33 real
    // tokens: smoothing over the padding too would add ε·10⁴·pad/V to the loss).
    let mut references = Vec::new();
    for smoothing in SMOOTHING {
        let lm = Lm::new(&ad).load_file(&record);
        references.push(run(&lm, smoothing, &super::solo(), &ad)?);
    }
    let plan = |gather: bool| -> Result<TpPlan, Error> {
        let plan = TpPlan::new().vocab(&["wte"])?.with_seed(3);
        let plan = match gather {
            true => plan.gathered_vocab(&["lm_head"])?,
            false => plan.vocab(&["lm_head"])?,
        };
        Ok(plan.make_vocab_size_divisible_by(DIVISIBLE_BY)?)
    };
    // A plan's own draws at TP 1 (padded to 36): the reference for every TP size.
    let drawn = gathered(
        &plan(false)?.apply(Lm::new(&device), &super::solo())?,
        None,
        &super::solo(),
    );
    for tp in [2, 4] {
        for gather in [false, true] {
            for (source, options) in &sources {
                let out = tp_ranks(tp, |ctx| {
                    let (g, d) = (&ctx.groups.tp, &ctx.device);
                    // A model loaded whole, then split: its values cut and padded.
                    let whole = plan(gather)?.apply(Lm::new(d).load_file(&record), g)?;
                    let whole_padding = padding(whole.lm_head.weight.val(), 1, g);
                    let whole = gathered(&whole, None, g);
                    let lm = plan(gather)?.apply(Lm::new(d), g)?;
                    assert_eq!(lm.wte.num_embeddings(), VOCAB);
                    let own = gathered(&lm, None, g);
                    let own_padding = padding(lm.wte.weight.val(), 0, g);
                    let (lm, _) = load_sharded(lm, source, g, options)?;
                    assert_eq!(lm.lm_head.d_output(), VOCAB);
                    let runs = SMOOTHING
                        .into_iter()
                        .map(|smoothing| run(&lm, smoothing, g, d))
                        .collect::<Result<Vec<_>, _>>()?;
                    let mut zeros = own_padding;
                    zeros.extend(whole_padding);
                    zeros.extend(padding(lm.wte.weight.val(), 0, g));
                    zeros.extend(padding(lm.lm_head.weight.val(), 1, g));
                    zeros.extend(padding(lm.lm_head.bias.as_ref().unwrap().val(), 0, g));
                    Ok::<_, Error>((own, whole, runs, zeros))
                })?;
                for (rank, (own, whole, runs, zeros)) in out.iter().enumerate() {
                    let what = format!("TP {tp}, gathered {gather}, {:?}, rank {rank}", source);
                    assert_eq!(own, &drawn, "{what}: the plan draws as at TP 1");
                    assert_eq!(whole, plain, "{what}: a loaded model splits to its values");
                    assert!(zeros.iter().all(|z| *z == 0.0), "{what}: padding {zeros:?}");
                    for (((l, gr), (loss, grads)), eps) in
                        runs.iter().zip(&references).zip(SMOOTHING)
                    {
                        let what = format!("{what}, smoothing {eps}");
                        assert!((l - loss).abs() < 1e-5, "{what}: loss {l} against {loss}");
                        let (worst, name) = super::grad_diff(gr, grads);
                        assert!(worst < 1e-5, "{what}: {name} off by {worst}");
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// The padding's gradient is zero, so the padding stays zero however long the model trains;
/// its logits never win an argmax even against very negative real ones.
#[test]
fn the_padding_takes_no_gradient_and_no_probability() -> Result<(), Error> {
    let out = tp_ranks(4, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let plan = TpPlan::new().vocab(&["wte", "lm_head"])?;
        let lm = plan
            .make_vocab_size_divisible_by(DIVISIBLE_BY)?
            .apply(Lm::new(d), g)?;
        let logits = lm.forward(ids(d));
        // Over the whole padded vocabulary (the last rank holds only padding).
        let whole = all_gather(&**g, logits.clone().detach(), 2)?;
        let probs = burn::tensor::activation::softmax(whole, 2).narrow(2, VOCAB, 48 - VOCAB);
        let probs = burn_megatron_tests::values(probs);
        let loss = vocab_parallel_cross_entropy(logits.reshape([10, 12]), labels(d), 0.0, g)?;
        let grads = burn::optim::GradientsParams::from_grads(loss.mean().backward(), &lm);
        let grad = |p: &burn::module::Param<Tensor<2>>, dim| {
            padding(grads.get::<2>(p.id).unwrap(), dim, g)
        };
        let mut zeros = grad(&lm.wte.weight, 0);
        zeros.extend(grad(&lm.lm_head.weight, 1));
        Ok::<_, Error>((probs, zeros))
    })?;
    let (probs, zeros) = &out[0];
    assert!(
        zeros.iter().all(|z| *z == 0.0),
        "padding gradients {zeros:?}"
    );
    assert!(
        probs.iter().all(|p| *p == 0.0),
        "padding probabilities {probs:?}"
    );
    Ok(())
}

/// A vocabulary that does not split without padding, a gathered vocabulary on an embedding,
/// and a record padded otherwise than the model are errors naming the layer; a record padded
/// as the model is (a Megatron checkpoint's table) loads as it is, its padding rows too.
#[test]
fn a_vocabulary_padded_wrongly_or_not_at_all_is_an_error_naming_the_layer() -> Result<(), Error> {
    let errors = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let err = |plan: TpPlan| plan.apply(Lm::new(d), g).unwrap_err().to_string();
        let unpadded = err(TpPlan::new().vocab(&["wte"])?);
        let gathered_embedding = err(TpPlan::new().gathered_vocab(&["wte"])?);
        // Tables of 36 rows (padded otherwise: TP 2 with 4 pads to 40) and of 40.
        let dir = scratch(&format!("vocab-rows-{}", g.group().rank()));
        let mut tables = Vec::new();
        for rows in [36, 40] {
            let file = dir.join(format!("{rows}.safetensors"));
            let mut tensors = params(&Lm::new(&Device::flex()));
            let table: Vec<f32> = (0..rows * D).map(|i| i as f32).collect();
            tensors.retain(|t| t.0 != "wte.weight");
            tensors.push(("wte.weight".into(), vec![rows, D], table));
            write_safetensors(&file, &tensors);
            let lm = TpPlan::new().vocab(&["wte", "lm_head"])?;
            let lm = lm
                .make_vocab_size_divisible_by(DIVISIBLE_BY)?
                .apply(Lm::new(d), g)?;
            let source = RecordSource::from_path(&file);
            tables.push(
                load_sharded(lm, &source, g, &LoadOptions::default())
                    .map(|(lm, _)| burn_megatron_tests::values(lm.wte.weight.val()))
                    .map_err(|e| e.to_string()),
            );
        }
        std::fs::remove_dir_all(dir)?;
        Ok::<_, Error>((vec![unpadded, gathered_embedding], tables))
    })?;
    for (rank, (_, tables)) in errors.iter().enumerate() {
        let bad = tables[0].as_ref().unwrap_err();
        assert!(
            bad.contains("wte.weight") && bad.contains("[36, 8]") && bad.contains("[33, 8]"),
            "{bad}"
        );
        // Rows 20 × rank onwards of the 40-row table, padding rows included.
        let want: Vec<f32> = (rank * 20 * D..(rank + 1) * 20 * D)
            .map(|i| i as f32)
            .collect();
        assert_eq!(tables[1].as_ref().unwrap(), &want, "rank {rank}");
    }
    let e = &errors[0].0;
    assert!(
        e[0].contains("wte.weight")
            && e[0].contains("33")
            && e[0].contains("make_vocab_size_divisible_by"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("wte.weight") && e[1].contains("GatheredVocab"),
        "{}",
        e[1]
    );
    assert!(TpPlan::new().make_vocab_size_divisible_by(0).is_err());
    Ok(())
}

/// A split model (here with a padded vocabulary) writes the record the plain model saves:
/// Burn's `load_file` reads it into the plain model with every weight the split one holds,
/// bit for bit, and `load_sharded` into another TP size; a write that fails is an error on
/// every rank.
#[test]
fn a_split_model_saves_the_record_the_plain_model_loads() -> Result<(), Error> {
    use burn_megatron::dropin::save_gathered;
    let dir = scratch("save");
    // Each TP size draws other weights (seed 20 + TP), so the record read at TP 4 shows.
    let plan = |seed: u64| -> Result<TpPlan, Error> {
        let plan = TpPlan::new().vocab(&["wte", "lm_head"])?.with_seed(seed);
        Ok(plan.make_vocab_size_divisible_by(DIVISIBLE_BY)?)
    };
    let saved = |tp: usize| dir.join(format!("tp{tp}.bpk"));
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let lm = plan(20 + tp as u64)?.apply(Lm::new(d), g)?;
            save_gathered(&lm, saved(tp), g)?;
            let missing = save_gathered(&lm, dir.join("missing/lm.bpk"), g);
            // The TP 2 record, read at TP 4.
            let reloaded = match tp {
                4 => {
                    let source = RecordSource::from_path(saved(2));
                    let fresh = plan(5)?.apply(Lm::new(d), g)?;
                    let (fresh, _) = load_sharded(fresh, &source, g, &LoadOptions::default())?;
                    Some(gathered(&fresh, None, g))
                }
                _ => None,
            };
            Ok::<_, Error>((
                gathered(&lm, None, g),
                missing.map_err(|e| e.to_string()),
                reloaded,
            ))
        })?;
        let plain = Lm::new(&Device::flex()).try_load_file(saved(tp))?;
        let plain: super::Values = params(&plain).into_iter().map(|(n, _, v)| (n, v)).collect();
        for (rank, (split, missing, reloaded)) in out.iter().enumerate() {
            assert_eq!(split, &plain, "TP {tp}, rank {rank}: the saved record");
            let e = missing.as_ref().unwrap_err();
            assert!(e.contains("missing"), "TP {tp}, rank {rank}: {e}");
            if let Some(reloaded) = reloaded {
                assert_ne!(reloaded, split, "TP 4 drew other weights than TP 2");
            }
        }
        if tp == 4 {
            let two = Lm::new(&Device::flex()).try_load_file(saved(2))?;
            let two: super::Values = params(&two).into_iter().map(|(n, _, v)| (n, v)).collect();
            for (rank, (_, _, reloaded)) in out.iter().enumerate() {
                assert_eq!(
                    reloaded.as_ref(),
                    Some(&two),
                    "TP 2's record at TP 4, rank {rank}"
                );
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// What the plain model saves beside split layers: an int parameter, and a Burn `Linear` in
/// the column layout, whose mapper stores its weight transposed. Burn's `load_file` reads
/// both back from the gathered record.
#[derive(Module, Debug)]
struct Holder {
    lm: Lm,
    col: burn::nn::Linear,
    count: burn::module::Param<Tensor<1, Int>>,
}

impl Holder {
    fn new(count: [i64; 3], device: &Device) -> Self {
        let col = burn::nn::LinearConfig::new(3, 5)
            .with_layout(burn::nn::LinearLayout::Col)
            .with_initializer(burn::nn::Initializer::Constant { value: 0.5 });
        Self {
            lm: Lm::new(device),
            col: col.init(device),
            count: burn::module::Param::initialized(
                burn::module::ParamId::new(),
                Tensor::from_data(count, device),
            ),
        }
    }
}

#[test]
fn the_saved_record_holds_int_parameters_and_burns_mapped_layouts() -> Result<(), Error> {
    use burn_megatron::dropin::save_gathered;
    let dir = scratch("save-holder");
    let file = dir.join("holder.bpk");
    tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let plan = TpPlan::new().vocab(&["lm.wte", "lm.lm_head"])?;
        let plan = plan.make_vocab_size_divisible_by(DIVISIBLE_BY)?;
        let holder = plan.apply(Holder::new([7, 8, 9], d), g)?;
        save_gathered(&holder, &file, g)?;
        Ok::<_, Error>(())
    })?;
    let device = Device::flex();
    let plain = Holder::new([0, 0, 0], &device).try_load_file(&file)?;
    let count: Vec<i64> = plain.count.val().into_data().iter::<i64>().collect();
    assert_eq!(count, vec![7, 8, 9]);
    assert_eq!(
        plain.col.weight.val().dims(),
        [3, 5],
        "Burn's layout, restored"
    );
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
