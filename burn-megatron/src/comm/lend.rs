//! Buffers lent to the other ranks of a threaded group for the length of one collective:
//! each member reads (and, for an all-reduce, writes) the others' memory where it lies,
//! so a reduction moves every element once instead of through intermediate copies.
//!
//! The protocol that makes the raw accesses sound: a member lends a buffer it owns and
//! does not touch (other than through this module) until every member has reported being
//! done with it; the members of one call access disjoint element ranges wherever one of
//! them writes. A member whose wait fails after lending cannot know that the others are
//! done, so it leaks the buffer instead of freeing memory a peer may still access.

use super::buffer::{Buffer, CommDType, with_vec};
use super::reduce::{ReduceOp, fold_blocks, fold_into, fold_into_first};
use half::{bf16, f16};
use std::ops::Range;

/// One member's buffer as the others see it during a call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lent {
    ptr: *mut u8,
    len: usize,
    dtype: CommDType,
}

// SAFETY: a `Lent` is only dereferenced under the protocol above: the owner keeps the
// memory alive and untouched while any member may access it, and writers own disjoint
// ranges.
unsafe impl Send for Lent {}
unsafe impl Sync for Lent {}

impl Lent {
    /// `buf`, lent for the call.
    pub(crate) fn of(buf: &mut Buffer) -> Self {
        let dtype = buf.dtype();
        with_vec!(buf, v => Self { ptr: v.as_mut_ptr().cast(), len: v.len(), dtype })
    }

    /// `len` of the lent buffer's bytes from `offset` on.
    ///
    /// # Safety
    /// The owner keeps the buffer alive, the range is within its bytes, and no thread
    /// writes it while the slice lives.
    pub(crate) unsafe fn bytes<'a>(&self, offset: usize, len: usize) -> &'a [u8] {
        debug_assert!(offset + len <= self.len * self.dtype.size());
        // SAFETY: in bounds and unwritten per the caller.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }

    /// Copies `src` into the lent buffer's bytes from `offset` on, past the cache when
    /// `stream` (see [`copy`]).
    ///
    /// # Safety
    /// The owner keeps the buffer alive, `offset + src.len()` is within its bytes, and no
    /// other thread accesses those bytes meanwhile.
    pub(crate) unsafe fn write_bytes(&self, offset: usize, src: &[u8], stream: bool) {
        debug_assert!(offset + src.len() <= self.len * self.dtype.size());
        // SAFETY: in bounds and exclusive per the caller; `src` is another allocation.
        unsafe { copy(src, self.ptr.add(offset), stream) }
    }
}

/// From this many bytes moved per member, a collective writes what no cache will hold by
/// the time it is read with stores that bypass the cache: they skip reading each line
/// before overwriting it, a third of a copy's memory traffic.
pub(crate) const STREAM_FROM: usize = 8 << 20;

/// Copies `src` to `dst`; with `stream`, by non-temporal stores (x86-64; elsewhere, and
/// under Miri, a plain copy), which [`fence`] must follow before the caller signals its peers.
///
/// # Safety
/// `dst` is valid for `src.len()` bytes and does not overlap `src`.
pub(crate) unsafe fn copy(src: &[u8], dst: *mut u8, stream: bool) {
    // Miri has no non-temporal stores; a plain copy is the same bytes.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if stream {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let n = src.len();
        let head = dst.align_offset(16).min(n);
        let body = (n - head) / 16;
        // SAFETY: in bounds per the caller; the streamed stores are 16-byte aligned.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
            for i in 0..body {
                let at = head + 16 * i;
                let v = _mm_loadu_si128(src.as_ptr().add(at).cast::<__m128i>());
                _mm_stream_si128(dst.add(at).cast::<__m128i>(), v);
            }
            let done = head + 16 * body;
            std::ptr::copy_nonoverlapping(src.as_ptr().add(done), dst.add(done), n - done);
        }
        return;
    }
    let _ = stream;
    // SAFETY: per the caller.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

/// Orders the non-temporal stores of [`copy`] before the stores that follow (the lock
/// that tells the peers this member is done), which x86 does not do by itself.
pub(crate) fn fence() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: SSE2 is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// Folds elements `range` of every lent buffer (one dtype, at least `range.end` elements
/// each), in group order per element, and writes the result into that range of each.
///
/// # Safety
/// Every buffer is alive for the call, and no other thread accesses elements `range` of
/// any of them meanwhile.
pub(crate) unsafe fn reduce_in_place(bufs: &[Lent], range: Range<usize>, op: ReduceOp) {
    macro_rules! go {
        ($t:ty) => {{
            let ptrs: Vec<*mut $t> = bufs.iter().map(|b| b.ptr.cast::<$t>()).collect();
            let reads: Vec<*const $t> = ptrs.iter().map(|p| p.cast_const()).collect();
            // SAFETY: forwarded from the caller; members lend distinct buffers.
            let folded = unsafe {
                fold_into_first(
                    ptrs[0],
                    &reads[1..],
                    range.clone(),
                    op,
                    |start, block: &[$t]| {
                        for p in &ptrs[1..] {
                            // SAFETY: this range of every buffer is this thread's alone.
                            let out = std::slice::from_raw_parts_mut(p.add(start), block.len());
                            out.copy_from_slice(block);
                        }
                    },
                )
            };
            if folded {
                return;
            }
            // SAFETY: forwarded from the caller.
            unsafe {
                fold_blocks(&reads, range, op, |start, block: &[$t]| {
                    for p in &ptrs {
                        // SAFETY: this range of every buffer is this thread's alone, and
                        // the block was read before it is written.
                        let out = std::slice::from_raw_parts_mut(p.add(start), block.len());
                        out.copy_from_slice(block);
                    }
                })
            }
        }};
    }
    match bufs.first().map(|b| b.dtype) {
        None => {}
        Some(CommDType::F32) => go!(f32),
        Some(CommDType::F16) => go!(f16),
        Some(CommDType::BF16) => go!(bf16),
        Some(CommDType::I32) => go!(i32),
        Some(CommDType::I64) => go!(i64),
    }
}

/// Folds elements `range` of every lent buffer, in group order per element, into `out`
/// (resized to the range, its allocation kept when it has the dtype), past the cache when
/// `stream`.
///
/// # Safety
/// Every buffer is alive for the call, and nobody writes elements `range` of any of them
/// meanwhile.
pub(crate) unsafe fn reduce_into(
    bufs: &[Lent],
    range: Range<usize>,
    op: ReduceOp,
    out: &mut Buffer,
    stream: bool,
) {
    let Some(dtype) = bufs.first().map(|b| b.dtype) else {
        return;
    };
    if out.dtype() != dtype {
        *out = Buffer::with_capacity(dtype, 0);
    }
    macro_rules! go {
        ($variant:ident, $t:ty, $zero:expr) => {{
            let Buffer::$variant(o) = out else {
                unreachable!("out was given the inputs' dtype")
            };
            o.resize(range.len(), $zero);
            let base = range.start;
            let ptrs: Vec<*const $t> = bufs
                .iter()
                .map(|b| b.ptr.cast_const().cast::<$t>())
                .collect();
            // SAFETY: forwarded from the caller; the writes go to `out`, which is ours.
            unsafe {
                if !stream {
                    fold_into(&ptrs, range, op, o);
                    return;
                }
                fold_blocks(&ptrs, range, op, |start, block: &[$t]| {
                    let o = &mut o[start - base..start - base + block.len()];
                    let bytes: &[u8] = bytemuck::cast_slice(block);
                    // SAFETY: `o` is ours and as long as `block`.
                    copy(bytes, o.as_mut_ptr().cast(), stream);
                })
            }
            fence();
        }};
    }
    match dtype {
        CommDType::F32 => go!(F32, f32, 0.0),
        CommDType::F16 => go!(F16, f16, f16::ZERO),
        CommDType::BF16 => go!(BF16, bf16, bf16::ZERO),
        CommDType::I32 => go!(I32, i32, 0),
        CommDType::I64 => go!(I64, i64, 0),
    }
}
