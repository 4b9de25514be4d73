//! The MLP activations, shared by the dense MLP (`models`) and the experts (`moe`).

use burn::config::Config;
use burn::tensor::Tensor;
use burn::tensor::activation::silu;
use burn_megatron_kernels::{Gelu, bias_gelu, swiglu};

/// The MLP's activation (Megatron's `activation_func`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ActivationFunc {
    /// GeLU, erf form (`F.gelu`; BERT, Megatron's default).
    Gelu,
    /// GeLU, tanh approximation (Megatron's `--openai-gelu`; GPT-2's `gelu_new`).
    GeluTanh,
    /// SiLU (with `gated_linear_unit`: SwiGLU, Megatron's `--swiglu`).
    Silu,
}

impl ActivationFunc {
    pub(crate) fn apply<const D: usize>(self, x: Tensor<D>, bias: Option<Tensor<1>>) -> Tensor<D> {
        match (self, bias) {
            // One fused kernel on GPUs.
            (Self::Gelu, Some(b)) => bias_gelu(x, b, Gelu::Erf),
            (Self::GeluTanh, Some(b)) => bias_gelu(x, b, Gelu::Tanh),
            (Self::Silu, Some(b)) => silu(x + b.unsqueeze()),
            // Burn 0.22.1's `gelu` differentiates the tanh approximation: the fused kernel
            // with a zero bias has each form's own derivative, and the values the biased
            // layers compute (the bias added as the kernel adds it).
            (Self::Gelu | Self::GeluTanh, None) => {
                let zero = Tensor::<1>::zeros([x.dims()[D - 1]], &x.device()).cast(x.dtype());
                let form = if self == Self::Gelu {
                    Gelu::Erf
                } else {
                    Gelu::Tanh
                };
                bias_gelu(x, zero, form)
            }
            (Self::Silu, None) => silu(x),
        }
    }

    /// `act(gate) · up`, a gated linear unit: SwiGLU in one fused pass.
    pub(crate) fn glu<const D: usize>(self, gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Silu => swiglu(gate, up)
                .expect("gate and up project one input to the same features: one shape and dtype"),
            act => act.apply(gate, None) * up,
        }
    }
}
