//! p2p between two stages: shapes and dtypes carried, the two channels kept apart, combined
//! calls that cannot deadlock, errors instead of hangs.

use crate::launch::{LaunchOptions, threads};
use crate::pipeline::{P2pShapes, PipelineError};
use crate::topology::ParallelConfig;
use burn::tensor::{DType, Tensor, TensorCreationOptions, TensorData};
use std::time::Duration;

type Result<T> = std::result::Result<T, PipelineError>;

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().iter::<f32>().collect()
}

fn filled<const D: usize>(dims: [usize; D], value: f32, dtype: DType) -> Tensor<D> {
    let n = dims.iter().product();
    Tensor::from_data(
        TensorData::new(vec![value; n], dims),
        TensorCreationOptions::new(burn::tensor::Device::flex()).with_dtype(dtype),
    )
}

#[test]
fn variable_shapes_and_dtypes_travel_with_the_tensor() {
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let p2p = ctx.p2p(P2pShapes::Variable);
            if ctx.state.pipeline_model_parallel_rank() == 0 {
                p2p.send_forward(filled([3, 1, 4], 1.5, DType::BF16))?;
                p2p.send_forward(filled([5, 1, 4], 2.0, DType::F32))?;
                let g = p2p.recv_backward::<3>()?;
                Ok::<_, PipelineError>(vec![(g.dims().to_vec(), g.dtype(), values(g)[0])])
            } else {
                let a = p2p.recv_forward::<3>(true)?;
                let b = p2p.recv_forward::<3>(false)?;
                assert!(a.is_require_grad() && !b.is_require_grad());
                p2p.send_backward(filled([3, 1, 4], -1.0, DType::F16))?;
                Ok(vec![
                    (a.dims().to_vec(), a.dtype(), values(a)[0]),
                    (b.dims().to_vec(), b.dtype(), values(b)[0]),
                ])
            }
        },
    )
    .unwrap();
    assert_eq!(out[0], vec![(vec![3, 1, 4], DType::F16, -1.0)]);
    assert_eq!(
        out[1],
        vec![
            (vec![3, 1, 4], DType::BF16, 1.5),
            (vec![5, 1, 4], DType::F32, 2.0)
        ]
    );
}

/// With two stages, rank 0 sends rank 1 an activation and (from a later chunk) a gradient of
/// the same shape: each arrives on its own channel, whatever order they are taken in.
#[test]
fn activations_and_gradients_never_mix() {
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let fixed = P2pShapes::Fixed {
                dims: vec![2, 2],
                dtype: DType::F32,
            };
            let p2p = ctx.p2p(fixed);
            if ctx.state.pipeline_model_parallel_rank() == 0 {
                p2p.send_forward(filled([2, 2], 1.0, DType::F32))?;
                // Rank 0's previous stage on the ring is rank 1.
                p2p.send_backward(filled([2, 2], 7.0, DType::F32))?;
                Ok::<_, PipelineError>(vec![])
            } else {
                let grad = p2p.recv_backward::<2>()?;
                let act = p2p.recv_forward::<2>(false)?;
                Ok(vec![values(grad)[0], values(act)[0]])
            }
        },
    )
    .unwrap();
    assert_eq!(out[1], vec![7.0, 1.0]);
}

#[test]
fn combined_calls_do_not_deadlock_when_both_neighbours_send_first() {
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let p2p = ctx.p2p(P2pShapes::Variable);
            let rank = ctx.state.pipeline_model_parallel_rank();
            // Steady 1F1B: stage 0 sends its output and waits for a gradient while stage 1 sends
            // a gradient and waits for the next input.
            let got = if rank == 0 {
                p2p.send_forward_recv_backward(filled([2], 1.0, DType::F32))?
            } else {
                p2p.send_backward_recv_forward(filled([2], 3.0, DType::F32), true)?
            };
            Ok::<_, PipelineError>(values(got))
        },
    )
    .unwrap();
    assert_eq!(out, vec![vec![3.0, 3.0], vec![1.0, 1.0]]);
}

#[test]
fn mismatches_and_missing_peers_are_errors() {
    // A fixed channel refuses another shape before sending.
    let out = threads(
        &ParallelConfig::new(2, 1, 2),
        LaunchOptions::default(),
        |ctx| {
            let p2p = ctx.p2p(P2pShapes::Fixed {
                dims: vec![4],
                dtype: DType::F32,
            });
            let r: Result<()> = if ctx.state.pipeline_model_parallel_rank() == 0 {
                p2p.send_forward(filled([5], 1.0, DType::F32))
                    .map_err(Into::into)
            } else {
                Ok(())
            };
            Ok::<_, PipelineError>(r.map_err(|e| e.to_string()))
        },
    )
    .unwrap();
    assert!(out[0].as_ref().unwrap_err().contains("[5]"), "{out:?}");
    // A receive nobody answers ends with a timeout naming the silent rank.
    let options = LaunchOptions::default().with_timeout(Duration::from_millis(300));
    let err = threads(&ParallelConfig::new(2, 1, 2), options, |ctx| {
        let p2p = ctx.p2p(P2pShapes::Variable);
        if ctx.state.pipeline_model_parallel_rank() == 1 {
            p2p.recv_forward::<2>(false)?;
        } else {
            std::thread::sleep(Duration::from_millis(600));
        }
        Ok::<_, PipelineError>(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("timed out"), "{err}");
}
