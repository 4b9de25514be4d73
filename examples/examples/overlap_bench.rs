//! Data-parallel step time with the gradient reduction after backward vs overlapped with
//! backward (`OverlapReducer`), on a communicator slowed to a chosen link speed so the
//! reduction costs about as much as the backward pass. BERT, DP = 2 (ranks as threads),
//! forward + backward + reduction + AdamW step, median of the timed steps.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example overlap_bench
//! ```

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{Comm, Probed};
use burn_megatron::data_parallel::{
    DataParallelConfig,
    advanced::{DpReduction, OverlapReducer, finalize_model_grads},
};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{
    BertConfig, ParallelAttentionConfig, ParallelMlpConfig, TransformerLayerConfig,
};
use burn_megatron::optimizer::MegatronOptimizer;
use burn_megatron::topology::ParallelConfig;
use burn_megatron_examples::median;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SEQ: usize = 128;
const MICRO_BATCH: usize = 4;
const VOCAB: usize = 1024;
const STEPS: usize = 20;

/// `inner`, whose all-reduce also waits as long as a link of `bytes_per_s` with `latency`
/// would take: the stand-in for a real network on this one machine.
fn slow(inner: Comm, latency: Duration, bytes_per_s: f64) -> Comm {
    Arc::new(Probed::new(inner, move |call| {
        if call.op == "all_reduce" {
            let transfer = Duration::from_secs_f64(call.bytes as f64 / bytes_per_s);
            std::thread::sleep(latency + transfer);
        }
    }))
}

fn ints(f: impl Fn(usize) -> i64, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..MICRO_BATCH * SEQ).map(f).collect();
    Tensor::from_data(TensorData::new(v, [MICRO_BATCH, SEQ]), device)
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    NoReduction,
    AfterBackward,
    Overlapped,
}

/// Median step time in ms for `mode` with the DP link at `bytes_per_s`.
fn step_ms(mode: Mode, bytes_per_s: f64) -> f64 {
    let config = ParallelConfig::new(2, 1, 1);
    let times = threads(&config, LaunchOptions::default(), |ctx| {
        let (tp, d) = (&ctx.groups.tp, &ctx.device);
        let dp = slow(
            ctx.groups.dp.clone(),
            Duration::from_micros(200),
            bytes_per_s,
        );
        let mut layer = TransformerLayerConfig::new(
            256,
            ParallelAttentionConfig::new(4).with_attention_dropout(0.0),
            ParallelMlpConfig::new(1024),
        )
        .with_hidden_dropout(0.0);
        layer.seed = 1234;
        let mut model = BertConfig::new(2, SEQ, VOCAB, layer).init(tp, d)?;
        let mut optim =
            MegatronOptimizer::new(AdamWConfig::new().init(), &model, ctx.groups.mp.clone(), 0);
        let dp_config = DataParallelConfig {
            bucket_size: Some(250_000),
            ..DataParallelConfig::default()
        };
        // Built only where it reduces: a live reducer hooks its parameters' gradients even
        // while inactive (to count them), which the other modes would pay for.
        let reducer =
            (mode == Mode::Overlapped).then(|| OverlapReducer::new(&model, &dp, &dp_config));
        let r = ctx.state.data_parallel_rank() as i64;
        let ids = ints(|i| (i as i64 * 7919 + r * 31) % 1000, d);
        let types = ints(|i| i64::from(i % SEQ >= SEQ / 2), d);
        let padding = ints(|_| 0, d).equal_elem(1);
        let labels = ints(|i| (i as i64 * 104_729 + r) % 1000, d);
        let mask_v: Vec<f32> = (0..MICRO_BATCH * SEQ)
            .map(|i| f32::from(i % 7 == 0))
            .collect();
        let mask = Tensor::<2>::from_data(TensorData::new(mask_v, [MICRO_BATCH, SEQ]), d);
        let sop =
            Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 1, 0, 1], [MICRO_BATCH]), d);
        let mut times = Vec::new();
        for step in 0..STEPS {
            let t = Instant::now();
            let active = reducer.as_ref().map(|r| r.activate(true));
            let out = model.forward(ids.clone(), types.clone(), padding.clone(), None);
            let (lm, so) = model.loss(out, labels.clone(), mask.clone(), sop.clone())?;
            let mut grads = GradientsParams::from_grads((lm + so).backward(), &model);
            drop(active);
            let t_bwd = t.elapsed().as_secs_f64() * 1e3;
            match mode {
                Mode::NoReduction => {}
                Mode::AfterBackward => finalize_model_grads(
                    &model,
                    &mut grads,
                    DpReduction::AllReduce(&dp),
                    tp,
                    None,
                    &dp_config,
                )?,
                Mode::Overlapped => finalize_model_grads(
                    &model,
                    &mut grads,
                    DpReduction::Overlapped(reducer.as_slice()),
                    tp,
                    None,
                    &dp_config,
                )?,
            }
            let t_red = t.elapsed().as_secs_f64() * 1e3;
            if std::env::var("BREAKDOWN").is_ok() && ctx.state.global_rank() == 0 {
                eprintln!("{mode:?} fwd+bwd {t_bwd:.1} reduce {:.1}", t_red - t_bwd);
            }
            let (m, _) = optim.step(1e-4, model, grads)?;
            model = m;
            let _ = model.head.as_ref().map(|h| h.lm_bias.val().into_data()); // wait for the step's work
            if step > 1 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(median(times))
    })
    .expect("benchmark run");
    times.into_iter().fold(0.0, f64::max)
}

fn main() {
    println!(
        "BERT 2 layers, hidden 256, seq {SEQ}, micro batch {MICRO_BATCH}, DP 2 (threads), fp32"
    );
    let compute = step_ms(Mode::NoReduction, f64::INFINITY);
    println!("no reduction (compute only): {compute:.1} ms/step");
    println!(
        "{:>12} {:>16} {:>14} {:>10} {:>22}",
        "link MB/s", "after bwd ms", "overlapped ms", "ratio", "hidden comm (of added)"
    );
    for mb_per_s in [400.0, 200.0, 100.0] {
        let after = step_ms(Mode::AfterBackward, mb_per_s * 1e6);
        let overlapped = step_ms(Mode::Overlapped, mb_per_s * 1e6);
        let added = (after - compute).max(1e-9);
        let hidden = ((after - overlapped) / added).clamp(-1.0, 1.0);
        println!(
            "{mb_per_s:>12.0} {after:>16.1} {overlapped:>14.1} {:>10.3} {:>21.0}%",
            overlapped / after,
            hidden * 100.0
        );
    }
}
