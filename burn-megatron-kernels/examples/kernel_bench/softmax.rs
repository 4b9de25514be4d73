//! Scaled masked softmax vs the attention layer's composition:
//! `softmax(mask_fill(scores · scale, padded, −10000), 3)` (plus a resident causal mask).

use crate::{compare, matrix};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_megatron_kernels::{MASKED_SCORE, scaled_masked_softmax};

pub fn bench(device: &Device) {
    let (b, heads, s) = (1, 4, 512);
    let scale = 0.125;
    let scores = matrix(device, b * heads * s, s).reshape([b, heads, s, s]);
    // The second sequence is padded from position 400 on.
    let pad: Vec<bool> = (0..b * s).map(|k| k / s == 1 && k % s >= 400).collect();
    let pad = Tensor::<2, Bool>::from_data(TensorData::new(pad, [b, s]), device);
    let future: Vec<bool> = (0..s * s).map(|k| k % s > k / s).collect();
    let future = Tensor::<2, Bool>::from_data(TensorData::new(future, [s, s]), device);
    for causal in [false, true] {
        let composed = |scores: Tensor<4>| {
            let pad = pad.clone().unsqueeze_dim::<3>(1).unsqueeze_dim::<4>(1);
            let mut filled = scores.mul_scalar(scale).mask_fill(pad, MASKED_SCORE);
            if causal {
                filled = filled.mask_fill(future.clone().unsqueeze::<4>(), MASKED_SCORE);
            }
            softmax(filled, 3)
        };
        let fused =
            |scores| scaled_masked_softmax(scores, Some(pad.clone()), scale, causal).unwrap();
        let case = format!("[{b}, {heads}, {s}, {s}] causal {causal} fwd");
        compare(
            device,
            "scaled_masked_softmax",
            &case,
            || drop(fused(scores.clone())),
            || drop(composed(scores.clone())),
        );
        let backward = |use_fused: bool| {
            let x = scores.clone().require_grad();
            let y = if use_fused {
                fused(x.clone())
            } else {
                composed(x.clone())
            };
            // A weighted sum, so the softmax gradient is not identically zero.
            let grads = (y * scores.clone()).sum().backward();
            drop(x.grad(&grads));
        };
        let case = format!("[{b}, {heads}, {s}, {s}] causal {causal} fwd+bwd");
        compare(
            device,
            "scaled_masked_softmax",
            &case,
            || backward(true),
            || backward(false),
        );
    }
}
