//! Element-wise reductions over the contributions of every rank.
//!
//! Each output element is folded over the inputs in group order, in a wider accumulator
//! (f32 for f16/bf16, i64 for i32) and rounded once, so every rank sees bit-identical
//! results whatever the group size.

use super::buffer::Buffer;
use half::{bf16, f16};
use std::ops::Range;

/// Reduction applied by [`all_reduce`](super::Communicator::all_reduce) and
/// [`reduce_scatter`](super::Communicator::reduce_scatter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Mean over ranks (integer division for integer types, as NCCL's `ncclAvg`).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceOp {
    /// Every reduction, in a fixed order.
    pub const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

trait Reducible: Copy {
    type Acc: Copy;
    fn widen(self) -> Self::Acc;
    fn narrow(acc: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_reducible {
    ($t:ty, $widen:expr, $narrow:expr) => {
        impl Reducible for $t {
            type Acc = f32;
            fn widen(self) -> f32 {
                $widen(self)
            }
            fn narrow(acc: f32) -> Self {
                $narrow(acc)
            }
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            // NaN wins, as a gradient overflow check relies on max-reduce seeing it.
            fn max(a: f32, b: f32) -> f32 {
                if a.is_nan() || b.is_nan() {
                    f32::NAN
                } else {
                    a.max(b)
                }
            }
            fn min(a: f32, b: f32) -> f32 {
                if a.is_nan() || b.is_nan() {
                    f32::NAN
                } else {
                    a.min(b)
                }
            }
            fn div(a: f32, n: usize) -> f32 {
                a / n as f32
            }
        }
    };
}
float_reducible!(f32, |x| x, |x| x);
float_reducible!(f16, f16::to_f32, f16::from_f32);
float_reducible!(bf16, bf16::to_f32, bf16::from_f32);

macro_rules! int_reducible {
    ($t:ty) => {
        impl Reducible for $t {
            type Acc = i64;
            fn widen(self) -> i64 {
                self as i64
            }
            fn narrow(acc: i64) -> Self {
                acc as $t
            }
            fn add(a: i64, b: i64) -> i64 {
                a.wrapping_add(b)
            }
            fn max(a: i64, b: i64) -> i64 {
                a.max(b)
            }
            fn min(a: i64, b: i64) -> i64 {
                a.min(b)
            }
            fn div(a: i64, n: usize) -> i64 {
                a / n as i64
            }
        }
    };
}
int_reducible!(i32);
int_reducible!(i64);

fn reduce_slices<T: Reducible>(inputs: &[&[T]], range: Range<usize>, op: ReduceOp) -> Vec<T> {
    // One pass per input over contiguous slices, the op chosen outside the loop, so the
    // inner loop vectorises.
    fn fold<T: Reducible>(
        inputs: &[&[T]],
        range: Range<usize>,
        f: impl Fn(T::Acc, T::Acc) -> T::Acc,
    ) -> Vec<T::Acc> {
        let mut acc: Vec<T::Acc> = inputs[0][range.clone()].iter().map(|x| x.widen()).collect();
        for input in &inputs[1..] {
            for (a, x) in acc.iter_mut().zip(&input[range.clone()]) {
                *a = f(*a, x.widen());
            }
        }
        acc
    }
    let n = inputs.len();
    let acc = match op {
        ReduceOp::Sum | ReduceOp::Avg => fold(inputs, range, T::add),
        ReduceOp::Max => fold(inputs, range, T::max),
        ReduceOp::Min => fold(inputs, range, T::min),
    };
    if op == ReduceOp::Avg {
        acc.into_iter().map(|a| T::narrow(T::div(a, n))).collect()
    } else {
        acc.into_iter().map(T::narrow).collect()
    }
}

/// Reduces elements `range` of every input (all of one dtype and length, checked by the
/// caller) into a new buffer.
pub(crate) fn reduce_range(inputs: &[&Buffer], range: Range<usize>, op: ReduceOp) -> Buffer {
    macro_rules! go {
        ($variant:ident) => {{
            let slices: Vec<_> = inputs
                .iter()
                .map(|b| match b {
                    Buffer::$variant(v) => v.as_slice(),
                    _ => unreachable!("dtype checked before reducing"),
                })
                .collect();
            Buffer::$variant(reduce_slices(&slices, range, op))
        }};
    }
    match inputs[0] {
        Buffer::F32(_) => go!(F32),
        Buffer::F16(_) => go!(F16),
        Buffer::BF16(_) => go!(BF16),
        Buffer::I32(_) => go!(I32),
        Buffer::I64(_) => go!(I64),
    }
}

/// Reduces the `parts` equal, consecutive pieces of `buf` into one piece, folding them in
/// order (what a byte-moving backend receives from the members of a group, in group order).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn reduce_pieces(buf: &Buffer, parts: usize, op: ReduceOp) -> Buffer {
    let m = buf.len() / parts;
    macro_rules! go {
        ($variant:ident, $v:expr) => {{
            let slices: Vec<_> = (0..parts).map(|i| &$v[i * m..(i + 1) * m]).collect();
            Buffer::$variant(reduce_slices(&slices, 0..m, op))
        }};
    }
    match buf {
        Buffer::F32(v) => go!(F32, v),
        Buffer::F16(v) => go!(F16, v),
        Buffer::BF16(v) => go!(BF16, v),
        Buffer::I32(v) => go!(I32, v),
        Buffer::I64(v) => go!(I64, v),
    }
}

/// The element range of chunk `index` when `len` elements are split into `parts` chunks
/// whose sizes differ by at most one (the first `len % parts` chunks are one longer).
pub(crate) fn chunk_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    start..start + size
}

/// Whether any element is infinite or NaN (integers never are).
pub fn has_non_finite(buf: &Buffer) -> bool {
    match buf {
        Buffer::F32(v) => v.iter().any(|x| !x.is_finite()),
        Buffer::F16(v) => v.iter().any(|x| !x.is_finite()),
        Buffer::BF16(v) => v.iter().any(|x| !x.is_finite()),
        Buffer::I32(_) | Buffer::I64(_) => false,
    }
}
