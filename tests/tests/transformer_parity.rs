//! `TransformerLayer` at TP = 2 and 4 (with and without sequence parallelism, post- and
//! pre-LayerNorm) against TP = 1 from the same seed: losses over 3 SGD steps, and gathered
//! gradients of the first step.

use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_megatron::comm::tensor::all_gather;
use burn_megatron::launch::{LaunchOptions, threads};
use burn_megatron::models::{AttentionInputs, LayerNormPosition, NormKind};
use burn_megatron::tensor_parallel::mappings::{
    gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region,
};
use burn_megatron::tensor_parallel::{TpError, allreduce_sequence_parallel_grads};
use burn_megatron::topology::ParallelConfig;
use burn_megatron_tests::bert::layer;
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::*;

const S: usize = 4;
const B: usize = 2;
const H: usize = 16;
const HEADS: usize = 4;
const FFN: usize = 32;

/// Per rank: per-step losses, then the gathered QKV weight gradient and the input LayerNorm
/// gamma gradient of step 0.
type Out = (Vec<f32>, Vec<f32>, Vec<f32>);

fn padding(device: &Device) -> Tensor<2, Bool> {
    // The last position of the second sequence is padding.
    Tensor::<2>::from_data(
        TensorData::new(vec![0.0f32, 0., 0., 0., 0., 0., 0., 1.], [B, S]),
        device,
    )
    .equal_elem(1.0)
}

fn run(tp: usize, sp: bool, position: LayerNormPosition, norm: NormKind) -> Vec<Out> {
    threads(
        &ParallelConfig::new(tp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let layer = layer(H, HEADS, FFN)
                .with_layernorm_position(position)
                .with_normalization(norm)
                .with_sequence_parallel(sp)
                .with_seed(9);
            let mut layer = no_dropout(layer).init(g, d)?;
            let mut optim = SgdConfig::new().init();
            let (mut losses, mut qkv, mut gamma) = (Vec::new(), Vec::new(), Vec::new());
            for step in 0..3 {
                let x = data([S, B, H], step, 1, d);
                let x = if sp {
                    scatter_to_sequence_parallel_region(x, g)
                } else {
                    x
                };
                let y = layer.forward(x, &AttentionInputs::padding(padding(d)), None);
                let y = if sp {
                    gather_from_sequence_parallel_region(y, g, false)
                } else {
                    y
                };
                let loss = (y * data([S, B, H], step, 2, d)).sum();
                let mut grads = GradientsParams::from_grads(loss.backward(), &layer);
                allreduce_sequence_parallel_grads(&layer, &mut grads, g)?;
                if step == 0 {
                    let w = grads
                        .get::<2>(layer.attention.query_key_value.weight.id)
                        .unwrap();
                    qkv = values(all_gather(&**g, w, 1)?);
                    gamma = values(grads.get::<1>(layer.input_layernorm.gamma().id).unwrap());
                }
                losses.push(values(loss.inner())[0]);
                layer = optim.step(0.05, layer, grads);
            }
            Ok::<_, TpError>((losses, qkv, gamma))
        },
    )
    .unwrap()
}

#[test]
fn transformer_layer_matches_tp1() {
    let cases = [
        (LayerNormPosition::Post, NormKind::LayerNorm),
        (LayerNormPosition::Pre, NormKind::LayerNorm),
        (LayerNormPosition::Pre, NormKind::RmsNorm),
    ];
    for (position, norm) in cases {
        let one = run(1, false, position, norm).remove(0);
        for (tp, sp) in [(2, false), (4, false), (2, true), (4, true)] {
            for (rank, (losses, qkv, gamma)) in run(tp, sp, position, norm).into_iter().enumerate()
            {
                let what = format!("{position:?} {norm:?} tp {tp} sp {sp} rank {rank}");
                assert_close(&losses, &one.0, 1e-4, &format!("{what} losses"));
                assert_close(&qkv, &one.1, 1e-5, &format!("{what} qkv grad"));
                assert_close(&gamma, &one.2, 1e-5, &format!("{what} layernorm grad"));
            }
        }
    }
}

#[test]
fn heads_not_divisible_by_tp_is_an_error() {
    let err = tp_ranks(4, |ctx| {
        layer(H, 6, FFN)
            .init(&ctx.groups.tp, &ctx.device)
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("attention heads (6) are not divisible by the tensor-parallel size (4)"),
        "{err}"
    );
}

/// Zero heads (or a zero hidden size) passed every divisibility check and then divided by
/// zero while the heads were sized.
#[test]
fn zero_heads_or_hidden_size_is_an_error() {
    for (hidden, heads) in [(0, 0), (H, 0), (0, HEADS)] {
        let err = tp_ranks(1, |ctx| {
            layer(hidden, heads, FFN)
                .init(&ctx.groups.tp, &ctx.device)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("must all be at least 1"),
            "{hidden}/{heads}: {err}"
        );
    }
}
