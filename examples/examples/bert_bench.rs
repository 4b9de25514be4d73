//! BERT training throughput at TP = 1, fp32: forward + backward + AdamW step, median of the
//! timed steps, for two model sizes.
//!
//! ```text
//! cargo run --release -p burn-megatron-examples --example bert_bench
//! ```

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::models::BertConfig;
use burn_megatron::optimizer::MegatronOptimizer;
use burn_megatron_examples::median;
use std::sync::Arc;
use std::time::Instant;

const SEQ: usize = 128;
const MICRO_BATCH: usize = 8;
const VOCAB: usize = 30592;

fn ints(f: impl Fn(usize) -> i64, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..MICRO_BATCH * SEQ).map(f).collect();
    Tensor::from_data(TensorData::new(v, [MICRO_BATCH, SEQ]), device)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0)?);
    println!(
        "{:>7} {:>7} {:>6} {:>12} {:>12}",
        "layers", "hidden", "heads", "ms/step", "tokens/s"
    );
    for (layers, hidden, heads) in [(2, 128, 2), (4, 256, 4)] {
        let mut model =
            BertConfig::new(layers, hidden, heads, 4 * hidden, SEQ, VOCAB).init(&tp, &device)?;
        let mut optim = MegatronOptimizer::new(AdamWConfig::new().init(), &model, tp.clone(), 0);
        let ids = ints(|i| ((i * 7919) % 30000) as i64, &device);
        let types = ints(|i| i64::from(i % SEQ >= SEQ / 2), &device);
        let padding = ints(|_| 0, &device).equal_elem(1);
        let labels = ints(|i| ((i * 104_729) % 30000) as i64, &device);
        let mask_v: Vec<f32> = (0..MICRO_BATCH * SEQ)
            .map(|i| if i % 7 == 0 { 1.0 } else { 0.0 })
            .collect();
        let mask = Tensor::<2>::from_data(TensorData::new(mask_v, [MICRO_BATCH, SEQ]), &device);
        let sop = Tensor::<1, Int>::from_data(
            TensorData::new(vec![0i64, 1, 0, 1, 0, 1, 0, 1], [MICRO_BATCH]),
            &device,
        );
        let mut times = Vec::new();
        for step in 0..6 {
            let t = Instant::now();
            let out = model.forward(ids.clone(), types.clone(), padding.clone(), None);
            let (lm, so) = model.loss(out, labels.clone(), mask.clone(), sop.clone())?;
            let grads = GradientsParams::from_grads((lm + so).backward(), &model);
            let (m, _) = optim.step(1e-4, model, grads)?;
            model = m;
            let _ = model.head.as_ref().map(|h| h.lm_bias.val().into_data()); // wait for the step's work
            if step > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let step_secs = median(times);
        let tokens = (MICRO_BATCH * SEQ) as f64 / step_secs;
        println!(
            "{layers:>7} {hidden:>7} {heads:>6} {:>12.1} {tokens:>12.0}",
            step_secs * 1e3
        );
    }
    Ok(())
}
