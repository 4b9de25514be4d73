//! Burn's LoRA adapters (`Module::apply_lora`) on split weights. A weight split along one
//! dimension keeps the adapter factor on that side split with it and the factor on the other
//! side whole: a column-parallel weight `[in, out / tp]` holds `a` `[in, r]` whole and `b`
//! `[r, out / tp]` split (an output layer split by vocabulary is one); a row-parallel one
//! `[in / tp, out]`, or a table split by vocabulary rows, holds `a` `[in / tp, r]` split and
//! `b` `[r, out]` whole. Each rank's shard of `base + s · a b` is
//! then its shard of the unsplit layer's, with the adapter of the unsplit rank `r`.
//!
//! The whole factor's gradient on a rank comes from that rank's shard alone, a partial sum of
//! the unsplit gradient: it enters the tensor-parallel region through
//! [`copy_to_tensor_model_parallel_region`], whose backward sums it over the ranks (as the
//! input of a column-parallel layer does), so a plain Burn training loop steps on whole
//! gradients.

use super::attrs::{LayoutOwner, ParallelAttrs};
use super::mappings::copy_to_tensor_model_parallel_region;
use crate::comm::Comm;
use burn::module::Param;
use burn::tensor::Tensor;

/// This rank's value of `weight`, split along `sharded_dim` over `tp`: Burn's base plus its
/// LoRA adapter's product when it has one (each factor's value through `value`, the whole
/// one entering the tensor-parallel region), else the weight's own through `value` (a
/// gradient reducer's hook, say: [`hook_param`](crate::grad_hooks::hook_param)). The frozen
/// base is read as it is stored.
pub(crate) fn split_weight(
    weight: &Param<Tensor<2>>,
    sharded_dim: usize,
    tp: &Comm,
    value: impl Fn(&Param<Tensor<2>>) -> Tensor<2>,
) -> Tensor<2> {
    let Some(lora) = weight.adapter() else {
        return value(weight);
    };
    let (a, b) = (value(&lora.a), value(&lora.b));
    let (a, b) = match sharded_dim {
        0 => (a, copy_to_tensor_model_parallel_region(b, tp)),
        _ => (copy_to_tensor_model_parallel_region(a, tp), b),
    };
    let delta = a.matmul(b).mul_scalar(lora.scale);
    // As Burn composes it: the base at the factors' dtype (a quantized base dequantizes in the
    // sum).
    let base = weight.base();
    let base = match base.dtype().is_float() && base.dtype() != delta.dtype() {
        true => base.cast(delta.dtype()),
        false => base,
    };
    base + delta
}

/// Panics, naming `layer`, when `weight` carries a LoRA adapter: the library's own split
/// layers (and the recomputed regions that form their weight gradients) read a weight whole
/// and would neither split the adapter nor give it a gradient. LoRA goes on the drop-in
/// layers, [`dropin::nn`](crate::dropin::nn).
pub(crate) fn refuse_adapter(weight: &Param<Tensor<2>>, layer: &str) {
    assert!(
        weight.adapter().is_none(),
        "{layer}: Burn's LoRA adapter on the library's own split layer; LoRA is supported on \
         the drop-in layers (burn_megatron::dropin::nn), whose plan splits the adapter"
    );
}

/// An error naming `what` when `weight` carries a LoRA adapter: converting it would fold the
/// adapter into a trainable weight.
pub(crate) fn no_adapter(weight: &Param<Tensor<2>>, what: &str) -> Result<(), super::TpError> {
    match weight.adapter() {
        None => Ok(()),
        Some(_) => Err(super::TpError::Invalid(format!(
            "{what}: the layer carries Burn's LoRA adapter, which converting would fold into a \
             trainable weight; apply LoRA to the drop-in layers (burn_megatron::dropin::nn) \
             instead"
        ))),
    }
}

/// States the layout of `weight`'s adapter factors, if it has an adapter, for a weight split
/// along `sharded_dim`: the factor on that side split along the same dimension, the other
/// whole.
pub(crate) fn state_adapter(layout: &LayoutOwner, weight: &Param<Tensor<2>>, sharded_dim: usize) {
    if let Some(lora) = weight.adapter() {
        let (a, b) = adapter_attrs(sharded_dim);
        layout.state(lora.a.id, a);
        layout.state(lora.b.id, b);
    }
}

/// The layouts of a LoRA adapter's `a` and `b` on a weight split along `sharded_dim`.
pub(crate) fn adapter_attrs(sharded_dim: usize) -> (ParallelAttrs, ParallelAttrs) {
    match sharded_dim {
        0 => (ParallelAttrs::sharded(0), ParallelAttrs::default()),
        _ => (ParallelAttrs::default(), ParallelAttrs::sharded(1)),
    }
}

#[cfg(test)]
mod tests {
    use crate::comm::solo_group;
    use crate::tensor_parallel::{ColumnParallelLinear, ColumnParallelLinearConfig};
    use burn::module::{Lora, Module};
    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Tensor};

    /// The library's own split layers refuse Burn's LoRA, naming the layer: converting one
    /// (an error) and running one given an adapter (a panic, as their forward has no room
    /// for an error), rather than fold it into a trainable weight or leave it untrained.
    #[test]
    fn the_librarys_own_layers_refuse_a_lora_adapter() {
        let device = Device::flex().autodiff();
        let tp = solo_group("tp");
        let config = ColumnParallelLinearConfig::new(4, 6);
        let adapted = LinearConfig::new(4, 6)
            .init(&device)
            .apply_lora(Lora::new(2, 4.0));
        let err = ColumnParallelLinear::from_linear(&adapted, &config, &tp).unwrap_err();
        assert!(
            err.to_string()
                .contains("from_linear: the layer carries Burn's LoRA"),
            "{err}"
        );
        let plain = LinearConfig::new(4, 6).init(&device);
        let layer = ColumnParallelLinear::from_linear(&plain, &config, &tp)
            .unwrap()
            .apply_lora(Lora::new(2, 4.0));
        let x = Tensor::<2>::ones([3, 4], &device);
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| layer.forward(x)))
            .expect_err("a forward through an adapter it cannot split");
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            message.contains("ColumnParallelLinear: Burn's LoRA"),
            "{message}"
        );
    }
}
