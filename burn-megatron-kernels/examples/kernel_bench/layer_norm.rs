//! Fused LayerNorm vs Burn's `nn::LayerNorm` (a composition under autodiff), on the wgpu
//! device and on Flex, where the fused op runs native loops.

use crate::{compare, matrix};
use burn::module::Param;
use burn::nn::LayerNormConfig;
use burn::tensor::{Device, Tensor};
use burn_megatron_kernels::layer_norm;

pub fn bench(wgpu: &Device) {
    for device in [wgpu.clone(), Device::flex().autodiff()] {
        for (rows, cols) in [(2048, 768), (4096, 1024)] {
            let x = matrix(&device, rows, cols);
            let gamma = matrix(&device, 1, cols).reshape([cols]);
            let beta = gamma.clone() * 0.5;
            let mut burn_norm = LayerNormConfig::new(cols).init(&device);
            burn_norm.gamma = Param::from_tensor(gamma.clone());
            burn_norm.beta = Some(Param::from_tensor(beta.clone()));
            let fused = |x: Tensor<2>, g: Tensor<1>, b: Tensor<1>| {
                layer_norm(x, g, Some(b), 1e-5).expect("valid shapes")
            };
            let on = if device == *wgpu { "wgpu" } else { "flex" };
            compare(
                &device,
                "layer_norm",
                &format!("{on} [{rows}, {cols}] fwd"),
                || drop(fused(x.clone(), gamma.clone(), beta.clone())),
                || drop(burn_norm.forward(x.clone())),
            );
            let backward = |use_fused: bool| {
                let x = x.clone().require_grad();
                let (g, b) = (gamma.clone().require_grad(), beta.clone().require_grad());
                let y = if use_fused {
                    fused(x.clone(), g.clone(), b.clone())
                } else {
                    let mut n = burn_norm.clone();
                    n.gamma = Param::from_tensor(g.clone());
                    n.beta = Some(Param::from_tensor(b.clone()));
                    n.forward(x.clone())
                };
                let grads = (y * x.clone().detach()).sum().backward();
                drop((x.grad(&grads), g.grad(&grads), b.grad(&grads)));
            };
            compare(
                &device,
                "layer_norm",
                &format!("{on} [{rows}, {cols}] fwd+bwd"),
                || backward(true),
                || backward(false),
            );
        }
    }
}
