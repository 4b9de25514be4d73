//! The index cache (Megatron's `--data-cache-path`): each index array is a `.npy` file (so
//! numpy opens it), named after a hash of a description of everything the index depends on;
//! the description is written beside it, last, and must match exactly for a hit, so a stale
//! or colliding file is rebuilt rather than trusted. Files are written under unique
//! temporary names and renamed, so ranks building the same index at once (threads or
//! processes) never see a partial file.

use super::super::DataError;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// An element type a cached index is stored in.
pub(super) trait NpyElement: Copy {
    const DESCR: &'static str;
    fn put(self, out: &mut Vec<u8>);
    fn take(b: &[u8]) -> Self;
}

impl NpyElement for i32 {
    const DESCR: &'static str = "<i4";
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_le_bytes());
    }
    fn take(b: &[u8]) -> Self {
        i32::from_le_bytes(b.try_into().unwrap_or_default())
    }
}

impl NpyElement for i64 {
    const DESCR: &'static str = "<i8";
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_le_bytes());
    }
    fn take(b: &[u8]) -> Self {
        i64::from_le_bytes(b.try_into().unwrap_or_default())
    }
}

fn header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    // numpy pads the header with spaces so the data starts on a 64-byte boundary.
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((dict.len() as u16).to_le_bytes());
    out.extend(dict.as_bytes());
    out
}

/// `values` as a `.npy` array of `shape` (row-major).
pub(super) fn npy_bytes<T: NpyElement>(values: &[T], shape: &[usize]) -> Vec<u8> {
    let mut out = header(T::DESCR, shape);
    for &v in values {
        v.put(&mut out);
    }
    out
}

/// Reads a `.npy` written by [`npy_bytes`] with `T`; `None` if it is not exactly that.
pub(super) fn parse_npy<T: NpyElement>(bytes: &[u8]) -> Option<(Vec<T>, Vec<usize>)> {
    let len = u16::from_le_bytes(bytes.get(8..10)?.try_into().ok()?) as usize;
    let dict = std::str::from_utf8(bytes.get(10..10 + len)?).ok()?;
    let dims = dict.split("'shape': (").nth(1)?.split(')').next()?;
    let shape: Vec<usize> = dims
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().ok())
        .collect::<Option<_>>()?;
    if header(T::DESCR, &shape) != bytes[..10 + len] {
        return None;
    }
    let size = std::mem::size_of::<T>();
    let data = &bytes[10 + len..];
    if data.len() != shape.iter().product::<usize>() * size {
        return None;
    }
    Some((data.chunks_exact(size).map(T::take).collect(), shape))
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` through a temporary file unique to this writer.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let err = |e: std::io::Error| DataError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(
        ".{}.{}.tmp",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Where one dataset's cached arrays live: `DIR/HASH-CLASS-SPLIT-NAME`.
#[derive(Debug, Clone)]
pub(super) struct CacheEntry {
    base: PathBuf,
    description: String,
}

impl CacheEntry {
    pub(super) fn new(dir: &Path, class: &str, split: &str, description: String) -> Self {
        let hash = format!(
            "{:08x}{:08x}",
            crc32fast::hash(description.as_bytes()),
            description.len()
        );
        Self {
            base: dir.join(format!("{hash}-{class}-{split}")),
            description,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        let mut p = self.base.as_os_str().to_owned();
        p.push(format!("-{name}"));
        PathBuf::from(p)
    }

    /// Whether a complete entry for exactly this description exists.
    pub(super) fn hit(&self) -> bool {
        std::fs::read_to_string(self.path("description.txt")).is_ok_and(|d| d == self.description)
    }

    pub(super) fn load<T: NpyElement>(&self, name: &str) -> Option<(Vec<T>, Vec<usize>)> {
        parse_npy(&std::fs::read(self.path(&format!("{name}.npy"))).ok()?)
    }

    pub(super) fn store<T: NpyElement>(
        &self,
        name: &str,
        values: &[T],
        shape: &[usize],
    ) -> Result<(), DataError> {
        write_atomic(
            &self.path(&format!("{name}.npy")),
            &npy_bytes(values, shape),
        )
    }

    /// Marks the entry complete: called after every array is stored.
    pub(super) fn commit(&self) -> Result<(), DataError> {
        write_atomic(&self.path("description.txt"), self.description.as_bytes())
    }
}
