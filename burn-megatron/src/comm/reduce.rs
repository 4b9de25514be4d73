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

pub(crate) trait Reducible: Copy + 'static {
    type Acc: Copy + 'static;
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

/// Output elements folded per block: the block's accumulators stay in L1 while every
/// input's block is folded into them, so each input is read once and the output written
/// once, without temporaries.
const BLOCK: usize = 1024;

/// Folds elements `range` of every input into `out` (`range.len()` elements), in group
/// order per element.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn reduce_into<T: Reducible + Default>(
    inputs: &[&[T]],
    range: Range<usize>,
    op: ReduceOp,
    out: &mut [T],
) where
    T::Acc: Default,
{
    // Indexing checks the range against every input before any raw read.
    let ptrs: Vec<*const T> = inputs.iter().map(|x| x[range.clone()].as_ptr()).collect();
    // SAFETY: each pointer starts `range.len()` readable elements of a slice borrowed for
    // the call; the writes go to `out`, another borrow.
    unsafe { fold_into(&ptrs, 0..range.len(), op, out) }
}

/// Folds elements `range` of `ptrs` into `out` (`range.len()` elements), in group order per
/// element. Where the accumulator is the element type and no finishing division follows,
/// the inputs are folded straight into `out`, a block of it at a time in L1: the result is
/// the same, without a pass through an accumulator block (in cache, nearly twice as fast).
///
/// # Safety
/// As [`fold_blocks`]; `out` overlaps none of the inputs.
pub(crate) unsafe fn fold_into<T: Reducible + Default>(
    ptrs: &[*const T],
    range: Range<usize>,
    op: ReduceOp,
    out: &mut [T],
) where
    T::Acc: Default,
{
    #[inline(always)]
    unsafe fn direct<T: Reducible>(
        ptrs: &[*const T],
        range: Range<usize>,
        f: impl Fn(T::Acc, T::Acc) -> T::Acc,
        out: &mut [T],
    ) {
        for (b, o) in out.chunks_mut(BLOCK).enumerate() {
            let (start, len) = (range.start + b * BLOCK, o.len());
            // SAFETY: readable per the caller.
            let x = |i: usize| unsafe { std::slice::from_raw_parts(ptrs[i].add(start), len) };
            match ptrs.len() {
                0 => {}
                1 => o.copy_from_slice(x(0)),
                _ => {
                    for ((o, a), b) in o.iter_mut().zip(x(0)).zip(x(1)) {
                        *o = T::narrow(f(a.widen(), b.widen()));
                    }
                    // SAFETY: forwarded.
                    unsafe { fold_onto(o, &ptrs[2..], start, &f) };
                }
            }
        }
    }
    let base = range.start;
    let exact = acc_is_elem::<T>();
    // SAFETY: forwarded; `direct` only where widening and narrowing are the identity, so
    // that folding in `T` rounds nothing the accumulator would not.
    unsafe {
        match op {
            ReduceOp::Sum if exact => direct(ptrs, range, T::add, out),
            ReduceOp::Max if exact => direct(ptrs, range, T::max, out),
            ReduceOp::Min if exact => direct(ptrs, range, T::min, out),
            _ => fold_blocks(ptrs, range, op, |start, block| {
                out[start - base..start - base + block.len()].copy_from_slice(block);
            }),
        }
    }
}

/// Folds elements `range` of `rest` into those of `first`, in place, in order, a block at
/// a time in L1, handing each folded block to `then(start, block)` (which copies it to the
/// others); for the ops where [`fold_into`] folds directly. Returns false, doing nothing,
/// for the others.
///
/// # Safety
/// Elements `range` of every pointer are valid and accessed by no other thread meanwhile;
/// `first` is none of `rest`; `then` writes only buffers other than `first`.
pub(crate) unsafe fn fold_into_first<T: Reducible>(
    first: *mut T,
    rest: &[*const T],
    range: Range<usize>,
    op: ReduceOp,
    mut then: impl FnMut(usize, &[T]),
) -> bool {
    #[inline(always)]
    unsafe fn go<T: Reducible>(
        first: *mut T,
        rest: &[*const T],
        range: Range<usize>,
        f: impl Fn(T::Acc, T::Acc) -> T::Acc,
        then: &mut impl FnMut(usize, &[T]),
    ) {
        let mut start = range.start;
        while start < range.end {
            let len = BLOCK.min(range.end - start);
            // SAFETY: valid and exclusive per the caller, and `first` is none of `rest`.
            let o = unsafe { std::slice::from_raw_parts_mut(first.add(start), len) };
            // SAFETY: as above.
            unsafe { fold_onto(o, rest, start, &f) };
            then(start, o);
            start += len;
        }
    }
    if !acc_is_elem::<T>() {
        return false;
    }
    // SAFETY: forwarded; folding in `T` is exact, as for `fold_into`.
    unsafe {
        match op {
            ReduceOp::Sum => go(first, rest, range, T::add, &mut then),
            ReduceOp::Max => go(first, rest, range, T::max, &mut then),
            ReduceOp::Min => go(first, rest, range, T::min, &mut then),
            ReduceOp::Avg => return false,
        }
    }
    true
}

/// Whether the accumulator is the element type itself (f32, i64): widening and narrowing
/// are then the identity, and folding in `T` rounds nothing the accumulator would not.
fn acc_is_elem<T: Reducible>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<T::Acc>()
}

/// Folds the `o.len()` elements from `start` of each of `ptrs`, in order, onto `o`, in `T`
/// (callers check [`acc_is_elem`]).
///
/// # Safety
/// Those elements are readable and none of them lies in `o`.
#[inline(always)]
unsafe fn fold_onto<T: Reducible>(
    o: &mut [T],
    ptrs: &[*const T],
    start: usize,
    f: &impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    for p in ptrs {
        // SAFETY: per the caller.
        let x = unsafe { std::slice::from_raw_parts(p.add(start), o.len()) };
        for (o, a) in o.iter_mut().zip(x) {
            *o = T::narrow(f(o.widen(), a.widen()));
        }
    }
}

/// Folds elements `range` of `ptrs` block by block, in group order per element, handing
/// each folded block to `write(start, block)`. The op is chosen outside the loops, so they
/// vectorise.
///
/// # Safety
/// Elements `range` of every pointer are readable for the call, and nothing writes them
/// except `write`, after their block is read.
pub(crate) unsafe fn fold_blocks<T: Reducible + Default>(
    ptrs: &[*const T],
    range: Range<usize>,
    op: ReduceOp,
    mut write: impl FnMut(usize, &[T]),
) where
    T::Acc: Default,
{
    #[inline(always)]
    unsafe fn blocks<T: Reducible + Default>(
        ptrs: &[*const T],
        range: Range<usize>,
        f: impl Fn(T::Acc, T::Acc) -> T::Acc,
        finish: Option<impl Fn(T::Acc) -> T>,
        write: &mut impl FnMut(usize, &[T]),
    ) where
        T::Acc: Default,
    {
        let mut acc = [T::Acc::default(); BLOCK];
        let mut out = [T::default(); BLOCK];
        let mut start = range.start;
        while start < range.end {
            let len = BLOCK.min(range.end - start);
            let acc = &mut acc[..len];
            // SAFETY: readable per the caller.
            let x = |i: usize| unsafe { std::slice::from_raw_parts(ptrs[i].add(start), len) };
            // The first two inputs are folded in one pass: at the sizes that stay in cache,
            // the passes over the block are what a reduction costs.
            match ptrs.len() {
                1 => acc.iter_mut().zip(x(0)).for_each(|(a, x)| *a = x.widen()),
                _ => {
                    for ((a, x0), x1) in acc.iter_mut().zip(x(0)).zip(x(1)) {
                        *a = f(x0.widen(), x1.widen());
                    }
                }
            }
            for i in 2..ptrs.len() {
                for (a, x) in acc.iter_mut().zip(x(i)) {
                    *a = f(*a, x.widen());
                }
            }
            match &finish {
                Some(finish) => {
                    for (o, &a) in out.iter_mut().zip(acc.iter()) {
                        *o = finish(a);
                    }
                    write(start, &out[..len]);
                }
                // SAFETY: no finish is asked only where the accumulator is `T` itself
                // (checked by the caller), so the block is already the result.
                None => write(start, unsafe {
                    std::slice::from_raw_parts(acc.as_ptr().cast::<T>(), len)
                }),
            }
            start += len;
        }
    }
    let n = ptrs.len();
    // Where the accumulator is the element type, narrowing is the identity and the folded
    // block is handed on as it is, saving a pass.
    let narrow = (!acc_is_elem::<T>()).then_some(T::narrow);
    // SAFETY: forwarded; `None` only where `T::Acc` is `T`.
    unsafe {
        match op {
            ReduceOp::Sum => blocks(ptrs, range, T::add, narrow, &mut write),
            ReduceOp::Avg => blocks(
                ptrs,
                range,
                T::add,
                Some(|a| T::narrow(T::div(a, n))),
                &mut write,
            ),
            ReduceOp::Max => blocks(ptrs, range, T::max, narrow, &mut write),
            ReduceOp::Min => blocks(ptrs, range, T::min, narrow, &mut write),
        }
    }
}

/// Reduces the `parts` equal, consecutive pieces of `buf` into one piece, folding them in
/// order (what a byte-moving backend receives from the members of a group, in group order).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn reduce_pieces(buf: &Buffer, parts: usize, op: ReduceOp) -> Buffer {
    let m = buf.len() / parts;
    macro_rules! go {
        ($variant:ident, $v:expr, $zero:expr) => {{
            let slices: Vec<_> = (0..parts).map(|i| &$v[i * m..(i + 1) * m]).collect();
            let mut out = vec![$zero; m];
            reduce_into(&slices, 0..m, op, &mut out);
            Buffer::$variant(out)
        }};
    }
    match buf {
        Buffer::F32(v) => go!(F32, v, 0.0),
        Buffer::F16(v) => go!(F16, v, f16::ZERO),
        Buffer::BF16(v) => go!(BF16, v, bf16::ZERO),
        Buffer::I32(v) => go!(I32, v, 0),
        Buffer::I64(v) => go!(I64, v, 0),
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
