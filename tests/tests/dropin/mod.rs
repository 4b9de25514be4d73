//! Burn's layers made tensor-parallel (`dropin`): the tests of each way in
//! (a model's imports swapped for `dropin::nn`'s, a layer Burn built converted with `From`)
//! hold the split model to Burn's own at TP 2 and 4 (output, every gradient gathered, the
//! record paths), and a plan's errors name the layer and the numbers; a Burn CNN with no
//! layer to split trains data-parallel (`cnn`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Initializer, SwiGluConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld};
use burn_megatron::dropin::nn::transformer as ours;
use burn_megatron::dropin::{TpPlan, nn};
use burn_megatron::tensor_parallel::{RowParallelLinear, RowParallelLinearConfig, TpError};
use burn_megatron_tests::gpt::{gathered, max_rel_diff};
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{data, seeded_linear};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod attention;
mod cache;
mod cnn;
mod cross_attention;
mod decoder;
mod hf_bert;
mod hf_llama;
mod layout;
mod load;
mod lora;
mod model_parallel;
mod pipeline;
mod plan;
mod sequence;
mod text_generation;
mod training;
mod vocab;
mod whole_nn;

type Error = Box<dyn std::error::Error + Send + Sync>;

const B: usize = 2;
const S: usize = 5;
const D_MODEL: usize = 16;
const D_FF: usize = 32;
const HEADS: usize = 4;
/// Gradients are compared relative to their tensor's largest value, or this when it is
/// smaller.
const GRAD_FLOOR: f32 = 1e-2;

fn solo() -> Comm {
    Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap())
}

fn config(norm_first: bool, dropout: f64) -> TransformerEncoderConfig {
    TransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, 2)
        .with_norm_first(norm_first)
        .with_dropout(dropout)
}

/// Burn's encoder drawn by Burn once, on this thread, and saved: the record every test
/// compares with (rank threads cannot draw it alike: Burn's generator is process-wide).
fn encoder_record(config: &TransformerEncoderConfig, dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    config.init(&Device::flex()).save_file(&path).unwrap();
    path
}

/// Burn's encoder, loaded from `record`.
fn plain_encoder(
    config: &TransformerEncoderConfig,
    record: &Path,
    d: &Device,
) -> TransformerEncoder {
    config.init(d).load_file(record)
}

/// `config` as `dropin::nn`'s config, Burn's struct literal field for field.
fn dropin_config(config: &TransformerEncoderConfig) -> ours::TransformerEncoderConfig {
    ours::TransformerEncoderConfig {
        d_model: config.d_model,
        d_ff: config.d_ff,
        n_heads: config.n_heads,
        n_layers: config.n_layers,
        dropout: config.dropout,
        norm_first: config.norm_first,
        quiet_softmax: config.quiet_softmax,
        initializer: config.initializer.clone(),
        activation: config.activation.clone(),
        layer_norm_eps: config.layer_norm_eps,
    }
}

/// The drop-in encoder of `config` split over `tp` as Megatron splits its layers, its
/// weights the plan's draws from `seed`.
fn split_encoder(
    config: &TransformerEncoderConfig,
    tp: &Comm,
    seed: u64,
    d: &Device,
) -> Result<ours::TransformerEncoder, TpError> {
    let plan = TpPlan::new().encoder(&["layers.*"])?.with_seed(seed);
    plan.apply(dropin_config(config).init(d), tp)
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

/// `[B, s]`, true at the last two keys of sample 1.
fn padding(s: usize, device: &Device) -> Tensor<2, burn::tensor::Bool> {
    let v: Vec<bool> = (0..B * s).map(|i| i / s == 1 && i % s >= s - 2).collect();
    Tensor::from_data(TensorData::new(v, [B, s]), device)
}

type Values = BTreeMap<String, Vec<f32>>;

/// Burn's encoder's output, and its parameters' gradients of `sum(y · w)`.
fn plain_run(config: &TransformerEncoderConfig, record: &Path) -> (Vec<f32>, Values) {
    let device = Device::flex().autodiff();
    let encoder = plain_encoder(config, record, &device);
    let input = TransformerEncoderInput::new(data([B, S, D_MODEL], 0, 1, &device))
        .mask_pad(padding(S, &device));
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

/// The largest difference of `got`'s gradients from `want`'s, relative to each tensor's
/// largest value (at least [`GRAD_FLOOR`]), and its tensor. A key bias adds one constant to
/// all of a query's scores, which the softmax cancels: its gradient is zero in exact
/// arithmetic and rounding noise in f32, so it is held to 1e-6 absolute (a floor of 0.1).
fn grad_diff(got: &Values, want: &Values) -> (f32, String) {
    let part = |v: &Values, noise: bool| -> Values {
        let is_noise = |k: &String| k.ends_with("key.bias");
        (v.iter().filter(|(k, _)| is_noise(k) == noise))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let rest = max_rel_diff(&part(got, false), &part(want, false), GRAD_FLOOR);
    let noise = max_rel_diff(&part(got, true), &part(want, true), 0.1);
    if noise.0 > rest.0 { noise } else { rest }
}

/// The largest `|a − b|`; infinite where either is NaN (`f32::max` would skip it), or where
/// the lengths differ.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter().zip(b).fold(0f32, |m, (a, b)| {
        let d = (a - b).abs();
        if d.is_nan() { f32::INFINITY } else { m.max(d) }
    })
}

/// A split run's output and gathered gradients against the plain run's: within 1e-5 (the
/// gradients as [`grad_diff`] measures them), the message starting with `what`.
/// `loss`'s value, and `model`'s gradients from its backward, gathered over `tp`.
fn loss_and_grads<M: Module>(model: &M, loss: Tensor<1>, tp: &Comm) -> (f32, Values) {
    let value = loss.clone().into_scalar::<f32>();
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), model);
    (value, gathered(model, Some(&grads), tp))
}

fn assert_parity(what: &str, (y, grads): (&[f32], &Values), (y_plain, g_plain): (&[f32], &Values)) {
    let dy = max_abs_diff(y, y_plain);
    assert!(dy < 1e-5, "{what}: output off by {dy}");
    let (worst, name) = grad_diff(grads, g_plain);
    assert!(worst < 1e-5, "{what}: {name} off by {worst}");
}

#[test]
fn a_transformer_encoder_burn_built_converts_and_splits_as_the_plain_one() -> Result<(), Error> {
    let dir = load::scratch("from");
    for norm_first in [false, true] {
        let config = config(norm_first, 0.0);
        let record = encoder_record(&config, &dir, &format!("encoder-{norm_first}.bpk"));
        let (y_plain, g_plain) = plain_run(&config, &record);
        for tp in [2, 4] {
            let out = tp_ranks(tp, |ctx| {
                let (g, d) = (&ctx.groups.tp, &ctx.device);
                let plain = plain_encoder(&config, &record, d);
                let plain_paths = paths(&plain);
                // ANCHOR: from_burn
                let encoder: nn::transformer::TransformerEncoder = plain.into();
                let encoder = TpPlan::new().encoder(&["layers.*"])?.apply(encoder, g)?;
                // ANCHOR_END: from_burn
                // Burn's record paths: a record of one loads into the other.
                assert_eq!(paths(&encoder), plain_paths);
                let input = ours::TransformerEncoderInput::new(data([B, S, D_MODEL], 0, 1, d))
                    .mask_pad(padding(S, d));
                let y = encoder.forward(input);
                let grads = (y.clone() * data([B, S, D_MODEL], 0, 2, d))
                    .sum()
                    .backward();
                let grads = burn::optim::GradientsParams::from_grads(grads, &encoder);
                Ok::<_, Error>((
                    burn_megatron_tests::values(y),
                    gathered(&encoder, Some(&grads), g),
                ))
            })?;
            for (rank, (y, grads)) in out.iter().enumerate() {
                let what = format!("norm_first {norm_first}, TP {tp}, rank {rank}");
                assert_parity(&what, (y, grads), (&y_plain, &g_plain));
            }
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn a_swiglu_mlp_burn_built_converts_and_splits_as_the_plain_one() -> Result<(), Error> {
    // Llama's feed-forward, w2(swiglu(x)): the SwiGlu column-parallel, w2 row-parallel.
    #[derive(Module, Debug)]
    struct Mlp {
        swiglu: nn::SwiGlu,
        w2: nn::Linear,
    }
    let dir = load::scratch("swiglu");
    let (swiglu_record, w2_record) = (dir.join("swiglu.bpk"), dir.join("w2.bpk"));
    let swiglu_config = SwiGluConfig::new(D_MODEL, D_FF).with_bias(true);
    let w2_config = burn::nn::LinearConfig::new(D_FF, D_MODEL);
    swiglu_config
        .init(&Device::flex())
        .save_file(&swiglu_record)?;
    w2_config.init(&Device::flex()).save_file(&w2_record)?;
    let plain = |d: &Device| Mlp {
        swiglu: swiglu_config.init(d).load_file(&swiglu_record).into(),
        w2: w2_config.init(d).load_file(&w2_record).into(),
    };
    let run = |mlp: &Mlp, g: &Comm, d: &Device| {
        let y = mlp
            .w2
            .forward(mlp.swiglu.forward(data([B, S, D_MODEL], 0, 3, d)));
        let grads = burn::optim::GradientsParams::from_grads(y.clone().sum().backward(), mlp);
        (
            burn_megatron_tests::values(y),
            gathered(mlp, Some(&grads), g),
        )
    };
    let (y_plain, g_plain) = run(
        &plain(&Device::flex().autodiff()),
        &solo(),
        &Device::flex().autodiff(),
    );
    let plan = TpPlan::new().column(&["swiglu"])?.row(&["w2"])?;
    for tp in [2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            Ok::<_, Error>(run(&plan.apply(plain(d), g)?, g, d))
        })?;
        for (y, grads) in &out {
            assert_parity(&format!("TP {tp}"), (y, grads), (&y_plain, &g_plain));
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// The weights a plan draws follow the layer's configured initializer (not Burn's default
/// for the type, nor Kaiming's bound where Xavier's is asked for), the same at TP 1 and 2;
/// one with no law here is an error naming the layer.
#[test]
fn a_plan_draws_with_the_initializer_the_config_names() -> Result<(), Error> {
    #[derive(Module, Debug)]
    struct Net {
        embed: nn::Embedding,
        up: nn::Linear,
    }
    let net = |init: Initializer, d: &Device| Net {
        embed: nn::EmbeddingConfig::new(8, D_MODEL)
            .with_initializer(Initializer::Constant { value: 0.5 })
            .init(d),
        up: nn::LinearConfig::new(D_MODEL, D_FF)
            .with_initializer(init)
            .init(d),
    };
    let plan = TpPlan::new()
        .vocab(&["embed"])?
        .column(&["up"])?
        .with_seed(3);
    let normal = Initializer::Normal {
        mean: 0.0,
        std: 0.02,
    };
    let mut drawn = Vec::new();
    for tp in [1, 2] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            Ok::<_, Error>(gathered(&plan.apply(net(normal.clone(), d), g)?, None, g))
        })?;
        drawn.push(out[0].clone());
    }
    assert_eq!(drawn[0], drawn[1], "the same draws at TP 1 and 2");
    let w = &drawn[0];
    assert!(w["embed.weight"].iter().all(|&x| x == 0.5));
    // Burn's default, Kaiming uniform over 16 inputs, would reach ±0.25 with a std of 0.14.
    let up = &w["up.weight"];
    let std = (up.iter().map(|x| x * x).sum::<f32>() / up.len() as f32).sqrt();
    assert!((0.015..0.025).contains(&std), "std {std}");
    assert_eq!(w["up.bias"].len(), D_FF);
    // Xavier's law over a linear's two widths: uniform on ±√(6 / (16 + 32)).
    let xavier = Initializer::XavierUniform { gain: 1.0 };
    let out = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        Ok::<_, Error>(gathered(&plan.apply(net(xavier.clone(), d), g)?, None, g))
    })?;
    let bound = (6.0f32 / (D_MODEL + D_FF) as f32).sqrt();
    let largest = out[0]["up.weight"].iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        (0.95 * bound..=bound).contains(&largest),
        "{largest} against ±{bound}"
    );
    let orthogonal = Initializer::Orthogonal { gain: 1.0 };
    let e = plan
        .apply(net(orthogonal, &Device::flex()), &solo())
        .unwrap_err()
        .to_string();
    assert!(e.contains("up.weight") && e.contains("Orthogonal"), "{e}");
    Ok(())
}

#[test]
fn sizes_and_layers_that_do_not_split_are_errors_naming_them() -> Result<(), Error> {
    let errors = tp_ranks(4, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        // An inner width of 30 over 4 ranks.
        let ffn = split_encoder(&TransformerEncoderConfig::new(16, 30, 4, 1), g, 1, d);
        // A feed-forward activation that mixes the channels the ranks would split,
        // refused by the plan before any forward, in a built and in a converted encoder.
        let swiglu = TransformerEncoderConfig::new(16, 32, 4, 1).with_activation(
            burn::nn::activation::ActivationConfig::SwiGlu(SwiGluConfig::new(32, 32)),
        );
        let built = split_encoder(&swiglu, g, 1, d);
        let converted: ours::TransformerEncoder = swiglu.init(d).into();
        let converted = TpPlan::new().encoder(&["layers.*"])?.apply(converted, g);
        // An Ok would print the whole model: keep the message only.
        Ok::<_, Error>(
            [ffn, built, converted].map(|r| r.err().map(|e| e.to_string()).unwrap_or_default()),
        )
    })?;
    let e = &errors[0];
    assert!(
        e[0].contains("layers.0.pwff.linear_inner.weight") && e[0].contains("30"),
        "{}",
        e[0]
    );
    for e in &e[1..] {
        assert!(
            e.contains("layers.0.pwff") && e.contains("does not act elementwise"),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn a_full_width_input_to_a_row_parallel_layer_is_an_error_naming_the_numbers() {
    // The attention output reshaped to the input's width (16) where this rank holds 8.
    let out = tp_ranks(2, |ctx| {
        let config = RowParallelLinearConfig::new(16, 16);
        let plain = seeded_linear(16, 16, 3, &ctx.device);
        let wo = RowParallelLinear::from_linear(&plain, &config, &ctx.groups.tp)?;
        let y = wo.forward(data([2, 16], 0, 1, &ctx.device));
        Ok::<_, Error>(burn_megatron_tests::values(y))
    });
    let e = out.unwrap_err().to_string();
    assert!(
        e.contains("RowParallelLinear: the input has 16 features, this rank's weight takes 8")
            && e.contains("attention_split"),
        "{e}"
    );
}
