//! Bias + GeLU vs `gelu(x + bias)` from Burn ops.

use crate::{compare, matrix};
use burn::tensor::Device;
use burn::tensor::activation::{gelu, gelu_approximate};
use burn_megatron_kernels::{Gelu, bias_gelu};

pub fn bench(device: &Device) {
    for (rows, cols) in [(512, 1024), (2048, 4096)] {
        let x = matrix(device, rows, cols);
        let b = matrix(device, 1, cols).reshape([cols]);
        for form in [Gelu::Erf, Gelu::Tanh] {
            let composed = |x, b: burn::tensor::Tensor<1>| {
                let v = x + b.unsqueeze();
                match form {
                    Gelu::Erf => gelu(v),
                    Gelu::Tanh => gelu_approximate(v),
                }
            };
            let case = format!("{form:?} [{rows}, {cols}] fwd");
            compare(
                device,
                "bias_gelu",
                &case,
                || drop(bias_gelu(x.clone(), b.clone(), form)),
                || drop(composed(x.clone(), b.clone())),
            );
            let backward = |fused: bool| {
                let (x, b) = (x.clone().require_grad(), b.clone().require_grad());
                let y = if fused {
                    bias_gelu(x.clone(), b.clone(), form)
                } else {
                    composed(x.clone(), b.clone())
                };
                let grads = y.sum().backward();
                drop((x.grad(&grads), b.grad(&grads)));
            };
            let case = format!("{form:?} [{rows}, {cols}] fwd+bwd");
            compare(
                device,
                "bias_gelu",
                &case,
                || backward(true),
                || backward(false),
            );
        }
    }
}
