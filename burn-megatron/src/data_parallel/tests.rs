use super::advanced::*;
use super::*;
use crate::comm::CommunicatorExt;
use crate::comm::{CommError, ReduceOp};
use crate::launch::{LaunchOptions, threads};
use crate::topology::ParallelConfig;
use burn::module::Param;
use burn::nn::Linear;
use burn::optim::GradientsParams;
use burn::tensor::TensorData;
use burn::tensor::{DType, Tensor};

#[test]
fn buckets_fill_in_reverse_order_and_close_at_the_size() {
    assert_eq!(
        bucket_layout(&[10, 20, 30, 5], 25),
        vec![vec![3, 2], vec![1, 0]]
    );
    assert_eq!(
        bucket_layout(&[10, 20, 30, 5], 1000),
        vec![vec![3, 2, 1, 0]]
    );
    assert_eq!(
        bucket_layout(&[10, 20, 30, 5], 1),
        vec![vec![3], vec![2], vec![1], vec![0]]
    );
    assert_eq!(bucket_layout(&[], 10), Vec::<Vec<usize>>::new());
    assert_eq!(DataParallelConfig::default().bucket_elements(8), 40_000_000);
    assert_eq!(
        DataParallelConfig::default().bucket_elements(64),
        64_000_000
    );
}

/// Per rank: the averaged (or summed) gradients and the number of collectives issued.
fn reduce(
    dp: usize,
    config: DataParallelConfig,
    dtype: DType,
) -> Vec<(Vec<f32>, Vec<f32>, DType, usize)> {
    threads(
        &ParallelConfig::new(dp, 1, 1),
        LaunchOptions::default(),
        move |ctx| {
            let d = &ctx.device;
            let r = ctx.state.data_parallel_rank() as f32;
            let lin = Linear {
                weight: Param::from_tensor(
                    Tensor::<2>::from_data(TensorData::new(vec![1.0f32; 6], [2, 3]), d).cast(dtype),
                ),
                bias: Some(Param::from_tensor(Tensor::<1>::zeros([3], d).cast(dtype))),
            };
            // Rank r feeds x = [r + 1, 2(r + 1)]: dW = xᵀ·1, db = 1.
            let x =
                Tensor::<2>::from_data(TensorData::new(vec![r + 1.0, 2.0 * (r + 1.0)], [1, 2]), d)
                    .cast(dtype);
            let mut grads = GradientsParams::from_grads(lin.forward(x).sum().backward(), &lin);
            let n = all_reduce_gradients(&lin, &mut grads, &ctx.groups.dp, &config)?;
            let w = grads.get::<2>(lin.weight.id).unwrap();
            let dt = w.dtype();
            let b = grads.get::<1>(lin.bias.as_ref().unwrap().id).unwrap();
            let v = |t: Tensor<2>| t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
            Ok::<_, CommError>((v(w), v(b.unsqueeze()), dt, n))
        },
    )
    .unwrap()
}

#[test]
fn gradients_are_averaged_over_the_data_parallel_group() {
    for dp in [2, 4] {
        let mean_r1 = (1..=dp).sum::<usize>() as f32 / dp as f32; // mean of r + 1
        for (w, b, dtype, n) in reduce(dp, DataParallelConfig::default(), DType::F32) {
            assert_eq!(
                w,
                vec![
                    mean_r1,
                    mean_r1,
                    mean_r1,
                    2.0 * mean_r1,
                    2.0 * mean_r1,
                    2.0 * mean_r1
                ]
            );
            assert_eq!(b, vec![1.0; 3]);
            assert_eq!(
                (dtype, n),
                (DType::F32, 1),
                "one bucket holds both gradients"
            );
        }
    }
    // Summed, with a bucket per parameter.
    let config = DataParallelConfig {
        bucket_size: Some(1),
        average: false,
        reduce_in_fp32: false,
    };
    for (w, b, _, n) in reduce(2, config, DType::F32) {
        assert_eq!(w, vec![3.0, 3.0, 3.0, 6.0, 6.0, 6.0]);
        assert_eq!(b, vec![2.0; 3]);
        assert_eq!(n, 2);
    }
}

#[test]
fn bf16_gradients_reduced_in_fp32_keep_their_dtype() {
    let config = DataParallelConfig {
        reduce_in_fp32: true,
        ..DataParallelConfig::default()
    };
    for (w, _, dtype, _) in reduce(2, config, DType::BF16) {
        assert_eq!(dtype, DType::BF16);
        assert_eq!(w[0], 1.5);
    }
}

#[test]
fn a_group_of_one_issues_nothing() {
    let out = threads(
        &ParallelConfig::new(1, 1, 1),
        LaunchOptions::default(),
        |ctx| {
            let mut v = vec![1.0f32];
            ctx.groups.dp.all_reduce_vec(&mut v, ReduceOp::Sum)?;
            let lin = Linear {
                weight: Param::from_tensor(Tensor::<2>::ones([2, 2], &ctx.device)),
                bias: None,
            };
            let x = Tensor::<2>::ones([1, 2], &ctx.device);
            let mut grads = GradientsParams::from_grads(lin.forward(x).sum().backward(), &lin);
            all_reduce_gradients(
                &lin,
                &mut grads,
                &ctx.groups.dp,
                &DataParallelConfig::default(),
            )
        },
    )
    .unwrap();
    assert_eq!(out, vec![0]);
}

/// The experts are not hooked by the overlapped reducer, so asking for their reduction to
/// have overlapped backward is an error, not a silently unreduced gradient.
#[test]
fn the_experts_reduction_refuses_to_overlap() {
    let device = burn::tensor::Device::flex();
    let model: Linear = burn::nn::LinearConfig::new(2, 2).init(&device);
    let mut grads = GradientsParams::new();
    let config = DataParallelConfig::default();
    let overlapped = DpReduction::Overlapped(&[]);
    let e = finalize_expert_grads(&model, &mut grads, overlapped, 2, &config).unwrap_err();
    assert!(e.to_string().contains("does not overlap backward"), "{e}");
}
