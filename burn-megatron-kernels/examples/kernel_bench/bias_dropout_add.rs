//! Bias + dropout + residual, and plain dropout, vs the compositions they replace: the host
//! mask uploaded per call, then `residual + mask_fill((x + b) · scale, dropped, 0)` (or
//! without bias and residual).

use crate::{compare, matrix};
use burn::tensor::{Bool, Device, Tensor};
use burn_megatron_kernels::{bias_dropout_add, dropout, dropout_mask};

const PROB: f32 = 0.1;
const SEED: u64 = 0x5EED;

fn composed(x: Tensor<2>, b: Tensor<1>, r: Tensor<2>, kept: Tensor<2, Bool>) -> Tensor<2> {
    let v = (x + b.unsqueeze()).mul_scalar(1.0 / (1.0 - PROB));
    r + v.mask_fill(kept.bool_not(), 0.0)
}

pub fn bench(device: &Device) {
    let (rows, cols) = (2048, 1024);
    let (x, r) = (matrix(device, rows, cols), matrix(device, rows, cols));
    let b = matrix(device, 1, cols).reshape([cols]);
    let fused =
        |x: Tensor<2>, b: Tensor<1>, r| bias_dropout_add(x, Some(b), r, PROB, SEED).unwrap();
    let host_mask = || dropout_mask(SEED, [rows, cols], PROB, device);
    let case = format!("[{rows}, {cols}] p{PROB} fwd");
    compare(
        device,
        "bias_dropout_add",
        &case,
        || drop(fused(x.clone(), b.clone(), r.clone())),
        || drop(composed(x.clone(), b.clone(), r.clone(), host_mask())),
    );
    // The element-wise fusion alone: the composition's mask already on the device.
    let kept = host_mask();
    let case = format!("[{rows}, {cols}] fwd, mask resident");
    compare(
        device,
        "bias_dropout_add",
        &case,
        || drop(fused(x.clone(), b.clone(), r.clone())),
        || drop(composed(x.clone(), b.clone(), r.clone(), kept.clone())),
    );
    let backward = |use_fused: bool| {
        let (x, b, r) = (
            x.clone().require_grad(),
            b.clone().require_grad(),
            r.clone().require_grad(),
        );
        let y = if use_fused {
            fused(x.clone(), b.clone(), r.clone())
        } else {
            composed(x.clone(), b.clone(), r.clone(), host_mask())
        };
        let grads = y.sum().backward();
        drop((x.grad(&grads), b.grad(&grads), r.grad(&grads)));
    };
    let case = format!("[{rows}, {cols}] p{PROB} fwd+bwd");
    compare(
        device,
        "bias_dropout_add",
        &case,
        || backward(true),
        || backward(false),
    );
    // Attention-probability dropout: the mask a hash of the seed in the kernel, against
    // the host mask uploaded and applied (what `RngTracker::dropout` did before).
    let case = format!("[{rows}, {cols}] p{PROB} fwd");
    compare(
        device,
        "dropout",
        &case,
        || drop(dropout(x.clone(), PROB, SEED).unwrap()),
        || {
            let v = x.clone().mul_scalar(1.0 / (1.0 - PROB));
            drop(v.mask_fill(host_mask().bool_not(), 0.0))
        },
    );
}
