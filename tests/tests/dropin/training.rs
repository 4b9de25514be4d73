//! A drop-in model (a padded vocabulary; a transformer layer with sequence parallelism; a
//! column and a row layer in Burn's column layout) through `ParallelTraining`: at TP 2 × DP
//! 2 with the distributed optimizer it trains as one rank does (so `finalize` does not sum
//! again the norm gradients backward summed), and its checkpoint resumes at TP 4 and at TP
//! 1, which pad the vocabulary otherwise (40 rows at TP 2, 48 at TP 4, 36 at TP 1):
//! checkpoints hold the real vocabulary.

use super::Error;
use burn::module::Module;
use burn::nn::LinearLayout;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::CommunicatorExt;
use burn_megatron::comm::ReduceOp;
use burn_megatron::dropin::TpPlan;
use burn_megatron::dropin::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn_megatron::dropin::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::optimizer::InnerOptimizer;
use burn_megatron::tensor_parallel::vocab_parallel_cross_entropy;
use burn_megatron::topology::ParallelConfig;
use burn_megatron::training::{ParallelTraining, ParallelTrainingConfig};
use std::path::Path;
use std::sync::Arc;

const VOCAB: usize = 33;
const D: usize = 8;
const GLOBAL_BATCH: usize = 4;
/// Splits over TP 1, 2 and 4 (sequence parallelism).
const S: usize = 8;

#[derive(Module, Debug)]
struct Lm {
    wte: Embedding,
    block: TransformerEncoder,
    up: Linear,
    down: Linear,
    lm_head: Linear,
}

impl Lm {
    fn new(device: &Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        // Burn's column layout on the split pair: checkpoints hold the layers' own layout.
        let col = |i, o| {
            LinearConfig::new(i, o)
                .with_layout(LinearLayout::Col)
                .init(device)
        };
        Self {
            wte: EmbeddingConfig::new(VOCAB, D).init(device),
            block: TransformerEncoderConfig::new(D, 2 * D, 4, 1)
                .with_dropout(0.0)
                .init(device),
            up: col(D, 2 * D),
            down: col(2 * D, D),
            lm_head: linear(D, VOCAB),
        }
    }

    /// The mean next-token loss of samples `first..first + n` of the fixed corpus.
    fn loss(&self, first: usize, n: usize, device: &Device) -> Result<Tensor<1>, Error> {
        let ids: Vec<i64> = (first * (S + 1)..(first + n) * (S + 1))
            .map(|i| ((i * 13 + i / 5) % VOCAB) as i64)
            .collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [n, S + 1]), device);
        let x = self.wte.forward(ids.clone().narrow(1, 0, S));
        let x = self.block.forward(TransformerEncoderInput::new(x));
        let x = x.clone() + self.down.forward(self.up.forward(x).tanh());
        let logits = self.lm_head.forward(x);
        let v = logits.dims()[2];
        let labels = ids.narrow(1, 1, S).reshape([n * S]);
        let group = self.lm_head.group();
        Ok(vocab_parallel_cross_entropy(logits.reshape([n * S, v]), labels, 0.0, &group)?.mean())
    }
}

/// What a run does besides training: resume from a checkpoint, save one at the end.
#[derive(Clone, Copy)]
struct Run<'a> {
    tp: usize,
    dp: usize,
    steps: usize,
    resume: Option<&'a Path>,
    save: Option<&'a Path>,
}

/// Each step's loss (averaged over the data-parallel ranks) and global gradient norm, of a
/// run from the plan's own draws (or from `resume`'s iteration 2), through
/// `ParallelTraining`. The norms are compared too: AdamW's update does not change when every
/// gradient is off by one factor (a data-parallel sum for a mean), so the losses alone
/// would not show it.
fn train(run: Run<'_>) -> Result<Vec<(f32, f64)>, Error> {
    let out = threads(
        &ParallelConfig::new(run.tp * run.dp, run.tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let plan = TpPlan::new().column(&["up"])?.row(&["down"])?.with_seed(4);
            let plan = plan.encoder(&["block"])?.sequence_parallel();
            let plan = plan
                .vocab(&["wte", "lm_head"])?
                .make_vocab_size_divisible_by(4)?;
            let chunks = vec![plan.apply(Lm::new(d), g)?];
            let names = Arc::new(|path: &str| path.to_string());
            let mut training = ParallelTrainingConfig::new()
                .with_use_distributed_optimizer(true)
                .init(&ctx, &chunks, names)?;
            let adamw = || InnerOptimizer::from(AdamWConfig::new().with_weight_decay(0.0).init());
            let (mut chunks, mut optimizer) = match run.resume {
                Some(root) => {
                    let make = |t: &ParallelTraining, m: &Vec<Lm>| t.optimizer(adamw(), m);
                    let restored = training.load(root, Some(2), chunks, make, true)?;
                    (restored.model, restored.optimizer)
                }
                None => {
                    let optimizer = training.optimizer(adamw(), &chunks)?;
                    (chunks, optimizer)
                }
            };
            let local = GLOBAL_BATCH / run.dp;
            let first = ctx.state.data_parallel_rank() * local;
            let mut steps = Vec::new();
            for _ in 0..run.steps {
                let loss = chunks[0].loss(first, local, d)?;
                let mut value = vec![loss.clone().into_scalar::<f32>()];
                let mut grads = GradientsParams::from_grads(loss.backward(), &chunks);
                training.finalize(&chunks, &mut grads)?;
                let (stepped, report) = optimizer.step(1e-2, chunks, grads)?;
                chunks = stepped;
                ctx.groups.dp.all_reduce_vec(&mut value, ReduceOp::Avg)?;
                steps.push((value[0], report.grad_norm.unwrap_or(f64::NAN)));
            }
            if let Some(root) = run.save {
                training.save(root, 2, &chunks, &optimizer, serde_json::json!({}))?;
            }
            Ok::<_, Error>(steps)
        },
    )?;
    Ok(out.into_iter().next().unwrap_or_default())
}

#[test]
fn a_dropin_model_trains_through_parallel_training_and_resumes_at_other_paddings()
-> Result<(), Error> {
    let root = super::load::scratch("training");
    let run = |tp, dp, steps| Run {
        tp,
        dp,
        steps,
        resume: None,
        save: None,
    };
    let one = train(run(1, 1, 4))?;
    let whole = train(run(2, 2, 4))?;
    let close = |a: &[(f32, f64)], b: &[(f32, f64)]| {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                (x.0 - y.0).abs() < 1e-5 && (x.1 - y.1).abs() <= 1e-5 * y.1.abs().max(1e-3)
            })
    };
    assert!(
        close(&whole, &one),
        "TP 2 × DP 2 {whole:?} against one rank {one:?}"
    );
    train(Run {
        save: Some(&root),
        ..run(2, 2, 2)
    })?;
    for (tp, dp) in [(4, 1), (1, 1), (2, 2)] {
        let resumed = train(Run {
            resume: Some(&root),
            ..run(tp, dp, 2)
        })?;
        assert!(
            close(&resumed, &whole[2..]),
            "resumed at TP {tp} × DP {dp}: {resumed:?} against {:?}",
            &whole[2..]
        );
    }
    std::fs::remove_dir_all(root)?;
    Ok(())
}
