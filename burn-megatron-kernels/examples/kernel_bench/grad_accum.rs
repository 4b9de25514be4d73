//! Weight-gradient accumulation vs `main_grad + xᵀ·dy` from Burn ops (cast, transpose,
//! matmul, add) on the same device.

use crate::{compare, matrix};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::accumulate_weight_grad;

pub fn bench(device: &Device) {
    // A 1024-wide layer at 256 tokens, and 512². At 1024 tokens × 1024² each call takes
    // 2–8 s on lavapipe (18 timed runs per side): too long for this bench.
    let mut dtypes = vec![DType::F32];
    if device.supports_dtype(DType::F16) {
        dtypes.push(DType::F16);
    }
    for (tokens, fan_in, fan_out) in [(256, 1024, 1024), (512, 512, 512)] {
        for &dt in &dtypes {
            let x = matrix(device, tokens, fan_in).cast(dt);
            let dy = matrix(device, tokens, fan_out).cast(dt);
            let main_grad = matrix(device, fan_in, fan_out);
            let case = format!("{dt:?} t{tokens} [{fan_in}, {fan_out}]");
            compare(
                device,
                "grad_accum",
                &case,
                || drop(accumulate_weight_grad(main_grad.clone(), x.clone(), dy.clone()).unwrap()),
                || {
                    let (x, dy): (Tensor<2>, Tensor<2>) =
                        (x.clone().cast(DType::F32), dy.clone().cast(DType::F32));
                    drop(main_grad.clone() + x.transpose().matmul(dy));
                },
            );
        }
    }
}
