//! The name-pattern mapper: a model written with `dropin::nn`'s Burn-named layers becomes
//! tensor-parallel by one `TpPlan::apply`, with no constructor changed. At TP 2 and 4 its
//! output and every gradient (gathered) are the unconverted model's, from a record the plain
//! model saved; a plan's own draws are the same at every TP size; patterns that name nothing,
//! Burn's own layers or sizes that do not split are errors naming the path.

use super::Error;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::comm::Comm;
use burn_megatron::dropin::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, SwiGlu, SwiGluConfig,
};
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded};
use burn_megatron::tensor_parallel::vocab_parallel_cross_entropy;
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;

const VOCAB: usize = 32;
const D: usize = 16;
const FFN: usize = 24;

#[derive(Module, Debug)]
struct Block {
    wq: Linear,
    wo: Linear,
    swiglu: SwiGlu,
    w2: Linear,
}

/// A model as a Burn user writes it (the imports are the only difference from `burn::nn`).
#[derive(Module, Debug)]
struct Net {
    tok_embeddings: Embedding,
    layers: Vec<Block>,
    output: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        let block = |_| Block {
            wq: linear(D, D),
            wo: linear(D, D),
            swiglu: SwiGluConfig::new(D, FFN).init(device),
            w2: linear(FFN, D),
        };
        Self {
            tok_embeddings: EmbeddingConfig::new(VOCAB, D).init(device),
            layers: (0..2).map(block).collect(),
            output: LinearConfig::new(D, VOCAB).with_bias(false).init(device),
        }
    }

    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let mut x = self.tok_embeddings.forward(ids);
        for b in &self.layers {
            x = x.clone() + b.wo.forward(b.wq.forward(x));
            x = x.clone() + b.w2.forward(b.swiglu.forward(x));
        }
        self.output.forward(x)
    }
}

fn plan() -> TpPlan {
    let plan = TpPlan::new()
        .column(&["*.wq", "*.swiglu", "output"])
        .unwrap();
    let plan = plan.row(&["*.wo", "*.w2"]).unwrap();
    plan.vocab(&["tok_embeddings"]).unwrap().with_seed(3)
}

fn ids(device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..2 * 6).map(|i| (i * 7 % VOCAB) as i64).collect();
    Tensor::from_data(TensorData::new(v, [2, 6]), device)
}

/// The mean cross-entropy of `net`'s next-token logits, and its gathered gradients.
fn run(net: &Net, tp: &Comm, device: &Device) -> Result<(f32, super::Values), Error> {
    let logits = net.forward(ids(device));
    let [b, s, v] = logits.dims();
    let labels = ids(device).reshape([b * s]);
    let loss = vocab_parallel_cross_entropy(logits.reshape([b * s, v]), labels, 0.0, tp)?.mean();
    let value = loss.clone().into_scalar::<f32>();
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), net);
    Ok((value, gathered(net, Some(&grads), tp)))
}

#[test]
fn a_plan_makes_a_burn_written_model_tensor_parallel_at_tp_2_and_4() -> Result<(), Error> {
    let dir = std::env::temp_dir().join(format!("bm-dropin-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let record = dir.join("net.bpk");
    let device = Device::flex();
    device.seed(5);
    Net::new(&device).save_file(&record)?;
    let source = RecordSource::from_path(&record);
    let ad = Device::flex().autodiff();
    let plain = Net::new(&ad).load_file(&record);
    let (loss, grads) = run(&plain, &super::solo(), &ad)?;
    // A plan's own draws, at TP 1: the reference for every TP size.
    let drawn = gathered(
        &plan().apply(Net::new(&device), &super::solo())?,
        None,
        &super::solo(),
    );
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let net = plan().apply(Net::new(d), g)?;
            assert!(
                net.output.split().is_some() && net.layers[1].swiglu.linear_outer.split().is_some()
            );
            let own = gathered(&net, None, g);
            let (net, _) = load_sharded(net, &source, g, &LoadOptions::default())?;
            let (l, gr) = run(&net, g, d)?;
            Ok::<_, Error>((own, l, gr))
        })?;
        for (rank, (own, l, gr)) in out.iter().enumerate() {
            assert_eq!(
                own, &drawn,
                "TP {tp}, rank {rank}: the plan draws as at TP 1"
            );
            assert!(
                (l - loss).abs() < 1e-5,
                "TP {tp}, rank {rank}: loss {l} against {loss}"
            );
            let (worst, name) = super::grad_diff(gr, &grads);
            assert!(worst < 1e-5, "TP {tp}, rank {rank}: {name} off by {worst}");
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn plans_that_do_not_fit_the_model_are_errors_naming_the_path() {
    let d = Device::flex();
    let errors = tp_ranks(2, |ctx| {
        let g = &ctx.groups.tp;
        let err = |plan: TpPlan| {
            plan.apply(Net::new(&ctx.device), g)
                .unwrap_err()
                .to_string()
        };
        let nothing = err(TpPlan::new().column(&["*.wq", "*.wk"]).unwrap());
        let row_on_embedding = err(TpPlan::new().row(&["tok_embeddings"]).unwrap());
        // Burn's own Linear has no slot to take the split.
        #[derive(Module, Debug)]
        struct Plain {
            wq: burn::nn::Linear,
        }
        let plain = Plain {
            wq: burn::nn::LinearConfig::new(4, 4).init(&ctx.device),
        };
        let burn_linear = TpPlan::new()
            .column(&["wq"])
            .unwrap()
            .apply(plain, g)
            .unwrap_err();
        let twice = plan().apply(plan().apply(Net::new(&ctx.device), g)?, g);
        let twice = twice.unwrap_err().to_string();
        Ok::<_, Error>(vec![
            nothing,
            row_on_embedding,
            burn_linear.to_string(),
            twice,
        ])
    })
    .unwrap();
    let e = &errors[0];
    assert!(
        e[0].contains("match no layer") && e[0].contains("`*.wk`"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("tok_embeddings.weight") && e[1].contains("Row"),
        "{}",
        e[1]
    );
    assert!(
        e[2].contains("wq") && e[2].contains("dropin::nn"),
        "{}",
        e[2]
    );
    assert!(e[3].contains("split already"), "{}", e[3]);
    // 16 features over 3 ranks.
    let three = tp_ranks(3, |ctx| {
        let plan = TpPlan::new().column(&["layers.0.wq"]).unwrap();
        Ok::<_, Error>(
            plan.apply(Net::new(&d), &ctx.groups.tp)
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap();
    assert!(
        three[0].contains("layers.0.wq.weight") && three[0].contains("16"),
        "{}",
        three[0]
    );
}

/// A model holding `dropin::nn::transformer`'s encoder, as a BERT holds Burn's.
#[derive(Module, Debug)]
struct WithEncoder {
    encoder: burn_megatron::dropin::nn::transformer::TransformerEncoder,
}

#[test]
fn an_encoder_plan_splits_a_burn_named_encoder_as_megatron_does_at_tp_2_and_4() -> Result<(), Error>
{
    use burn_megatron::dropin::nn::transformer::TransformerEncoderInput;
    use burn_megatron_tests::data;
    let dir = std::env::temp_dir().join(format!("bm-dropin-encoder-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for norm_first in [false, true] {
        let config = super::config(norm_first, 0.0);
        // Burn's encoder saves the record; Burn's struct literal builds the Burn-named one.
        let record = super::encoder_record(&config, &dir, &format!("encoder-{norm_first}.bpk"));
        let (y_plain, g_plain) = super::plain_run(&config, &record);
        let ours = super::dropin_config(&config);
        let options = LoadOptions::default().with_key_remap("^", "encoder.")?;
        let source = RecordSource::from_path(&record);
        for tp in [1, 2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let net = WithEncoder {
                    encoder: ours.init(d),
                };
                let net = TpPlan::new().encoder(&["encoder"])?.apply(net, g)?;
                let (net, _) = load_sharded(net, &source, g, &options)?;
                let input = TransformerEncoderInput::new(data([super::B, super::S, D], 0, 1, d))
                    .mask_pad(super::padding(super::S, d));
                let y = net.encoder.forward(input);
                let w = data([super::B, super::S, D], 0, 2, d);
                let grads = (y.clone() * w).sum().backward();
                let grads = burn::optim::GradientsParams::from_grads(grads, &net);
                let grads: super::Values = gathered(&net, Some(&grads), g)
                    .into_iter()
                    .map(|(k, v)| (k.trim_start_matches("encoder.").to_string(), v))
                    .collect();
                Ok::<_, Error>((burn_megatron_tests::values(y), grads))
            })?;
            for (rank, (y, grads)) in out.iter().enumerate() {
                let what = format!("norm_first {norm_first}, TP {tp}, rank {rank}");
                super::assert_parity(&what, (y, grads), (&y_plain, &g_plain));
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn a_split_encoders_dropout_agrees_where_the_stream_is_whole() -> Result<(), Error> {
    use burn_megatron::dropin::nn::transformer::{
        TransformerEncoderConfig, TransformerEncoderInput,
    };
    let out = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let config = TransformerEncoderConfig::new(D, 32, 4, 2).with_dropout(0.3);
        let net = WithEncoder {
            encoder: config.init(d),
        };
        let net = TpPlan::new()
            .encoder(&["encoder"])?
            .with_seed(9)
            .apply(net, g)?;
        let x = burn_megatron_tests::data([2, 5, D], 0, 1, d).require_grad();
        let y = net.encoder.forward(TransformerEncoderInput::new(x.clone()));
        let eval = net
            .encoder
            .valid()
            .forward(TransformerEncoderInput::new(x.inner()));
        Ok::<_, Error>((
            burn_megatron_tests::values(y),
            burn_megatron_tests::values(eval),
        ))
    })?;
    assert_eq!(
        out[0].0, out[1].0,
        "the residual stream is dropped alike on both ranks"
    );
    assert_ne!(out[0].0, out[0].1, "dropout applied in training");
    assert_eq!(out[0].1, out[1].1);
    // A rule on an encoder's part it cannot split is an error naming it.
    let e = TpPlan::new()
        .column(&["encoder"])
        .unwrap()
        .apply(
            WithEncoder {
                encoder: TransformerEncoderConfig::new(D, 32, 4, 1).init(&Device::flex()),
            },
            &super::solo(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("encoder.layers.0") && e.contains("`encoder`"),
        "{e}"
    );
    Ok(())
}
