//! Parameter dtype casts shared by the optimizers: the model to and from its FP32 master
//! copy, keeping ids and `require_grad`.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, FloatDType, Tensor};
use burn_megatron_kernels::master_to_model;

/// `p` with its value replaced by `f` of it, as a fresh leaf: id and `require_grad` kept.
pub(super) fn map_value<const D: usize>(
    p: Param<Tensor<D>>,
    f: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Param<Tensor<D>> {
    let (id, t, mapper) = p.consume();
    let rg = t.is_require_grad();
    Param::from_mapped_value(id, f(t).detach().set_require_grad(rg), mapper)
}

/// Casts every float parameter, keeping ids and whether it requires grad.
pub(super) struct Cast(pub(super) DType);

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        map_value(p, |t| t.cast(self.0))
    }
}

/// bf16 / f16 as the kernels name them; `None` for every other dtype.
pub(super) fn half_dtype(dtype: DType) -> Option<FloatDType> {
    match dtype {
        DType::BF16 => Some(FloatDType::BF16),
        DType::F16 => Some(FloatDType::F16),
        _ => None,
    }
}

/// An FP32 master tensor in the model's `dtype`: to bf16 / f16 by the fused rounding pass
/// (`master_to_model`, bit-exact with `half`'s round-to-nearest-even), otherwise a cast.
/// Only a device without the half type refuses the rounding, and a plain cast is then the
/// answer.
pub(super) fn to_model_dtype<const D: usize>(master: Tensor<D>, dtype: DType) -> Tensor<D> {
    match half_dtype(dtype) {
        Some(half) if master.dtype() == DType::F32 => {
            master_to_model(master.clone(), half).unwrap_or_else(|_| master.cast(dtype))
        }
        _ => master.cast(dtype),
    }
}

/// `model` with every float parameter cast to `dtype` (ids and `require_grad` kept): how a
/// model is put in bf16 / f16 before [`MegatronOptimizer::new`](super::MegatronOptimizer::new) keeps its FP32 master copy.
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::{DType, Device};
/// use burn_megatron::optimizer::cast_params;
/// let model = cast_params(LinearConfig::new(2, 2).init(&Device::flex().autodiff()), DType::BF16);
/// assert_eq!(model.weight.val().dtype(), DType::BF16);
/// ```
pub fn cast_params<M: Module>(model: M, dtype: DType) -> M {
    model.map(&mut Cast(dtype))
}
