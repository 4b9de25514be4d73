//! Flex's f32 product into a buffer that becomes the output tensor as it is.

use crate::cpu::f32_tensor;
use burn::backend::flex::FlexTensor;
use burn::tensor::DType;

/// Products of at least this many multiply-adds run on every thread (Flex's own threshold).
const PARALLEL_MACS: usize = 192 * 192 * 192;

/// `[rows, cols]` and `(row stride, column stride)` of a 2-d tensor whose strides are
/// positive (what the gemm is given here), else `None`.
fn matrix(t: &FlexTensor) -> Option<([usize; 2], [isize; 2])> {
    let (shape, strides) = (t.layout().shape(), t.layout().strides());
    if shape.num_dims() != 2 || strides.iter().any(|&s| s <= 0) {
        return None;
    }
    Some(([shape[0], shape[1]], [strides[0], strides[1]]))
}

/// `a·b` for f32 `a` `[m, k]` and `b` `[k, n]` with positive strides; `None` for anything
/// else (other dtypes, ranks or layouts), which the caller hands to Flex's matmul.
pub(super) fn matmul_f32(a: &FlexTensor, b: &FlexTensor) -> Option<FlexTensor> {
    if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return None;
    }
    let (([m, k], [a_rs, a_cs]), ([kb, n], [b_rs, b_cs])) = (matrix(a)?, matrix(b)?);
    if k != kb || m == 0 || n == 0 || k == 0 {
        return None;
    }
    let (a_all, b_all) = (a.storage::<f32>(), b.storage::<f32>());
    // The last element each view reads lies inside its storage (the gemm reads by pointer).
    let end = |start: usize, [r, c]: [usize; 2], [rs, cs]: [isize; 2]| {
        start + (r - 1) * rs as usize + (c - 1) * cs as usize
    };
    let (a_start, b_start) = (a.layout().start_offset(), b.layout().start_offset());
    if end(a_start, [m, k], [a_rs, a_cs]) >= a_all.len()
        || end(b_start, [k, n], [b_rs, b_cs]) >= b_all.len()
    {
        return None;
    }
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MACS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let mut out = Vec::<f32>::with_capacity(m * n);
    // SAFETY: both views lie inside their storage (checked above) and `out` has room for
    // the `[m, n]` row-major result. With `read_dst` false the gemm only writes `out`, every
    // one of its `m·n` elements (k > 0), before `set_len` exposes them.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a_all.as_ptr().add(a_start),
            a_cs,
            a_rs,
            b_all.as_ptr().add(b_start),
            b_cs,
            b_rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
        out.set_len(m * n);
    }
    Some(f32_tensor(out, &[m, n]))
}
