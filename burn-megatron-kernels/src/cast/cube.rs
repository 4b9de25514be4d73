//! The rounding kernel: round-to-nearest-even on the f32 bits in u32 arithmetic (WGSL has
//! no bf16, and the hardware's own conversion is not trusted to round ties to even).

use super::MasterCastOps;
use crate::launch::{elementwise_geometry, empty_like};
use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, FloatDType};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;

/// The bf16 bits (low 16) nearest to the f32 with `bits`, ties to even; NaN stays NaN,
/// quiet, with its top payload bits.
#[cube]
pub(crate) fn bf16_bits(bits: u32) -> u32 {
    if (bits & 0x7fff_ffff) > 0x7f80_0000 {
        (bits >> 16) | 0x40
    } else {
        // Adding just under half an ulp, plus one when the kept part is odd, carries into
        // the kept part exactly when rounding up; a carry out of the largest finite value
        // lands on the exponent of inf.
        (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
    }
}

/// The f16 bits (low 16) nearest to the f32 with `bits`, ties to even.
#[cube]
pub(crate) fn f16_bits(bits: u32) -> u32 {
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7fff_ffff;
    let mut h = 0u32; // below 2⁻²⁵ everything rounds to (signed) zero
    if abs > 0x7f80_0000 {
        h = 0x7e00 | ((abs >> 13) & 0x3ff);
    } else if abs >= 0x477f_f000 {
        // From 65520, the tie between 65504 and 65536, everything rounds to inf.
        h = 0x7c00;
    } else if abs >= 0x3880_0000 {
        // Normal in f16: round the mantissa as bf16 does, then rebias the exponent by
        // (127 − 15) << 10.
        h = ((abs + 0xfff + ((abs >> 13) & 1)) >> 13) - 0x1c000;
    } else if abs >= 0x3300_0000 {
        // Subnormal in f16: the mantissa with its implicit bit, in units of 2⁻²⁴, shifted
        // right by 14..=24 with the dropped bits deciding the rounding.
        let shift = 126 - (abs >> 23);
        let mantissa = (abs & 0x7f_ffff) | 0x80_0000;
        let kept = mantissa >> shift;
        let dropped = mantissa & ((1u32 << shift) - 1);
        let half = 1u32 << (shift - 1);
        h = kept;
        if dropped > half || (dropped == half && (kept & 1) == 1) {
            h = kept + 1;
        }
    }
    sign | h
}

/// The f32 bits of the f16 with bits `h` (exact).
#[cube]
fn f16_to_f32_bits(h: u32) -> u32 {
    let exponent = (h >> 10) & 0x1f;
    let mantissa = h & 0x3ff;
    let w = if exponent == 0x1f {
        0x7f80_0000 | (mantissa << 13)
    } else if exponent == 0 {
        // mantissa · 2⁻²⁴ is a normal f32 (or zero): the product is exact.
        u32::reinterpret(f32::cast_from(mantissa) * 5.960_464_5e-8f32)
    } else {
        ((exponent + 112) << 23) | (mantissa << 13)
    };
    ((h & 0x8000) << 16) | w
}

#[cube(launch)]
fn master_cast_kernel<O: Float>(
    master: &Tensor<f32>,
    out: &mut Tensor<O>,
    #[comptime] bf16: bool,
    #[define(O)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let bits = u32::reinterpret(master[i]);
    let widened = if bf16 {
        bf16_bits(bits) << 16
    } else {
        f16_to_f32_bits(f16_bits(bits))
    };
    // Exactly representable in O (or O is f32): the conversion does not round.
    out[i] = O::cast_from(f32::reinterpret(widened));
}

impl MasterCastOps for CubeBackend {
    fn master_cast(
        master: FloatTensor<Self>,
        dtype: FloatDType,
        widened: bool,
    ) -> FloatTensor<Self> {
        let master = into_contiguous(master);
        let out_dtype = if widened { DType::F32 } else { dtype.into() };
        let out = empty_like(&master, master.shape(), out_dtype);
        let Some((cube_dim, count)) = elementwise_geometry(&master, out.shape().num_elements())
        else {
            return out;
        };
        master_cast_kernel::launch(
            &master.client.clone(),
            count,
            cube_dim,
            master.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dtype == FloatDType::BF16,
            dtype_to_storage_type(out_dtype),
        );
        out
    }
}
