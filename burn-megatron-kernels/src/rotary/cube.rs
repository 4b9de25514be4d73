//! The rotary embedding CubeCL kernel, forward and backward, one unit per output element,
//! for Burn's Cube backend (wgpu here; the same source serves CUDA). Arithmetic in f32
//! whatever the dtype, the tables rounded to the activations' dtype first (as Flex's loops).

use super::RotaryOps;
use crate::launch::elementwise_launch;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// A table value rounded to the activations' dtype `F`, as f32.
#[cube]
fn widen<F: Float, T: Float>(v: T) -> f32 {
    f32::cast_from(F::cast_from(v))
}

/// `out` (`[s, b, heads, hn]`) from `x` and the tables (`[s, b or 1, 1, rot]`): channel
/// `c < rot` pairs with `c ± rot/2`; forward `x·cos[c] ∓ x_partner·sin[c]` (− in the first
/// half), backward (the transpose) `d·cos[c] ± d_partner·sin[partner]` (+ in the first
/// half); channels from `rot` on are copied.
#[cube(launch)]
fn rotary_kernel<F: Float, T: Float>(
    x: &Tensor<F>,
    cos: &Tensor<T>,
    sin: &Tensor<T>,
    out: &mut Tensor<F>,
    #[comptime] backward: bool,
    #[define(F, T)] _dtypes: [ElemType; 2],
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let hn = out.shape(3);
    let rot = cos.shape(3);
    let c = pos % hn;
    if c < rot {
        let sample_row = pos / hn / out.shape(2);
        let b = out.shape(1);
        let table_batch = cos.shape(1);
        let (position, sample) = (sample_row / b, sample_row % b);
        let t = (position * table_batch + select(table_batch == 1, 0, sample)) * rot;
        let half = rot / 2;
        let first = c < half;
        // The partner channel: c + half in the first half, c − half in the second.
        let partner_c = c + half - select(first, 0, rot);
        let partner = pos - c + partner_c;
        let mut sin_c = c;
        let mut subtract = first;
        if backward {
            sin_c = partner_c;
            subtract = !first;
        }
        let direct = f32::cast_from(x[pos]) * widen::<F, T>(cos[t + c]);
        let turned = f32::cast_from(x[partner]) * widen::<F, T>(sin[t + sin_c]);
        let value = select(subtract, direct - turned, direct + turned);
        out[pos] = F::cast_from(value);
    } else {
        out[pos] = x[pos];
    }
}

fn launch(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, backward: bool) -> CubeTensor {
    let (x, cos, sin) = (
        into_contiguous(x),
        into_contiguous(cos),
        into_contiguous(sin),
    );
    let (out, Some((cube_dim, count))) = elementwise_launch(&x) else {
        return x; // empty: nothing to compute, the input has the output's shape
    };
    let client = x.client.clone();
    let dtypes = [
        dtype_to_storage_type(x.dtype),
        dtype_to_storage_type(cos.dtype),
    ];
    rotary_kernel::launch(
        &client,
        count,
        cube_dim,
        x.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        backward,
        dtypes,
    );
    out
}

impl RotaryOps for CubeBackend {
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        launch(x, cos, sin, false)
    }

    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        launch(grad, cos, sin, true)
    }
}
