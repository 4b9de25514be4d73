//! The local cross-entropy ops vs the reference compositions (cast, max, gather, sum, exp,
//! scatter) on the same device: the forward's row statistics, and the backward.

use crate::{compare, matrix};
use burn::backend::Dispatch;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_kernels::{
    LabelSmoothing, cross_entropy_backward, cross_entropy_row_stats,
    reference_cross_entropy_backward, reference_cross_entropy_row_stats,
};

pub fn bench(device: &Device) {
    // Tokens × a 32k vocabulary slice would take minutes per case on lavapipe; 512 tokens
    // (one BERT sequence) over an 8k slice keep each case to seconds.
    for (rows, cols) in [(512, 8192), (2048, 2048)] {
        let logits = matrix(device, rows, cols);
        let target = Tensor::<1, Int>::arange(0..rows as i64, device).remainder_scalar(cols as i64);
        let in_range = Tensor::<1>::ones([rows], device);
        let grad = Tensor::<1>::ones([rows], device);
        let smoothing = LabelSmoothing {
            epsilon: 0.1,
            global_vocab: cols * 2,
        };
        let d = |t: &Tensor<2>| t.clone().into_dispatch();
        let case = format!("[{rows}, {cols}] fwd (row stats)");
        compare(
            device,
            "cross_entropy",
            &case,
            || {
                let stats =
                    cross_entropy_row_stats(logits.clone(), target.clone(), in_range.clone());
                drop(stats.unwrap());
            },
            || {
                drop(reference_cross_entropy_row_stats::<Dispatch>(
                    d(&logits),
                    target.clone().into_dispatch(),
                    in_range.clone().into_dispatch(),
                ));
            },
        );
        // At one rank the local max and sum of exps are the global ones.
        let stats = cross_entropy_row_stats(logits.clone(), target.clone(), in_range.clone())
            .expect("shapes match");
        let column = |c: usize| stats.clone().narrow(1, c, 1).reshape([rows]);
        let (max, sum_exp) = (column(0), column(1));
        let case = format!("[{rows}, {cols}] bwd");
        compare(
            device,
            "cross_entropy",
            &case,
            || {
                let g = cross_entropy_backward(
                    logits.clone(),
                    max.clone(),
                    sum_exp.clone(),
                    target.clone(),
                    in_range.clone(),
                    grad.clone(),
                    smoothing,
                );
                drop(g.unwrap());
            },
            || {
                drop(reference_cross_entropy_backward::<Dispatch>(
                    d(&logits),
                    max.clone().into_dispatch(),
                    sum_exp.clone().into_dispatch(),
                    target.clone().into_dispatch(),
                    in_range.clone().into_dispatch(),
                    grad.clone().into_dispatch(),
                    smoothing,
                ));
            },
        );
    }
}
