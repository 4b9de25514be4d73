//! Burn's composite layers made tensor-parallel by swapping their type (`tensor_parallel::
//! dropin`): at TP 2 and 4 the output, every gradient (gathered) and the record paths are
//! the plain Burn layer's; the weights are the same at every TP size; dropout masks agree
//! across ranks where activations are whole; sizes that do not split are errors naming them.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Initializer, LinearLayout, SwiGlu, SwiGluConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::tensor_parallel::dropin::nn::transformer::TransformerEncoderInput as TpInput;
use burn_megatron::tensor_parallel::dropin::{
    ParallelSwiGlu, ParallelTransformerEncoder, master_init,
};
use burn_megatron::tensor_parallel::{RngTracker, RowParallelLinear, TpError};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::gpt::{gathered, max_rel_diff};
use burn_megatron_tests::{data, seeded_linear};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

mod attention;
mod decoder;
mod load;
mod plan;
mod text_generation;
mod training;
mod vocab;

type Error = Box<dyn std::error::Error + Send + Sync>;

const B: usize = 2;
const S: usize = 5;
const D_MODEL: usize = 16;
const D_FF: usize = 32;
const HEADS: usize = 4;
/// Gradients are compared relative to their tensor's largest value, or this when it is
/// smaller: the key bias's gradient is zero in exact arithmetic (a constant added to every
/// score of a query), about 1e-8 in f32.
const GRAD_FLOOR: f32 = 1e-2;

fn solo() -> Comm {
    Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap())
}

fn config(norm_first: bool, dropout: f64) -> TransformerEncoderConfig {
    TransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, 2)
        .with_norm_first(norm_first)
        .with_dropout(dropout)
}

/// The plain encoder every test compares with: drawn from the seed through the TP-1 path and
/// gathered into Burn's own type, so that each rank thread can build it alone.
fn plain_encoder(config: &TransformerEncoderConfig, device: &Device) -> TransformerEncoder {
    let rng = RngTracker::new(5, 0);
    ParallelTransformerEncoder::new(config, &solo(), 1234, &rng, device)
        .and_then(|e| e.to_encoder())
        .unwrap()
}

/// The module paths of `module`'s parameters.
fn paths<M: Module>(module: &M) -> BTreeSet<String> {
    struct Paths(Vec<String>, BTreeSet<String>);
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            self.1.insert(self.0.join("."));
        }
    }
    let mut p = Paths(Vec::new(), BTreeSet::new());
    module.visit(&mut p);
    p.1
}

/// True at the last two keys of sample 1.
fn padding(device: &Device) -> Tensor<2, burn::tensor::Bool> {
    let v: Vec<bool> = (0..B * S).map(|i| i / S == 1 && i % S >= S - 2).collect();
    Tensor::from_data(TensorData::new(v, [B, S]), device)
}

type Values = BTreeMap<String, Vec<f32>>;

/// The plain encoder's output, and its parameters' gradients of `sum(y · w)`.
fn plain_run(config: &TransformerEncoderConfig) -> (Vec<f32>, Values) {
    let device = Device::flex().autodiff();
    let encoder = plain_encoder(config, &device);
    let encoder = encoder.map(&mut RequireGrad);
    let input = TransformerEncoderInput::new(data([B, S, D_MODEL], 0, 1, &device))
        .mask_pad(padding(&device));
    let y = encoder.forward(input);
    let grads = (y.clone() * data([B, S, D_MODEL], 0, 2, &device))
        .sum()
        .backward();
    let grads = burn::optim::GradientsParams::from_grads(grads, &encoder);
    (
        burn_megatron_tests::values(y),
        gathered(&encoder, Some(&grads), &solo()),
    )
}

/// Makes every parameter trainable again (the gathered encoder is untracked).
struct RequireGrad;

impl burn::module::ModuleMapper for RequireGrad {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.set_require_grad(true)
    }
}

#[test]
fn a_transformer_encoder_at_tp_2_and_4_is_the_plain_one() -> Result<(), Error> {
    for norm_first in [false, true] {
        let config = config(norm_first, 0.0);
        let (y_plain, g_plain) = plain_run(&config);
        for tp in [2, 4] {
            let out = threads(
                &ParallelConfig::new(tp, tp, 1),
                LaunchOptions::default(),
                |ctx| {
                    let d = &ctx.device;
                    let rng = RngTracker::new(5, ctx.state.tensor_model_parallel_rank());
                    let plain = plain_encoder(&config, d);
                    let encoder =
                        ParallelTransformerEncoder::from_encoder(&plain, &ctx.groups.tp, &rng)?;
                    // The same record paths as the plain encoder's: a record of one loads into the other.
                    assert_eq!(paths(&encoder), paths(&plain));
                    // Drawn directly at this TP size: the same shards as converting the plain one.
                    let drawn =
                        ParallelTransformerEncoder::new(&config, &ctx.groups.tp, 1234, &rng, d)?;
                    let (a, b) = (
                        gathered(&drawn, None, &ctx.groups.tp),
                        gathered(&encoder, None, &ctx.groups.tp),
                    );
                    assert_eq!(a, b, "drawn at TP {tp} vs converted");
                    let input = TpInput::new(data([B, S, D_MODEL], 0, 1, d)).mask_pad(padding(d));
                    let y = encoder.forward(input);
                    let grads = (y.clone() * data([B, S, D_MODEL], 0, 2, d))
                        .sum()
                        .backward();
                    let grads = burn::optim::GradientsParams::from_grads(grads, &encoder);
                    let back = encoder.to_encoder()?;
                    Ok::<_, Error>((
                        burn_megatron_tests::values(y),
                        gathered(&encoder, Some(&grads), &ctx.groups.tp),
                        paths(&back),
                    ))
                },
            )?;
            for (rank, (y, grads, back)) in out.iter().enumerate() {
                let dy = y
                    .iter()
                    .zip(&y_plain)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    dy < 1e-5,
                    "norm_first {norm_first}, TP {tp}, rank {rank}: output off by {dy}"
                );
                let (worst, name) = max_rel_diff(grads, &g_plain, GRAD_FLOOR);
                assert!(
                    worst < 1e-5,
                    "norm_first {norm_first}, TP {tp}, rank {rank}: {name} off by {worst}"
                );
                assert_eq!(back, &paths(&plain_encoder(&config, &Device::flex())));
            }
        }
    }
    Ok(())
}

#[test]
fn dropout_masks_agree_across_ranks_where_activations_are_whole() -> Result<(), Error> {
    let config = config(true, 0.3);
    let out = threads(
        &ParallelConfig::new(2, 2, 1),
        LaunchOptions::default(),
        |ctx| {
            let d = &ctx.device;
            let rng = RngTracker::new(9, ctx.state.tensor_model_parallel_rank());
            let encoder = ParallelTransformerEncoder::new(&config, &ctx.groups.tp, 1234, &rng, d)?;
            let input = TpInput::new(data([B, S, D_MODEL], 0, 1, d).require_grad());
            let y = burn_megatron_tests::values(encoder.forward(input));
            // Off the autodiff device, or in evaluation, there is no dropout.
            let eval = encoder.valid();
            let z = eval.forward(TpInput::new(data([B, S, D_MODEL], 0, 1, &Device::flex())));
            Ok::<_, Error>((y, burn_megatron_tests::values(z)))
        },
    )?;
    // Rank 0 and rank 1 hold the same residual stream, dropped the same way.
    assert_eq!(out[0].0, out[1].0);
    assert_ne!(out[0].0, out[0].1, "dropout applied in training");
    assert_eq!(out[0].1, out[1].1);
    Ok(())
}

#[test]
fn a_swiglu_mlp_at_tp_2_and_4_is_the_plain_one() -> Result<(), Error> {
    // Llama's feed-forward: w2(swiglu(x)), the SwiGlu column-parallel and w2 row-parallel.
    let plain = |d: &Device| -> (SwiGlu, burn::nn::Linear) {
        let swiglu = ParallelSwiGlu::new(
            &SwiGluConfig::new(D_MODEL, D_FF).with_bias(true),
            &solo(),
            77,
            d,
        )
        .and_then(|s| s.to_swiglu())
        .unwrap();
        (swiglu, seeded_linear(D_FF, D_MODEL, 78, d))
    };
    let device = Device::flex().autodiff();
    let (swiglu, w2) = plain(&device);
    let (swiglu, w2) = (swiglu.map(&mut RequireGrad), w2.map(&mut RequireGrad));
    let x = data([B, S, D_MODEL], 0, 3, &device);
    let y_plain = burn_megatron_tests::values(w2.forward(swiglu.forward(x.clone())));
    let y = w2.forward(swiglu.forward(x));
    let grads = burn::optim::GradientsParams::from_grads(y.sum().backward(), &swiglu);
    let g_plain = gathered(&swiglu, Some(&grads), &solo());
    for tp in [2, 4] {
        let out = threads(
            &ParallelConfig::new(tp, tp, 1),
            LaunchOptions::default(),
            |ctx| {
                let (d, g) = (&ctx.device, &ctx.groups.tp);
                let (swiglu, w2) = plain(d);
                let (p_swiglu, p_w2) = (
                    ParallelSwiGlu::from_swiglu(&swiglu, g)?,
                    RowParallelLinear::split(&w2, g)?,
                );
                assert_eq!(paths(&p_swiglu), paths(&swiglu));
                let y = p_w2.forward(p_swiglu.forward(data([B, S, D_MODEL], 0, 3, d)));
                let grads =
                    burn::optim::GradientsParams::from_grads(y.clone().sum().backward(), &p_swiglu);
                let back = p_swiglu.to_swiglu()?;
                Ok::<_, Error>((
                    burn_megatron_tests::values(y),
                    gathered(&p_swiglu, Some(&grads), g),
                    gathered(&back, None, &solo()),
                ))
            },
        )?;
        let whole = gathered(&swiglu, None, &solo());
        for (y, grads, back) in &out {
            let dy = y
                .iter()
                .zip(&y_plain)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(dy < 1e-5, "TP {tp}: output off by {dy}");
            let (worst, name) = max_rel_diff(grads, &g_plain, GRAD_FLOOR);
            assert!(worst < 1e-5, "TP {tp}: {name} off by {worst}");
            assert_eq!(back, &whole, "TP {tp}: to_swiglu gathers the plain weights");
        }
    }
    Ok(())
}

#[test]
fn sizes_and_layers_that_do_not_split_are_errors_naming_them() -> Result<(), Error> {
    let errors = threads(
        &ParallelConfig::new(4, 4, 1),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let rng = RngTracker::new(1, ctx.state.tensor_model_parallel_rank());
            let err = |r: Result<ParallelTransformerEncoder, TpError>| r.unwrap_err().to_string();
            // 6 heads over 4 ranks; an inner width of 30 over 4 ranks.
            let heads = err(ParallelTransformerEncoder::new(
                &TransformerEncoderConfig::new(24, 32, 6, 1),
                g,
                1,
                &rng,
                d,
            ));
            let ffn = err(ParallelTransformerEncoder::new(
                &TransformerEncoderConfig::new(16, 30, 4, 1),
                g,
                1,
                &rng,
                d,
            ));
            let plain = TransformerEncoderConfig::new(24, 32, 6, 1).init(&Device::flex());
            let converted = err(ParallelTransformerEncoder::from_encoder(&plain, g, &rng));
            let swiglu = SwiGluConfig::new(8, 6).init(&Device::flex());
            let swiglu = ParallelSwiGlu::from_swiglu(&swiglu, g)
                .unwrap_err()
                .to_string();
            Ok::<_, Error>(vec![heads, ffn, converted, swiglu])
        },
    )?;
    let e = &errors[0];
    assert!(
        e[0].contains("MultiHeadAttention") && e[0].contains("heads (6)") && e[0].contains("(4)"),
        "{}",
        e[0]
    );
    assert!(e[1].contains("feed-forward features (30)"), "{}", e[1]);
    assert!(e[2].contains("heads (6)"), "{}", e[2]);
    assert!(e[3].contains("SwiGlu: output features (6)"), "{}", e[3]);
    // A non-elementwise feed-forward activation; a column layout; an initialiser with no law here.
    let d = Device::flex();
    let swiglu_act = TransformerEncoderConfig::new(16, 32, 4, 1).with_activation(
        burn::nn::activation::ActivationConfig::SwiGlu(SwiGluConfig::new(32, 32)),
    );
    let e = ParallelTransformerEncoder::new(&swiglu_act, &solo(), 1, &RngTracker::new(1, 0), &d)
        .unwrap_err();
    assert!(e.to_string().contains("does not act elementwise"), "{e}");
    let col = SwiGluConfig::new(8, 8).with_layout(LinearLayout::Col);
    assert!(
        ParallelSwiGlu::new(&col, &solo(), 1, &d)
            .unwrap_err()
            .to_string()
            .contains("Col")
    );
    let e = master_init(&Initializer::XavierUniform { gain: 1.0 }).unwrap_err();
    assert!(e.to_string().contains("XavierUniform"), "{e}");
    Ok(())
}

#[test]
fn a_full_width_input_to_a_row_parallel_layer_is_an_error_naming_the_numbers() {
    // The attention output reshaped to the input's width (16) where this rank holds 8.
    let out = threads(
        &ParallelConfig::new(2, 2, 1),
        LaunchOptions::default(),
        |ctx| {
            let wo =
                RowParallelLinear::split(&seeded_linear(16, 16, 3, &ctx.device), &ctx.groups.tp)?;
            let y = wo.forward(data([2, 16], 0, 1, &ctx.device));
            Ok::<_, Error>(burn_megatron_tests::values(y))
        },
    );
    let e = out.unwrap_err().to_string();
    assert!(
        e.contains("RowParallelLinear: the input has 16 features, this rank's weight takes 8")
            && e.contains("attention_split"),
        "{e}"
    );
}
