//! A Burn user's BERT (on `nn::transformer::TransformerEncoder`) made tensor-parallel by
//! importing Burn-named layers and applying one plan.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example tp_bert_dropin [-- --tp 2 --steps 5]
//! ```
//!
//! `plain.rs` is a small BERT for masked-language modelling written as bert-burn writes one:
//! private fields, Burn's `TransformerEncoder` built from a full `TransformerEncoderConfig`, a
//! padding mask, a prediction head whose decoder spans the vocabulary, a saved record.
//! `parallel.rs` is the same code importing `dropin::nn`'s encoder, embedding and linear
//! layers, whose `load` splits them by a plan (the encoder as Megatron splits a layer, with
//! sequence parallelism; the word embeddings by vocabulary; the decoder column-parallel with
//! its output gathered, so the loss and the argmax stay Burn's) and reads only this rank's
//! shards of the record (diff the two). The plain model saves a record once; TP 1 loads it
//! whole, each rank at `--tp` only its shards. Both train from it with Burn's own AdamW and
//! fill the masks: the losses and the first step's gradients (gathered by path) must agree
//! within 1e-5 and the predicted tokens must be equal, or the example fails. Last, it prints
//! what sequence parallelism saves: each rank's activations after a forward of a larger
//! encoder, with and without it.
//!
//! With `--hf <dir> --text "... [MASK] ..."`, the same BERT reads a Hugging Face BERT
//! checkpoint instead (`mod hf`) and fills the masks at TP 1 and at `--tp`.

use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_megatron::data::BertTokenizer;
use burn_megatron::dropin::{LoadOptions, TpPlan};
use burn_megatron::launch::{self, LaunchOptions};
use burn_megatron::tensor_parallel::TpError;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_examples::dropin::{print_losses, solo, train, worst};
use burn_megatron_examples::memory::{Counter, mib};
use clap::Parser;
use std::path::{Path, PathBuf};

#[derive(Parser)]
struct Args {
    /// Tensor-parallel size to compare with TP = 1 (1, 2 or 4: it splits the 4 heads).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Training steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// A Hugging Face BERT's directory (`config.json`, its weights, and `tokenizer.json` or
    /// `vocab.txt`): fill the `[MASK]`s of `--text` with it at TP 1 and at `--tp`, instead of
    /// the rest.
    #[arg(long, requires = "text")]
    hf: Option<PathBuf>,
    /// With `--hf`: a text with `[MASK]` tokens.
    #[arg(long, requires = "hf")]
    text: Option<String>,
    /// With `--hf`: write the model loaded at `--tp` back to this directory as a Hugging Face
    /// checkpoint (`config.json`, `model.safetensors`), each rank's shards gathered.
    #[arg(long, requires = "hf")]
    save_hf: Option<PathBuf>,
}

/// The config and the masked positions' logits: what the conversion leaves alone.
mod bert;
use bert::{BertConfig, masked};

/// A Hugging Face BERT checkpoint read into the user's BERT.
mod hf;

/// The user's BERT, in plain Burn.
mod plain;

/// The same BERT, tensor-parallel: diff `parallel.rs` against `plain.rs`.
mod parallel;

const BATCH: usize = 2;
const SEQ: usize = 12;
const PAD: i64 = 0;
const MASK: i64 = 1;
const TOLERANCE: f32 = 1e-5;

/// A masked-language-modelling batch: tokens with `[MASK]` at some positions, the second
/// sample padded at its end, the masked positions (flat) and their original tokens.
struct Batch {
    tokens: Tensor<2, Int>,
    pad: Tensor<2, Bool>,
    at: Tensor<1, Int>,
    labels: Tensor<1, Int>,
}

impl Batch {
    fn new(vocab: usize, device: &Device) -> Self {
        let (len, mut tokens) = ([SEQ, SEQ - 3], Vec::new());
        let (mut at, mut labels, mut pad) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &n) in len.iter().enumerate() {
            for j in 0..SEQ {
                let t = 2 + ((i * 31 + j * 7 + j * j) % (vocab - 2)) as i64;
                let masked = j < n && j % 4 == 1;
                if masked {
                    at.push((i * SEQ + j) as i64);
                    labels.push(t);
                }
                tokens.push(if j >= n {
                    PAD
                } else if masked {
                    MASK
                } else {
                    t
                });
                pad.push(j >= n);
            }
        }
        let n = at.len();
        Self {
            tokens: Tensor::from_data(TensorData::new(tokens, [BATCH, SEQ]), device),
            pad: Tensor::from_data(TensorData::new(pad, [BATCH, SEQ]), device),
            at: Tensor::from_data(TensorData::new(at, [n]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Each rank's activations after a forward (what its graph holds for backward) through a
/// larger encoder split at TP `tp`, with the plan's sequence parallelism and without.
fn activation_memory(tp: usize) -> Result<String, Box<dyn std::error::Error>> {
    use burn_megatron::dropin::nn::transformer as tr;
    let (b, s, d, layers) = (4, 256, 256, 4);
    let ranks = launch::threads(
        &ParallelConfig::new(tp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let mut held = Vec::new();
            for sequence_parallel in [true, false] {
                let counter = Counter::claim();
                let plan = TpPlan::new().encoder(&["layers.*"])?;
                let plan = if sequence_parallel {
                    plan.sequence_parallel()
                } else {
                    plan
                };
                let encoder = tr::TransformerEncoderConfig::new(d, 4 * d, 8, layers)
                    .with_dropout(0.1)
                    .init(&ctx.device);
                let encoder = plan.apply(encoder, &ctx.groups.tp)?;
                let x = Tensor::<3>::ones([b, s, d], &ctx.device).require_grad();
                let before = counter.live();
                let y = encoder.forward(tr::TransformerEncoderInput::new(x));
                held.push(counter.live() - before);
                drop(y.sum().backward());
            }
            Ok::<_, TpError>(held)
        },
    )?;
    let (with, without) = (ranks[0][0], ranks[0][1]);
    Ok(format!(
        "activations after a forward of a {layers}-layer encoder (width {d}, batch {b}, sequence \
         {s}) at TP {tp}, rank 0: {} with sequence parallelism, {} without ({:.2}x)",
        mib(with),
        mib(without),
        with as f64 / without as f64
    ))
}

/// `--hf`: the checkpoint in `dir` at TP 1 and at `--tp`, each rank reading only its shards,
/// filling the masks of `text`.
fn from_hugging_face(
    dir: &Path,
    text: &str,
    tp: usize,
    save_hf: Option<&Path>,
) -> Result<(), Box<dyn std::error::Error>> {
    let checkpoint = hf::Checkpoint::open(dir)?;
    let c = &checkpoint.config;
    if !c.num_attention_heads.is_multiple_of(tp) {
        return Err(format!("--tp must divide the {} heads", c.num_attention_heads).into());
    }
    let vocab = ["tokenizer.json", "vocab.txt"].map(|n| dir.join(n));
    let vocab = vocab.iter().find(|p| p.is_file());
    let tokenizer = BertTokenizer::from_file(vocab.ok_or("no tokenizer.json or vocab.txt")?)?;
    // `[CLS]`, the text's pieces with `[MASK]` between them, `[SEP]`: a vocabulary file
    // declares no special tokens, and its normaliser would split `[MASK]` as text.
    let mut ids = vec![i64::from(tokenizer.cls)];
    for (i, piece) in text.split("[MASK]").enumerate() {
        if i > 0 {
            ids.push(i64::from(tokenizer.mask));
        }
        ids.extend(tokenizer.encode(piece)?.into_iter().map(i64::from));
    }
    ids.push(i64::from(tokenizer.sep));
    let at: Vec<i64> = (0..ids.len() as i64)
        .filter(|&i| ids[i as usize] == i64::from(tokenizer.mask))
        .collect();
    // Sequence parallelism splits the positions: padded to a multiple of TP.
    if at.is_empty() || ids.len().next_multiple_of(tp) > c.max_position_embeddings {
        return Err("--text has no [MASK], or more tokens than max_position_embeddings".into());
    }
    let mut filled = Vec::new();
    let mut sizes = vec![1, tp];
    sizes.dedup();
    for tp in sizes {
        let ranks = launch::threads(
            &ParallelConfig::new(tp, tp, 1),
            LaunchOptions::default(),
            |ctx| {
                let device = Device::flex();
                let model = checkpoint.load(&ctx.groups.tp, &device)?;
                // The padding masked.
                let (n, len) = (ids.len(), ids.len().next_multiple_of(tp));
                let pad_id = i64::from(tokenizer.pad);
                let padded: Vec<i64> = (0..len)
                    .map(|i| ids.get(i).copied().unwrap_or(pad_id))
                    .collect();
                let tokens = Tensor::from_data(TensorData::new(padded, [1, len]), &device);
                let pad = TensorData::new((0..len).map(|i| i >= n).collect(), [1, len]);
                let pad = Tensor::<2, Bool>::from_data(pad, &device);
                let at = Tensor::from_data(TensorData::new(at.clone(), [at.len()]), &device);
                let labels = at.zeros_like();
                Ok::<_, TpError>(model.fill_mask(tokens, pad, at, labels).0)
            },
        )?;
        let best = ranks.into_iter().next().expect("a rank");
        let pieces: Vec<u32> = best.iter().map(|&t| t as u32).collect();
        println!(
            "masks filled at TP={tp}: {best:?} {:?}",
            tokenizer.decode(&pieces)?
        );
        filled.push(best);
    }
    if filled.iter().any(|f| *f != filled[0]) {
        return Err(format!("TP={tp} filled the masks with other tokens than TP=1").into());
    }
    if let Some(out) = save_hf {
        // What a fine-tune would write back: here the weights as loaded, at --tp.
        launch::threads(
            &ParallelConfig::new(tp, tp, 1),
            LaunchOptions::default(),
            |ctx| {
                let model = checkpoint.load(&ctx.groups.tp, &Device::flex())?;
                checkpoint.save(&model, out, &ctx.groups.tp)
            },
        )?;
        println!("written at TP {tp}: {}", out.display());
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let (Some(dir), Some(text)) = (&args.hf, &args.text) {
        return from_hugging_face(dir, text, args.tp, args.save_hf.as_deref());
    }
    let config = BertConfig::new(128, 32, 2, 4, 64, 16, 2);
    if !config.num_attention_heads.is_multiple_of(args.tp) {
        return Err("--tp must divide the 4 attention heads".into());
    }
    // The user's saved weights: a record the plain model writes (burnpack).
    let dir = std::env::temp_dir().join(format!("tp-bert-dropin-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let record = dir.join("bert.bpk");
    let device = Device::flex();
    device.seed(7);
    plain::BertMaskedLm::new(&config, &device).save_file(&record)?;

    // TP 1: the plain model loads the whole record.
    let b = Batch::new(config.vocab_size, &device);
    let (filled, right) = plain::BertMaskedLm::load(&config, &record, &device)
        .fill_mask(b.tokens, b.pad, b.at, b.labels);
    let ad = Device::flex().autodiff();
    let b = Batch::new(config.vocab_size, &ad);
    let model = plain::BertMaskedLm::load(&config, &record, &ad);
    let (_, single, plain_grads) = train(model, args.steps, &solo(), |m| {
        Ok::<_, TpError>(m.loss(
            b.tokens.clone(),
            b.pad.clone(),
            b.at.clone(),
            b.labels.clone(),
        ))
    })?;

    // TP = --tp: each rank reads only its shards of the same record.
    let ranks = launch::threads(
        &ParallelConfig::new(args.tp, args.tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (tp, d) = (&ctx.groups.tp, &ctx.device);
            let plain_device = Device::flex();
            let e = Batch::new(config.vocab_size, &plain_device);
            let filled = parallel::BertMaskedLm::load(
                &config,
                &record,
                &LoadOptions::default(),
                tp,
                &plain_device,
            )?
            .fill_mask(e.tokens, e.pad, e.at, e.labels);
            let b = Batch::new(config.vocab_size, d);
            let model =
                parallel::BertMaskedLm::load(&config, &record, &LoadOptions::default(), tp, d)?;
            let (_, losses, grads) = train(model, args.steps, tp, |m| {
                let (t, p, a, l) = (
                    b.tokens.clone(),
                    b.pad.clone(),
                    b.at.clone(),
                    b.labels.clone(),
                );
                Ok::<_, TpError>(m.loss(t, p, a, l))
            })?;
            Ok::<_, TpError>((losses, grads, filled))
        },
    )?;
    std::fs::remove_dir_all(&dir)?;
    let (parallel, parallel_grads, parallel_filled) = ranks.into_iter().next().expect("a rank");

    println!("masks filled at TP=1:  {filled:?} ({right} right, untrained)");
    println!(
        "masks filled at TP={}: {:?} ({} right, untrained)",
        args.tp, parallel_filled.0, parallel_filled.1
    );
    let worst_loss = print_losses(&format!("TP={}", args.tp), &single, &parallel);
    let (worst_grad, name) = worst(&plain_grads, &parallel_grads);
    println!("largest relative gradient difference (step 0): {worst_grad:.2e} ({name})");
    // Written so that a NaN fails too.
    if !(worst_loss <= TOLERANCE && worst_grad <= TOLERANCE) {
        return Err(format!(
            "TP={} differs from TP=1 by more than {TOLERANCE:e}",
            args.tp
        )
        .into());
    }
    if args.tp > 1 {
        println!("{}", activation_memory(args.tp)?);
    }
    if (filled, right) != parallel_filled {
        return Err(format!(
            "TP={} filled the masks with other tokens than TP=1",
            args.tp
        )
        .into());
    }
    Ok(())
}
