//! The Adam step from Burn primitive ops: the ground truth of the kernel, and the
//! implementation on backends without one.

use super::AdamHyper;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata, get_or_init_device_settings};
use burn::tensor::{FloatDType, Shape};

/// The number of non-finite elements of `g` as an f32 `[1]`: `g·0` is NaN exactly there.
pub(crate) fn non_finite_count<B: Backend>(g: FloatTensor<B>) -> FloatTensor<B> {
    let device = g.device();
    let bool_dtype = get_or_init_device_settings::<B>(&device).bool_dtype;
    let zero_or_nan = B::float_mul_scalar(g, 0.0f32.into());
    let flags = B::float_not_equal(zero_or_nan.clone(), zero_or_nan, bool_dtype);
    let count = B::float_sum(B::bool_into_float(flags, FloatDType::F32));
    B::float_reshape(count, Shape::from([1]))
}

/// One step with Burn's ops, in burn-optim's order of operations (`AdamW::step`,
/// `Adam::step` with `WeightDecay::transform`): returns the new `(param, exp_avg,
/// exp_avg_sq)` and the count of non-finite unscaled gradient elements (f32 `[1]`).
/// The state is f32; `grad` is cast to f32 first.
pub fn reference_adam_step<B: Backend>(
    param: FloatTensor<B>,
    exp_avg: FloatTensor<B>,
    exp_avg_sq: FloatTensor<B>,
    grad: FloatTensor<B>,
    hyper: &AdamHyper,
) -> (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
) {
    let s = hyper.scalars();
    // Every op consumes its inputs, and a clone is taken only where a value is used twice:
    // Flex then updates uniquely held buffers in place instead of allocating one per op.
    // Multiplying by exactly 1 is skipped, which changes no bit.
    let scale = |t: FloatTensor<B>, k: f32| match k {
        1.0 => t,
        k => B::float_mul_scalar(t, k.into()),
    };
    let g = scale(
        scale(B::float_cast(grad, FloatDType::F32), s.inv_scale),
        s.clip,
    );
    let non_finite = non_finite_count::<B>(g.clone());
    let (g, param) = match s.l2 {
        Some(w) => (
            B::float_add(B::float_mul_scalar(param.clone(), w.into()), g),
            param,
        ),
        None => (g, param),
    };
    let m = B::float_add(
        B::float_mul_scalar(exp_avg, s.beta1.into()),
        B::float_mul_scalar(g.clone(), s.one_minus_beta1.into()),
    );
    let v = B::float_add(
        B::float_mul_scalar(exp_avg_sq, s.beta2.into()),
        B::float_mul_scalar(B::float_powi_scalar(g, 2.into()), s.one_minus_beta2.into()),
    );
    let update = if s.l2.is_some() {
        // burn-optim's `Adam`: both corrections folded into two scalars.
        B::float_div(
            B::float_mul_scalar(m.clone(), s.adam_factor.into()),
            B::float_add_scalar(B::float_sqrt(v.clone()), s.adam_eps.into()),
        )
    } else {
        let m_hat = B::float_div_scalar(m.clone(), s.correction1.into());
        let v_hat = B::float_div_scalar(v.clone(), s.correction2.into());
        B::float_div(
            m_hat,
            B::float_add_scalar(B::float_sqrt(v_hat), s.eps.into()),
        )
    };
    let param = B::float_sub(
        scale(param, s.keep),
        B::float_mul_scalar(update, s.lr.into()),
    );
    (param, m, v, non_finite)
}
