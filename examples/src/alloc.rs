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

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, Ordering};

/// `mi_option_purge_delay` in mimalloc 3's `mimalloc.h` (libmimalloc-sys names no constant
/// for it); its default (`options.c`: 1000 ms) is checked before it is changed, so that
/// another version's numbering changes nothing.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const DEFAULT_PURGE_DELAY: std::ffi::c_long = 1000;

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
}

// SAFETY: every call forwards to mimalloc's allocator with the same arguments.
unsafe impl GlobalAlloc for KeepingMiMalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::configure();
        // SAFETY: forwarded.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::configure();
        // SAFETY: forwarded.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: KeepingMiMalloc = KeepingMiMalloc;

#[cfg(test)]
mod tests {
    /// The option changed is the purge delay: mimalloc reports it off after the first
    /// allocation (which any test has made by now).
    #[test]
    fn purging_is_off() {
        drop(vec![0u8; 1 << 20]);
        // SAFETY: a plain option read.
        let delay = unsafe { libmimalloc_sys::mi_option_get(super::PURGE_DELAY) };
        assert_eq!(delay, -1);
    }
}
