//! The examples' global allocator: mimalloc, told to keep the memory it frees.
//!
//! A training step allocates and frees tensors of the same large sizes every step. glibc's
//! malloc hands every block above 32 MiB back to the kernel when it is freed (and trims
//! the heap top), so the next step faults each page in again and the kernel zeroes it
//! first; a free of 256 MiB costs about as much as copying it. mimalloc reuses freed
//! memory, and with purging off (by default it returns memory idle for a second) it never
//! gives it back, as PyTorch's caching allocator does on a GPU. `bert_bench`'s 4x256x4
//! step took 911 ms under glibc, 650–870 under mimalloc's defaults, 640–665 with purging off.
//! A library leaves this choice to the binary.
//!
//! It also counts the bytes it holds, per rank ([`memory`](crate::memory)): each block
//! carries a 16-byte header with the counter of the thread that allocated it (one a
//! training thread claimed with [`Counter::claim`](crate::memory::Counter::claim); 0 for
//! the others), so that a block freed on another thread is still taken off its owner's
//! count.

use crate::memory::{TAG, account};
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, Ordering};

/// `mi_option_purge_delay` in mimalloc 3's `mimalloc.h` (libmimalloc-sys names no constant
/// for it); its default (`options.c`: 1000 ms) is checked before it is changed, so that
/// another version's numbering changes nothing.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const DEFAULT_PURGE_DELAY: std::ffi::c_long = 1000;

/// Bytes in front of each block: its owner's tag and its size (and at least the block's
/// alignment, so that the block stays aligned).
const HEADER: usize = 16;

struct KeepingMiMalloc;

static CONFIGURED: AtomicBool = AtomicBool::new(false);

impl KeepingMiMalloc {
    #[inline]
    fn configure() {
        if !CONFIGURED.load(Ordering::Relaxed) {
            CONFIGURED.store(true, Ordering::Relaxed);
            // SAFETY: plain option calls; they do not allocate.
            unsafe {
                if libmimalloc_sys::mi_option_get(PURGE_DELAY) == DEFAULT_PURGE_DELAY {
                    libmimalloc_sys::mi_option_set(PURGE_DELAY, -1);
                }
            }
        }
    }

    /// The header's size for `layout`, and the layout of the whole allocation.
    #[inline]
    fn outer(layout: Layout) -> Option<(usize, Layout)> {
        let offset = HEADER.max(layout.align());
        let size = layout.size().checked_add(offset)?;
        Some((offset, Layout::from_size_align(size, layout.align()).ok()?))
    }

    /// Writes the header in front of `block` and counts it.
    ///
    /// # Safety
    /// `base` is a live allocation of `offset + size` bytes (or null), `offset >= 16` and
    /// a multiple of 8.
    #[inline]
    unsafe fn finish(base: *mut u8, offset: usize, size: usize) -> *mut u8 {
        if base.is_null() {
            return base;
        }
        let tag = TAG.with(|t| t.get());
        // SAFETY: `offset >= HEADER` bytes precede the block, inside the allocation, and
        // `block - 16` is 8-aligned (the block is aligned to at least 16 or `offset`).
        unsafe {
            let block = base.add(offset);
            (block.sub(HEADER) as *mut u64).write(tag as u64);
            (block.sub(8) as *mut u64).write(size as u64);
            account(tag, size as i64);
            block
        }
    }

    /// The owner's tag and the size of `block`, taken off the count.
    ///
    /// # Safety
    /// `block` was returned by this allocator.
    #[inline]
    unsafe fn release(block: *mut u8) {
        // SAFETY: the header written by `finish`.
        unsafe {
            let tag = (block.sub(HEADER) as *const u64).read() as usize;
            let size = (block.sub(8) as *const u64).read() as i64;
            account(tag, -size);
        }
    }
}

// SAFETY: every call forwards to mimalloc's allocator, for the block plus its header; the
// pointer returned is the block, aligned as asked, and freed through its base.
unsafe impl GlobalAlloc for KeepingMiMalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::configure();
        let Some((offset, outer)) = Self::outer(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: forwarded; `outer` has a non-zero size.
        unsafe { Self::finish(mimalloc::MiMalloc.alloc(outer), offset, layout.size()) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::configure();
        let Some((offset, outer)) = Self::outer(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: forwarded; `outer` has a non-zero size.
        unsafe {
            Self::finish(
                mimalloc::MiMalloc.alloc_zeroed(outer),
                offset,
                layout.size(),
            )
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let (offset, outer) = Self::outer(layout).expect("a layout this allocator allocated");
        // SAFETY: `ptr` came from `alloc` with this layout: its base is `offset` before it.
        unsafe {
            Self::release(ptr);
            mimalloc::MiMalloc.dealloc(ptr.sub(offset), outer)
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (offset, outer) = Self::outer(layout).expect("a layout this allocator allocated");
        let Some(new_outer) = new_size.checked_add(offset) else {
            return std::ptr::null_mut();
        };
        // SAFETY: the base and layout of `ptr`'s allocation; the header moves with the
        // contents, and is rewritten with the new size.
        unsafe {
            Self::release(ptr);
            let base = mimalloc::MiMalloc.realloc(ptr.sub(offset), outer, new_outer);
            if base.is_null() {
                // The old block is still live: count it again.
                account(
                    (ptr.sub(HEADER) as *const u64).read() as usize,
                    layout.size() as i64,
                );
                return base;
            }
            Self::finish(base, offset, new_size)
        }
    }
}

#[global_allocator]
static ALLOCATOR: KeepingMiMalloc = KeepingMiMalloc;

/// mimalloc's purge delay now, in milliseconds: -1 once the allocator has made its first
/// allocation, when it keeps what it frees.
pub fn purge_delay() -> std::ffi::c_long {
    // SAFETY: a plain option read.
    unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }
}
