//! The fused Adam kernel: each cube streams a chunk of the flat buffer, updates it and writes
//! how many non-finite gradients it saw; Burn's `sum` adds the per-cube counts (two launches).

use super::{AdamHyper, FusedAdamOps, ranged};
use crate::cube_sum::{BLOCK, cube_grid, cube_sum};
use crate::launch::empty_like;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{DType, TensorMetadata};
use burn::tensor::{FloatDType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

/// Elements per unit: a cube covers `BLOCK · PER_UNIT` elements, so the per-cube counts are
/// few (n / 1024) and the second pass is cheap.
const PER_UNIT: usize = 4;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adam_kernel<F: Float, G: Float>(
    param: &Tensor<F>,
    exp_avg: &Tensor<F>,
    exp_avg_sq: &Tensor<F>,
    grad: &Tensor<G>,
    param_out: &mut Tensor<F>,
    exp_avg_out: &mut Tensor<F>,
    exp_avg_sq_out: &mut Tensor<F>,
    non_finite: &mut Tensor<F>,
    k: &Tensor<F>,
    #[comptime] l2: bool,
    #[define(F, G)] _dtypes: [ElemType; 2],
) {
    let cube = CUBE_POS;
    // Cubes past the end (the last row of a 2-D grid) skip the work but still reach the
    // barriers of `cube_sum`: a return before them would make the barriers non-uniform.
    let live = cube < non_finite.len();
    let n = select(live, param.len(), 0);
    let base = cube * BLOCK * PER_UNIT + UNIT_POS as usize;
    let mut bad = 0.0f32;
    for j in 0..PER_UNIT {
        let i = base + j * BLOCK;
        if i < n {
            // Same operations in the same order as the reference (burn-optim's order).
            let unscaled = F::cast_from(grad[i]) * k[0] * k[1];
            // An all-ones exponent is inf or NaN; bits do not depend on NaN comparisons.
            let bits = u32::reinterpret(f32::cast_from(unscaled));
            if bits & 0x7f80_0000 == 0x7f80_0000 {
                bad += 1.0;
            }
            let mut g = unscaled;
            if l2 {
                g = param[i] * k[2] + g;
            }
            let m = exp_avg[i] * k[3] + g * k[5];
            let v = exp_avg_sq[i] * k[4] + g * g * k[6];
            let update = if l2 {
                (m * k[12]) / (F::sqrt(v) + k[13])
            } else {
                (m / k[7]) / (F::sqrt(v / k[8]) + k[9])
            };
            param_out[i] = param[i] * k[11] - update * k[10];
            exp_avg_out[i] = m;
            exp_avg_sq_out[i] = v;
        }
    }
    let total = cube_sum(bad, BLOCK);
    if UNIT_POS == 0 && live {
        non_finite[cube] = F::cast_from(total);
    }
}

impl FusedAdamOps for CubeBackend {
    fn fused_adam(
        param: FloatTensor<Self>,
        exp_avg: FloatTensor<Self>,
        exp_avg_sq: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        hyper: AdamHyper,
        offset: usize,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let state = [param, exp_avg, exp_avg_sq];
        ranged::<Self>(state, grad, offset, |p, m, v, g| whole(p, m, v, g, hyper))
    }
}

/// The kernel over whole buffers.
fn whole(
    param: FloatTensor<CubeBackend>,
    exp_avg: FloatTensor<CubeBackend>,
    exp_avg_sq: FloatTensor<CubeBackend>,
    grad: FloatTensor<CubeBackend>,
    hyper: AdamHyper,
) -> (
    FloatTensor<CubeBackend>,
    FloatTensor<CubeBackend>,
    FloatTensor<CubeBackend>,
    FloatTensor<CubeBackend>,
) {
    let n = param.shape().num_elements();
    if n == 0 {
        let zero = CubeBackend::float_zeros(Shape::from([1]), &param.device, FloatDType::F32);
        return (param, exp_avg, exp_avg_sq, zero);
    }
    let [param, exp_avg, exp_avg_sq, grad] =
        [param, exp_avg, exp_avg_sq, grad].map(into_contiguous);
    let s = hyper.scalars();
    // Scalars travel as a small tensor: one upload instead of twelve launch arguments.
    let k = [
        s.inv_scale,
        s.clip,
        s.l2.unwrap_or(0.0),
        s.beta1,
        s.beta2,
        s.one_minus_beta1,
        s.one_minus_beta2,
        s.correction1,
        s.correction2,
        s.eps,
        s.lr,
        s.keep,
        s.adam_factor,
        s.adam_eps,
    ];
    let k = CubeBackend::float_from_data(
        burn::tensor::TensorData::new(k.to_vec(), [k.len()]),
        &param.device,
    );
    let cubes = n.div_ceil(BLOCK * PER_UNIT);
    let empty = |shape: Shape| empty_like(&param, shape, DType::F32);
    let outs = [(); 3].map(|_| empty(param.shape()));
    let flags = empty(Shape::from([cubes]));
    let dtypes = [
        dtype_to_storage_type(DType::F32),
        dtype_to_storage_type(grad.dtype),
    ];
    let client = param.client.clone();
    adam_kernel::launch(
        &client,
        cube_grid(cubes),
        CubeDim::new_1d(BLOCK as u32),
        param.into_tensor_arg(),
        exp_avg.into_tensor_arg(),
        exp_avg_sq.into_tensor_arg(),
        grad.into_tensor_arg(),
        outs[0].clone().into_tensor_arg(),
        outs[1].clone().into_tensor_arg(),
        outs[2].clone().into_tensor_arg(),
        flags.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        s.l2.is_some(),
        dtypes,
    );
    let [p, m, v] = outs;
    let found = CubeBackend::float_reshape(CubeBackend::float_sum(flags), Shape::from([1]));
    (p, m, v, found)
}
