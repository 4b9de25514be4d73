use super::*;
use crate::launch::{LaunchOptions, threads};
use crate::param_grads::{float_params, with_flat};
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, MasterInit, RowParallelLinear,
    RowParallelLinearConfig, TpError,
};
use crate::topology::ParallelConfig;
use burn::module::Module;
use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
use burn::tensor::Tensor;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, TensorData};

const D: usize = 8;
const FFN: usize = 16;

/// LayerNorm (duplicated on every TP rank) → Column → GeLU → Row.
#[derive(Module, Debug)]
struct TpBlock {
    norm: LayerNorm,
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}

#[derive(Module, Debug)]
struct Block {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

fn input(device: &Device) -> Tensor<2> {
    let v: Vec<f32> = (0..4 * D)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0)
        .collect();
    Tensor::from_data(TensorData::new(v, [4, D]), device)
}

/// Grad norms (L2, inf) at TP = `tp`, every rank's view.
fn norms(tp: usize) -> Vec<(f64, f64)> {
    threads(
        &ParallelConfig::new(tp, tp, 1),
        LaunchOptions::default(),
        |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let bias = MasterInit::Uniform {
                low: -0.5,
                high: 0.5,
            };
            let model = TpBlock {
                norm: LayerNormConfig::new(D).init(d),
                fc1: ColumnParallelLinearConfig::new(D, FFN)
                    .with_seed(1)
                    .with_bias_initializer(bias)
                    .init(g, d)?,
                fc2: RowParallelLinearConfig::new(FFN, D)
                    .with_seed(2)
                    .with_bias_initializer(bias)
                    .init(g, d)?,
            };
            let y = model
                .fc2
                .forward(gelu(model.fc1.forward(model.norm.forward(input(d)))));
            let grads = GradientsParams::from_grads(y.powi_scalar(2).sum().backward(), &model);
            let rank = ctx.state.tensor_model_parallel_rank();
            let l2 = global_grad_norm(&model, &grads, rank, &ctx.groups.mp, NormType::L2)?;
            let inf = global_grad_norm(&model, &grads, rank, &ctx.groups.mp, NormType::Inf)?;
            Ok::<_, TpError>((l2, inf))
        },
    )
    .unwrap()
}

#[test]
fn duplicated_params_count_once_so_the_norm_is_the_single_rank_norm() {
    let reference = norms(1)[0];
    // Sanity: a plain Burn block gives the same norm as the TP = 1 parallel one.
    let device = Device::flex().autodiff();
    let tp: Comm = std::sync::Arc::new(
        crate::comm::LocalWorld::new(1)
            .communicator("tp", vec![0], 0)
            .unwrap(),
    );
    let bias = MasterInit::Uniform {
        low: -0.5,
        high: 0.5,
    };
    let col = ColumnParallelLinearConfig::new(D, FFN)
        .with_seed(1)
        .with_bias_initializer(bias)
        .init(&tp, &device)
        .unwrap();
    let row = RowParallelLinearConfig::new(FFN, D)
        .with_seed(2)
        .with_bias_initializer(bias)
        .init(&tp, &device)
        .unwrap();
    let plain = Block {
        norm: LayerNormConfig::new(D).init(&device),
        fc1: col.to_linear().unwrap().fork(&device),
        fc2: row.to_linear().unwrap().fork(&device),
    };
    let y = plain
        .fc2
        .forward(gelu(plain.fc1.forward(plain.norm.forward(input(&device)))));
    let grads = GradientsParams::from_grads(y.powi_scalar(2).sum().backward(), &plain);
    let mut sq = 0.0f64;
    for (id, dims) in float_params(&plain) {
        sq += with_flat(&grads, id, dims, |g| {
            f64::from(g.powi_scalar(2).sum().into_scalar::<f32>())
        })
        .unwrap();
    }
    assert!(
        (sq.sqrt() - reference.0).abs() < 1e-4 * reference.0,
        "{} vs {}",
        sq.sqrt(),
        reference.0
    );

    for tp in [2, 4] {
        for (l2, inf) in norms(tp) {
            assert!(
                (l2 - reference.0).abs() <= 1e-5 * reference.0,
                "tp {tp}: L2 {l2} vs {}",
                reference.0
            );
            assert!(
                (inf - reference.1).abs() <= 1e-5 * reference.1,
                "tp {tp}: inf {inf} vs {}",
                reference.1
            );
        }
    }
}

#[test]
fn clipping_scales_to_the_max_norm_only_when_above_it() {
    let device = Device::flex().autodiff();
    let lin = Linear {
        weight: Param::from_tensor(Tensor::<2>::ones([2, 2], &device)),
        bias: None,
    };
    let x = Tensor::<2>::from_floats([[3.0, 4.0]], &device);
    let mut grads = GradientsParams::from_grads(lin.forward(x).sum().backward(), &lin);
    // d/dW sum(x·W) = xᵀ·1 = [[3, 3], [4, 4]]: norm √50.
    let tp: Comm = std::sync::Arc::new(
        crate::comm::LocalWorld::new(1)
            .communicator("mp", vec![0], 0)
            .unwrap(),
    );
    let norm = global_grad_norm(&lin, &grads, 0, &tp, NormType::L2).unwrap();
    assert!((norm - 50f64.sqrt()).abs() < 1e-5);
    assert_eq!(clip_grads_by_total_norm(&lin, &mut grads, 100.0, norm), 1.0);
    let coeff = clip_grads_by_total_norm(&lin, &mut grads, 1.0, norm);
    assert!((coeff - 1.0 / (50f64.sqrt() + 1e-6)).abs() < 1e-12);
    let clipped = global_grad_norm(&lin, &grads, 0, &tp, NormType::L2).unwrap();
    assert!((clipped - 1.0).abs() < 1e-5, "{clipped}");
}
