//! The optimizer-side kernels vs the Burn compositions they replace: the fused Adam step,
//! the sums of squares of a layer's gradients, and the master → f16 copy.

use crate::{compare, matrix};
use burn::tensor::{DType, Device, FloatDType, Tensor};
use burn_megatron_kernels::{
    AdamHyper, FlatAdamState, WeightDecay, fused_adam_step, master_to_model,
    multi_tensor_sum_of_squares, round_to, segment_sum_of_squares,
};

fn flat(device: &Device, n: usize) -> Tensor<1> {
    matrix(device, n / 1024, 1024).reshape([n])
}

pub fn bench(device: &Device) {
    // Four BERT-base layers' worth of weights: 4 × (4·1024² + 2·1024·4096) ≈ 50M is too slow
    // on lavapipe; 4M elements keeps each case around a second.
    let n = 1 << 22;
    let state = FlatAdamState::new(flat(device, n));
    let grad = flat(device, n) * 1024.0;
    let h = AdamHyper {
        inv_scale: 1.0 / 1024.0,
        weight_decay: WeightDecay::Decoupled(0.01),
        ..Default::default()
    };
    let composed = || {
        // Megatron's sequence with Burn ops: unscale, check, then AdamW.
        let g = grad.clone() * f64::from(h.inv_scale);
        let found = g.clone().is_finite().bool_not().int().sum();
        let m = state.exp_avg.clone() * 0.9 + g.clone() * 0.1;
        let v = state.exp_avg_sq.clone() * 0.999 + g.square() * 0.001;
        let update = (m.clone() / 0.1) / ((v.clone() / 0.001).sqrt() + 1e-5);
        let p = state.param.clone() * (1.0 - 1e-5) - update * 1e-3;
        drop((p, m, v, found));
    };
    compare(
        device,
        "adam",
        &format!("AdamW [{n}] fwd"),
        || drop(fused_adam_step(state.clone(), grad.clone(), &h).unwrap()),
        composed,
    );

    // One BERT-base layer's gradients: 16 tensors, 7M elements.
    let sizes = [
        1024 * 1024,
        1024,
        1024 * 1024,
        1024,
        1024 * 1024,
        1024,
        1024 * 1024,
        1024,
        1024,
        1024,
        4096 * 1024,
        4096,
        1024 * 4096,
        1024,
        1024,
        1024,
    ];
    let tensors: Vec<Tensor<1>> = sizes.iter().map(|&s| flat(device, s.max(1024))).collect();
    let lengths: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
    let buffer = Tensor::cat(tensors.clone(), 0);
    let per_tensor = || {
        let sums: Vec<Tensor<1>> = tensors
            .iter()
            .map(|t| t.clone().powi_scalar(2).sum())
            .collect();
        drop(Tensor::cat(sums, 0));
    };
    let case = format!("{} tensors, cat + 2 launches", sizes.len());
    compare(
        device,
        "sum_of_squares",
        &case,
        || drop(multi_tensor_sum_of_squares(&tensors).unwrap()),
        per_tensor,
    );
    let case = format!("{} segments of a flat buffer", sizes.len());
    compare(
        device,
        "sum_of_squares",
        &case,
        || drop(segment_sum_of_squares(buffer.clone(), &lengths).unwrap()),
        per_tensor,
    );

    // The master → model copy of the same 4M elements (wgpu has f16 on lavapipe, no bf16).
    let master = flat(device, n);
    compare(
        device,
        "master_cast",
        &format!("f32→f16 [{n}]"),
        || drop(master_to_model(master.clone(), FloatDType::F16).unwrap()),
        || drop(master.clone().cast(DType::F16)),
    );
    compare(
        device,
        "master_cast",
        &format!("bf16 in f32 [{n}] (ref: f16 trip)"),
        || drop(round_to(master.clone(), FloatDType::BF16).unwrap()),
        || drop(master.clone().cast(DType::F16).cast(DType::F32)),
    );
}
