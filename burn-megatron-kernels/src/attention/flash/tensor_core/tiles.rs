//! The tile operations the tensor-core kernels are built of: a 16 × 16 product on the
//! matrix instructions (or emulated by a plane's units), and shared-memory loads and fills
//! every unit of a cube takes part in.

use cubecl::cmma::{Matrix, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

/// Element `(r, c)` of a 16-row tile at `x0` of `x` (row-major with stride `sx`, or
/// column-major when `transposed`), as f32.
#[cube]
fn element<F: Float>(
    x: &Shared<[F]>,
    x0: usize,
    sx: u32,
    r: usize,
    c: usize,
    #[comptime] transposed: bool,
) -> f32 {
    let at = select(
        transposed,
        x0 + c * sx as usize + r,
        x0 + r * sx as usize + c,
    );
    f32::cast_from(x[at])
}

/// `dst[d0..]` (f32, row-major, stride `sd`) `= a · b` (`accumulate` false) or `+= a · b`
/// for one plane's 16 × 16 tile: `a` row-major at `a0` (stride `sa`), `b` at `b0` (stride
/// `sb`, column-major when `b_transposed`), over `depth` (a multiple of 16).
///
/// On the matrix instructions, or with `emulate` the same products by the plane's units one
/// element at a time (f32 sums): the tensor-core schedule on a device without them, so that
/// everything but the instructions themselves is checked there.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_product<F: Float>(
    dst: &mut Shared<[f32]>,
    d0: usize,
    sd: u32,
    a: &Shared<[F]>,
    a0: usize,
    sa: u32,
    b: &Shared<[F]>,
    b0: usize,
    sb: u32,
    #[comptime] depth: usize,
    #[comptime] b_transposed: bool,
    #[comptime] accumulate: bool,
    #[comptime] emulate: bool,
) {
    if emulate {
        let mut e = UNIT_POS_X as usize;
        while e < 256 {
            let (r, c) = (e / 16, e % 16);
            let mut x = 0.0f32;
            if accumulate {
                x = dst[d0 + r * sd as usize + c];
            }
            for kk in 0..depth {
                x += element::<F>(a, a0, sa, r, kk, false)
                    * element::<F>(b, b0, sb, kk, c, b_transposed);
            }
            dst[d0 + r * sd as usize + c] = x;
            e += CUBE_DIM_X as usize;
        }
    } else {
        let d_end = dst.len();
        let acc = if accumulate {
            Matrix::<f32>::from_slice(
                MatrixIdent::Accumulator,
                16usize,
                16usize,
                16usize,
                MatrixLayout::RowMajor,
                &dst[d0..d_end],
                sd,
            )
        } else {
            Matrix::<f32>::from_value(
                MatrixIdent::Accumulator,
                16usize,
                16usize,
                16usize,
                MatrixLayout::Undefined,
                0.0,
            )
        };
        let b_layout = comptime!(if b_transposed {
            MatrixLayout::ColMajor
        } else {
            MatrixLayout::RowMajor
        });
        let (a_end, b_end) = (a.len(), b.len());
        for step in 0..depth / 16 {
            let ma = Matrix::<F>::from_slice(
                MatrixIdent::A,
                16usize,
                16usize,
                16usize,
                MatrixLayout::RowMajor,
                &a[a0 + step * 16..a_end],
                sa,
            );
            // Along k, a transposed `b` steps by columns of its storage, a plain one by rows.
            let b_step = select(b_transposed, step * 16, step * 16 * sb as usize);
            let mb = Matrix::<F>::from_slice(
                MatrixIdent::B,
                16usize,
                16usize,
                16usize,
                b_layout,
                &b[b0 + b_step..b_end],
                sb,
            );
            cmma::execute(&ma, &mb, &acc, &acc);
        }
        cmma::store(&mut dst[d0..d_end], &acc, sd, MatrixLayout::RowMajor);
    }
}

/// Copies rows `first..first + rows` of the `[·, d]` matrix at `base` of `t` into `to` as
/// `F`, zeros past `end`; every unit of the cube takes part.
#[cube]
pub(super) fn load_rows<F: Float>(
    t: &Tensor<F>,
    base: usize,
    first: usize,
    end: usize,
    to: &mut Shared<[F]>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < rows * d {
        let row = first + e / d;
        let mut x = F::new(0.0);
        if row < end {
            x = t[base + row * d + e % d];
        }
        to[e] = x;
        e += CUBE_DIM as usize;
    }
}

/// Sets `to[0..n]` to `value`; every unit takes part.
#[cube]
pub(super) fn fill_shared(to: &mut Shared<[f32]>, value: f32, #[comptime] n: usize) {
    let mut e = UNIT_POS as usize;
    while e < n {
        to[e] = value;
        e += CUBE_DIM as usize;
    }
}
