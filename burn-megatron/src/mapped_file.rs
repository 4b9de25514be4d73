//! A file read through a read-only memory map: checkpoints, records and datasets are read
//! in place, a tensor or a sample at a time, rather than copied into memory whole.

use memmap2::Mmap;
use std::path::Path;

/// The file at `path`, mapped read-only.
///
/// Every reader of a mapped file (safetensors', burn-store's, numpy's memmap in Megatron)
/// assumes what this one does: that no process truncates or rewrites the file while it is
/// mapped. Every read through the map is bounds-checked against its length; the callers copy
/// what they load out of it and drop the map.
pub(crate) fn map(path: &Path) -> std::io::Result<Mmap> {
    let file = std::fs::File::open(path)?;
    // SAFETY: read-only, and the file is not changed while mapped (see above).
    unsafe { Mmap::map(&file) }
}
