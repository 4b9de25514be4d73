//! Exact-value tests of every mapping's forward and backward at TP = 4, inputs built from
//! the rank so every number can be checked by hand.

use super::*;
use crate::comm::CommError;
use crate::launch::{LaunchError, LaunchOptions, RankContext, threads};
use crate::topology::ParallelConfig;
use burn::tensor::{DType, Device, Tensor, TensorData};
use std::time::{Duration, Instant};

fn opts() -> LaunchOptions {
    LaunchOptions::default().with_timeout(Duration::from_secs(5))
}

/// Runs `f` on 4 TP ranks and returns (rank, f's output) per rank.
fn tp4<T: Send>(f: impl Fn(&RankContext, f32) -> T + Sync) -> Vec<T> {
    threads(&ParallelConfig::new(4, 4, 1), opts(), |ctx| {
        let r = ctx.state.tensor_model_parallel_rank() as f32;
        Ok::<_, CommError>(f(&ctx, r))
    })
    .unwrap()
}

fn t2(rows: usize, cols: usize, f: impl Fn(usize, usize) -> f32, device: &Device) -> Tensor<2> {
    let v: Vec<f32> = (0..rows * cols).map(|i| f(i / cols, i % cols)).collect();
    Tensor::from_data(TensorData::new(v, [rows, cols]), device)
}

fn vals(t: Tensor<2>) -> Vec<f32> {
    t.cast(DType::F32).into_data().try_to_vec().unwrap()
}

/// Forward output and the input's gradient for `loss = sum(mapping(x) · w)`.
fn fwd_bwd(
    x: Tensor<2>,
    w: impl Fn(&Tensor<2>) -> Tensor<2>,
    map: impl Fn(Tensor<2>) -> Tensor<2>,
) -> (Vec<f32>, [usize; 2], Vec<f32>) {
    let x = x.require_grad();
    let y = map(x.clone());
    let dims = y.dims();
    let loss = (y.clone() * w(&y)).sum();
    let grads = loss.backward();
    (vals(y.inner()), dims, vals(x.grad(&grads).unwrap()))
}

#[test]
fn copy_to_is_identity_forward_and_all_reduce_backward() {
    let out = tp4(|ctx, r| {
        let x = t2(2, 3, |_, c| c as f32, &ctx.device);
        fwd_bwd(
            x,
            |y| y.ones_like() * r,
            |x| copy_to_tensor_model_parallel_region(x, &ctx.groups.tp),
        )
    });
    for (y, dims, g) in out {
        assert_eq!((y, dims), (vec![0., 1., 2., 0., 1., 2.], [2, 3]));
        assert_eq!(g, vec![6.0; 6], "0 + 1 + 2 + 3");
    }
}

#[test]
fn reduce_from_is_all_reduce_forward_and_identity_backward() {
    let out = tp4(|ctx, r| {
        let x = t2(2, 3, |_, _| r, &ctx.device);
        fwd_bwd(
            x,
            |y| y.ones_like() * (r + 1.0),
            |x| reduce_from_tensor_model_parallel_region(x, &ctx.groups.tp),
        )
    });
    for (rank, (y, _, g)) in out.into_iter().enumerate() {
        assert_eq!(y, vec![6.0; 6]);
        assert_eq!(g, vec![rank as f32 + 1.0; 6]);
    }
}

#[test]
fn scatter_to_splits_last_dim_and_gathers_gradient() {
    let out = tp4(|ctx, r| {
        let x = t2(2, 8, |row, c| (10 * row + c) as f32, &ctx.device);
        fwd_bwd(
            x,
            |y| y.ones_like() * (r + 1.0),
            |x| scatter_to_tensor_model_parallel_region(x, &ctx.groups.tp),
        )
    });
    for (k, (y, dims, g)) in out.into_iter().enumerate() {
        let c = 2.0 * k as f32;
        assert_eq!((y, dims), (vec![c, c + 1., 10. + c, 11. + c], [2, 2]));
        let row: Vec<f32> = (0..8).map(|c| (c / 2 + 1) as f32).collect();
        assert_eq!(g, [row.clone(), row].concat());
    }
}

#[test]
fn gather_from_concatenates_last_dim_in_rank_order_and_splits_gradient() {
    let out = tp4(|ctx, r| {
        let x = t2(
            2,
            2,
            |row, c| 100. * row as f32 + 10. * r + c as f32,
            &ctx.device,
        );
        // Weight each output column by its index: the gradient is that index.
        let w = |y: &Tensor<2>| t2(2, 8, |_, c| c as f32, &y.device());
        fwd_bwd(x, w, |x| {
            gather_from_tensor_model_parallel_region(x, &ctx.groups.tp)
        })
    });
    for (k, (y, dims, g)) in out.into_iter().enumerate() {
        assert_eq!(dims, [2, 8]);
        assert_eq!(&y[..8], &[0., 1., 10., 11., 20., 21., 30., 31.]);
        assert_eq!(&y[8..], &[100., 101., 110., 111., 120., 121., 130., 131.]);
        let c = 2.0 * k as f32;
        assert_eq!(g, vec![c, c + 1., c, c + 1.]);
    }
}

#[test]
fn scatter_to_sequence_parallel_splits_rows_and_gathers_gradient() {
    let out = tp4(|ctx, r| {
        let x = t2(8, 2, |row, _| row as f32, &ctx.device);
        fwd_bwd(
            x,
            |y| y.ones_like() * (r + 1.0),
            |x| scatter_to_sequence_parallel_region(x, &ctx.groups.tp),
        )
    });
    for (k, (y, dims, g)) in out.into_iter().enumerate() {
        let a = 2.0 * k as f32;
        assert_eq!((y, dims), (vec![a, a, a + 1., a + 1.], [2, 2]));
        let expect: Vec<f32> = (0..16).map(|i| (i / 4 + 1) as f32).collect();
        assert_eq!(g, expect);
    }
}

#[test]
fn gather_from_sequence_parallel_reduce_scatters_or_splits_gradient() {
    for tp_grad in [true, false] {
        let out = tp4(|ctx, r| {
            let x = t2(2, 3, |_, _| r, &ctx.device);
            fwd_bwd(
                x,
                |y| y.ones_like() * (r + 1.0),
                |x| gather_from_sequence_parallel_region(x, &ctx.groups.tp, tp_grad),
            )
        });
        for (k, (y, dims, g)) in out.into_iter().enumerate() {
            assert_eq!(dims, [8, 3]);
            let expect: Vec<f32> = (0..24).map(|i| (i / 6) as f32).collect();
            assert_eq!(y, expect);
            let grad = if tp_grad { 10.0 } else { k as f32 + 1.0 };
            assert_eq!(g, vec![grad; 6], "tensor_parallel_output_grad = {tp_grad}");
        }
    }
}

#[test]
fn reduce_scatter_to_sequence_parallel_sums_rows_and_gathers_gradient() {
    let out = tp4(|ctx, r| {
        let x = t2(8, 2, |row, _| row as f32 + r, &ctx.device);
        fwd_bwd(
            x,
            |y| y.ones_like() * (r + 1.0),
            |x| reduce_scatter_to_sequence_parallel_region(x, &ctx.groups.tp),
        )
    });
    for (k, (y, dims, g)) in out.into_iter().enumerate() {
        // Row i summed over ranks: 4i + 6; rank k keeps rows 2k, 2k + 1.
        let a = 4.0 * (2 * k) as f32 + 6.0;
        assert_eq!((y, dims), (vec![a, a, a + 4., a + 4.], [2, 2]));
        let expect: Vec<f32> = (0..16).map(|i| (i / 4 + 1) as f32).collect();
        assert_eq!(g, expect);
    }
}

#[test]
fn half_precision_dtypes_survive_every_mapping_and_its_backward() {
    let mappings = [
        Mapping::CopyTo,
        Mapping::ReduceFrom,
        Mapping::ScatterToTp,
        Mapping::GatherFromTp,
        Mapping::ScatterToSp,
        Mapping::GatherFromSp {
            tensor_parallel_output_grad: true,
        },
        Mapping::ReduceScatterToSp,
    ];
    for dtype in [DType::BF16, DType::F16] {
        let out = tp4(|ctx, _| {
            mappings
                .iter()
                .map(|&m| {
                    let x = t2(4, 4, |r, c| (r + c) as f32, &ctx.device)
                        .cast(dtype)
                        .require_grad();
                    let y = apply(x.clone(), m, &ctx.groups.tp);
                    let y_dtype = y.dtype();
                    let grads = y.sum().backward();
                    (m, y_dtype, x.grad(&grads).unwrap().dtype())
                })
                .collect::<Vec<_>>()
        });
        for (m, y, g) in out.into_iter().flatten() {
            assert_eq!((y, g), (dtype, dtype), "{m:?}");
        }
    }
}

#[test]
fn a_group_of_one_records_nothing() {
    let out = threads(&ParallelConfig::new(1, 1, 1), opts(), |ctx| {
        let x = t2(2, 2, |r, c| (r + c) as f32, &ctx.device).require_grad();
        let y = gather_from_tensor_model_parallel_region(x.clone(), &ctx.groups.tp);
        let g = y.clone().sum().backward();
        Ok::<_, CommError>((vals(y.inner()), vals(x.grad(&g).unwrap())))
    })
    .unwrap();
    assert_eq!(out[0], (vec![0., 1., 1., 2.], vec![1.0; 4]));
}

#[test]
fn mismatched_mappings_fail_every_rank_promptly() {
    let start = Instant::now();
    let err = threads(
        &ParallelConfig::new(2, 2, 1),
        LaunchOptions::default().with_timeout(Duration::from_secs(60)),
        |ctx| {
            let x = t2(2, 2, |_, _| 1.0, &ctx.device);
            let y = if ctx.state.global_rank() == 0 {
                reduce_from_tensor_model_parallel_region(x, &ctx.groups.tp)
            } else {
                gather_from_tensor_model_parallel_region(x, &ctx.groups.tp)
            };
            Ok::<_, CommError>(y.dims())
        },
    )
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    match err {
        LaunchError::Panicked { message, .. } => {
            assert!(
                message.contains("collective mismatch on group 'tp'"),
                "{message}"
            )
        }
        e => panic!("expected a panic report, got {e}"),
    }
}

/// The gathered product gives what a gather then a matmul gives, its output and the
/// gradients of its input and weight, at TP 4 with rank-dependent values.
#[test]
fn gather_sequence_matmul_is_a_gather_then_a_product() {
    let out = tp4(|ctx, r| {
        let tp = &ctx.groups.tp;
        let x = || {
            let v: Vec<f32> = (0..2 * 3 * 5).map(|i| (i as f32 + r * 7.0).sin()).collect();
            Tensor::<3>::from_data(TensorData::new(v, [2, 3, 5]), &ctx.device).require_grad()
        };
        let w = || t2(5, 4, |i, j| (i * 4 + j) as f32 * 0.1 - 1.0, &ctx.device).require_grad();
        let dy = |y: &Tensor<3>| y.ones_like() * (r + 1.0);
        let mut runs = Vec::new();
        for fused in [true, false] {
            let (x, w) = (x(), w());
            let y = match fused {
                true => gather_sequence_matmul(x.clone(), w.clone(), false, tp),
                false => gather_from_sequence_parallel_region(x.clone(), tp, true)
                    .matmul(w.clone().unsqueeze()),
            };
            let dims = y.dims();
            let grads = (y.clone() * dy(&y)).sum().backward();
            let y = y.inner().into_data().try_to_vec::<f32>().unwrap();
            let gx = x
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            let gw = vals(w.grad(&grads).unwrap());
            runs.push((dims, y, gx, gw));
        }
        runs
    });
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| (a - b).abs() < 1e-5);
    for runs in out {
        let ((dims, y, gx, gw), (dims_ref, y_ref, gx_ref, gw_ref)) = (&runs[0], &runs[1]);
        assert_eq!(
            (dims, y.len(), gx.len()),
            (dims_ref, y_ref.len(), gx_ref.len())
        );
        assert_eq!(
            *dims,
            [8, 3, 4],
            "the whole sequence of four ranks' two positions"
        );
        assert!(close(y, y_ref) && close(gx, gx_ref) && close(gw, gw_ref));
    }
}

/// With an f32 weight gradient (gradient accumulation fusion), a bf16 weight's gradient is
/// f32, and the gradients are the unfused ones (within bf16's rounding).
#[test]
fn gather_sequence_matmul_sums_a_bf16_weight_gradient_in_f32() {
    let out = tp4(|ctx, r| {
        let tp = &ctx.groups.tp;
        let mut runs = Vec::new();
        for fused in [true, false] {
            let v: Vec<f32> = (0..2 * 3 * 5).map(|i| (i as f32 + r * 7.0).sin()).collect();
            let x = Tensor::<3>::from_data(TensorData::new(v, [2, 3, 5]), &ctx.device)
                .cast(DType::BF16)
                .require_grad();
            let w = t2(5, 4, |i, j| (i * 4 + j) as f32 * 0.1 - 1.0, &ctx.device)
                .cast(DType::BF16)
                .require_grad();
            let y = gather_sequence_matmul(x.clone(), w.clone(), fused, tp);
            let grads = y.sum().backward();
            let gw = w.grad(&grads).unwrap();
            let gx = x.grad(&grads).unwrap().cast(DType::F32);
            let gx = gx.into_data().try_to_vec::<f32>().unwrap();
            runs.push((gw.dtype(), vals(gw), gx));
        }
        runs
    });
    for runs in out {
        let ((dtype, gw, gx), (plain_dtype, gw_plain, gx_plain)) = (&runs[0], &runs[1]);
        assert_eq!((*dtype, *plain_dtype), (DType::F32, DType::BF16));
        let close = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .all(|(a, b)| (a - b).abs() <= 1e-2 * b.abs().max(1.0))
        };
        assert!(
            close(gw, gw_plain) && close(gx, gx_plain),
            "{gw:?} {gw_plain:?}"
        );
    }
}
