//! The weight-gradient accumulation kernel: `main_grad[i, j] += Σ_t x[t, i]·dy[t, j]`, a
//! tiled shared-memory matmul over the token dimension, read-modify-write on the f32 buffer.
//!
//! Each cube owns a `BLOCK × BLOCK` tile of `main_grad`; its `UNITS × UNITS` units each keep
//! `PER_UNIT × PER_UNIT` f32 accumulators in registers (rows `ty + UNITS·a`, columns
//! `tx + UNITS·b`: strided, so neighbouring units touch neighbouring addresses). The token
//! loop stages `STEP` tokens of `x` and `dy` in shared memory (as f32) per round.

use super::GradAccumOps;
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

/// Units per side of a cube.
const UNITS: usize = 16;
/// Outputs per unit per side: 4·4 accumulators, the tile of a cube 64 × 64.
const PER_UNIT: usize = 4;
const BLOCK: usize = UNITS * PER_UNIT;
/// Tokens staged per round.
const STEP: usize = 16;

#[cube(launch)]
fn accumulate_kernel<F: Float>(
    x: &Tensor<F>,
    dy: &Tensor<F>,
    grad: &mut Tensor<f32>,
    #[define(F)] _dtype: ElemType,
) {
    let tokens = x.shape(0);
    let (fan_in, fan_out) = (x.shape(1), dy.shape(1));
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let unit = ty * UNITS + tx;
    let (i0, j0) = (CUBE_POS_Y as usize * BLOCK, CUBE_POS_X as usize * BLOCK);

    let mut xs = Shared::<[f32]>::new_slice(STEP * BLOCK);
    let mut ds = Shared::<[f32]>::new_slice(STEP * BLOCK);
    let mut acc = Array::<f32>::new(PER_UNIT * PER_UNIT);
    #[unroll]
    for r in 0..PER_UNIT * PER_UNIT {
        acc[r] = 0.0;
    }
    let mut a = Array::<f32>::new(PER_UNIT);
    let mut b = Array::<f32>::new(PER_UNIT);

    let mut t0 = 0usize;
    while t0 < tokens {
        // Stage tokens t0..t0+STEP; zeros past the edges keep the inner loop branch-free.
        #[unroll]
        for l in 0..STEP * BLOCK / (UNITS * UNITS) {
            let flat = l * UNITS * UNITS + unit;
            let (k, c) = (flat / BLOCK, flat % BLOCK);
            let t = t0 + k;
            let mut xv = 0.0f32;
            if t < tokens && i0 + c < fan_in {
                xv = f32::cast_from(x[t * fan_in + i0 + c]);
            }
            let mut dv = 0.0f32;
            if t < tokens && j0 + c < fan_out {
                dv = f32::cast_from(dy[t * fan_out + j0 + c]);
            }
            xs[flat] = xv;
            ds[flat] = dv;
        }
        sync_cube();
        #[unroll]
        for k in 0..STEP {
            #[unroll]
            for r in 0..PER_UNIT {
                a[r] = xs[k * BLOCK + ty + UNITS * r];
                b[r] = ds[k * BLOCK + tx + UNITS * r];
            }
            #[unroll]
            for r in 0..PER_UNIT {
                #[unroll]
                for c in 0..PER_UNIT {
                    acc[r * PER_UNIT + c] += a[r] * b[c];
                }
            }
        }
        sync_cube();
        t0 += STEP;
    }

    #[unroll]
    for r in 0..PER_UNIT {
        let i = i0 + ty + UNITS * r;
        #[unroll]
        for c in 0..PER_UNIT {
            let j = j0 + tx + UNITS * c;
            if i < fan_in && j < fan_out {
                grad[i * fan_out + j] += acc[r * PER_UNIT + c];
            }
        }
    }
}

impl GradAccumOps for CubeBackend {
    fn accumulate_weight_grad(
        main_grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let [fan_in, fan_out] = main_grad.shape().dims::<2>();
        let tokens = x.shape()[0];
        if fan_in * fan_out == 0 || tokens == 0 {
            return main_grad; // nothing to add (and Burn's copy kernels refuse empty tensors)
        }
        // into_contiguous returns a fresh (so mutable) buffer whenever it copies.
        let grad = into_contiguous(main_grad);
        let grad = if grad.can_mut() { grad } else { grad.copy() };
        let (x, dy) = (into_contiguous(x), into_contiguous(dy));
        let count = CubeCount::Static(
            fan_out.div_ceil(BLOCK) as u32,
            fan_in.div_ceil(BLOCK) as u32,
            1,
        );
        let dtype = dtype_to_storage_type(x.dtype);
        accumulate_kernel::launch(
            &x.client.clone(),
            count,
            CubeDim::new_2d(UNITS as u32, UNITS as u32),
            x.into_tensor_arg(),
            dy.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            dtype,
        );
        grad
    }

    fn linear_fp32_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as burn::backend::ops::FloatTensorOps<Self>>::float_matmul(x, weight)
    }
}
