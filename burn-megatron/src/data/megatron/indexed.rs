//! Megatron-Core's indexed dataset: a `.bin` of token ids and an `.idx` describing it,
//! byte for byte as `megatron/core/datasets/indexed_dataset.py` writes them.
//!
//! `.idx` (little-endian): the 9-byte magic `MMIDIDX\0\0`, the version (`u64`, 1), the
//! token dtype code (`u8`, [`TokenDType`]), the sequence count `S` (`u64`), the document
//! count `D` (`u64`, one more than the documents: it holds the bounds), then `S` sequence
//! lengths (`i32`, in tokens), `S` pointers (`i64`, byte offsets into `.bin`), `D`
//! document bounds (`i64`, sequence indices: document `d` is sequences
//! `bounds[d]..bounds[d+1]`), and for a multimodal dataset `S` modes (`i8`). `.bin` is
//! the sequences' tokens back to back.
//!
//! Both files are memory-mapped, so a corpus larger than memory is read on demand. Every
//! bound is checked when the dataset opens, so no later read leaves the files.

use super::super::DataError;
use memmap2::Mmap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const HEADER_BYTES: usize = 34;

/// The dtype of the tokens in `.bin`, with Megatron's codes (`DType` in
/// `indexed_dataset.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDType {
    /// Code 1.
    U8 = 1,
    /// Code 2.
    I8 = 2,
    /// Code 3.
    I16 = 3,
    /// Code 4.
    I32 = 4,
    /// Code 5.
    I64 = 5,
    /// Code 6.
    F64 = 6,
    /// Code 7.
    F32 = 7,
    /// Code 8.
    U16 = 8,
}

impl TokenDType {
    /// The dtype of Megatron's code, if it is one.
    pub fn from_code(code: u8) -> Option<Self> {
        use TokenDType::*;
        [U8, I8, I16, I32, I64, F64, F32, U16]
            .into_iter()
            .find(|d| *d as u8 == code)
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        use TokenDType::*;
        match self {
            U8 | I8 => 1,
            I16 | U16 => 2,
            I32 | F32 => 4,
            I64 | F64 => 8,
        }
    }

    /// The dtype Megatron's `preprocess_data` picks for a vocabulary (`DType.optimal_dtype`):
    /// `u16` below 65 500 tokens, else `i32`.
    pub fn optimal(vocab_size: usize) -> Self {
        if vocab_size < 65_500 {
            TokenDType::U16
        } else {
            TokenDType::I32
        }
    }

    /// numpy's name for it.
    pub fn name(self) -> &'static str {
        use TokenDType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            I16 => "int16",
            I32 => "int32",
            I64 => "int64",
            F64 => "float64",
            F32 => "float32",
            U16 => "uint16",
        }
    }

    fn decode(self, b: &[u8]) -> i64 {
        use TokenDType::*;
        // Floats truncate toward zero, as numpy's cast to int64 does.
        match self {
            U8 => i64::from(b[0]),
            I8 => i64::from(b[0] as i8),
            I16 => i64::from(i16::from_le_bytes([b[0], b[1]])),
            U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            I32 => i64::from(i32::from_le_bytes(b[..4].try_into().unwrap_or_default())),
            F32 => f32::from_le_bytes(b[..4].try_into().unwrap_or_default()) as i64,
            I64 => i64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
            F64 => f64::from_le_bytes(b[..8].try_into().unwrap_or_default()) as i64,
        }
    }

    fn encode(self, v: i64, out: &mut Vec<u8>) -> bool {
        use TokenDType::*;
        match self {
            U8 => u8::try_from(v).map(|x| out.push(x)).is_ok(),
            I8 => i8::try_from(v).map(|x| out.extend(x.to_le_bytes())).is_ok(),
            I16 => i16::try_from(v)
                .map(|x| out.extend(x.to_le_bytes()))
                .is_ok(),
            U16 => u16::try_from(v)
                .map(|x| out.extend(x.to_le_bytes()))
                .is_ok(),
            I32 => i32::try_from(v)
                .map(|x| out.extend(x.to_le_bytes()))
                .is_ok(),
            I64 => {
                out.extend(v.to_le_bytes());
                true
            }
            // Token ids beyond 2^24 would not survive f32; Megatron writes them anyway.
            F32 => {
                out.extend((v as f32).to_le_bytes());
                true
            }
            F64 => {
                out.extend((v as f64).to_le_bytes());
                true
            }
        }
    }
}

/// `PREFIX.idx` and `PREFIX.bin` of a Megatron dataset prefix.
pub fn dataset_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |ext: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    (with(".idx"), with(".bin"))
}

fn format_err(path: &Path, message: impl Into<String>) -> DataError {
    DataError::Format {
        path: path.display().to_string(),
        message: message.into(),
    }
}

fn io_err(path: &Path, e: std::io::Error) -> DataError {
    DataError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn map(path: &Path) -> Result<Mmap, DataError> {
    crate::mapped_file::map(path).map_err(|e| io_err(path, e))
}

/// A memory-mapped Megatron indexed dataset (`IndexedDataset` in Megatron-Core).
///
/// ```no_run
/// use burn_megatron::data::megatron::IndexedDataset;
///
/// let data = IndexedDataset::open("corpus_text_document").unwrap();
/// let first = data.get(0, 0, None).unwrap(); // every token of sequence 0
/// println!("{} sequences, {} documents, {:?}", data.len(), data.num_documents(), &first[..4]);
/// ```
#[derive(Debug)]
pub struct IndexedDataset {
    prefix: PathBuf,
    idx: Mmap,
    bin: Mmap,
    dtype: TokenDType,
    sequences: usize,
    bounds: usize,
    multimodal: bool,
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin`, checking the header and that every sequence and
    /// document lies inside the files.
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, DataError> {
        let prefix = prefix.as_ref().to_path_buf();
        let (idx_path, bin_path) = dataset_paths(&prefix);
        let idx = map(&idx_path)?;
        let bad = |m: String| format_err(&idx_path, m);
        if idx.len() < HEADER_BYTES {
            return Err(bad(format!(
                "truncated: {} bytes, shorter than the {HEADER_BYTES}-byte header",
                idx.len()
            )));
        }
        if &idx[..9] != MAGIC {
            return Err(bad(
                "not a Megatron index (bad magic; expected MMIDIDX)".into()
            ));
        }
        let u64_at = |o: usize| u64::from_le_bytes(idx[o..o + 8].try_into().unwrap_or_default());
        let version = u64_at(9);
        if version == 1u64.swap_bytes() {
            return Err(bad(
                "written in big-endian byte order; Megatron's format is little-endian".into(),
            ));
        }
        if version != 1 {
            return Err(bad(format!(
                "index version {version}; only version 1 exists"
            )));
        }
        let dtype = TokenDType::from_code(idx[17]).ok_or_else(|| {
            bad(format!(
                "unknown dtype code {} (Megatron's are 1..=8)",
                idx[17]
            ))
        })?;
        let too_big = || bad("sequence or document count overflows the address space".into());
        let sequences = usize::try_from(u64_at(18)).map_err(|_| too_big())?;
        let bounds = usize::try_from(u64_at(26)).map_err(|_| too_big())?;
        let plain = sequences
            .checked_mul(12)
            .and_then(|s| bounds.checked_mul(8)?.checked_add(s))
            .and_then(|b| b.checked_add(HEADER_BYTES))
            .ok_or_else(too_big)?;
        let multimodal = match idx.len() {
            n if n == plain => false,
            n if Some(n) == plain.checked_add(sequences) && sequences > 0 => true,
            n if n < plain => {
                return Err(bad(format!(
                    "truncated: {n} bytes, but {sequences} sequences and {bounds} document \
                     bounds need {plain}"
                )));
            }
            n => {
                return Err(bad(format!(
                    "{n} bytes, but {sequences} sequences and {bounds} document bounds need \
                     {plain} (or {} with modes)",
                    plain + sequences
                )));
            }
        };
        let bin = map(&bin_path)?;
        let data = Self {
            prefix,
            idx,
            bin,
            dtype,
            sequences,
            bounds,
            multimodal,
        };
        data.check(&idx_path, &bin_path)?;
        Ok(data)
    }

    fn check(&self, idx_path: &Path, bin_path: &Path) -> Result<(), DataError> {
        let size = self.dtype.size() as u64;
        for i in 0..self.sequences {
            let (len, ptr) = (self.raw_length(i), self.raw_pointer(i));
            if len < 0 || ptr < 0 {
                return Err(format_err(
                    idx_path,
                    format!("sequence {i} has length {len} at byte {ptr}"),
                ));
            }
            let end = (ptr as u64).checked_add(len as u64 * size);
            if end.is_none_or(|e| e > self.bin.len() as u64) {
                return Err(format_err(
                    bin_path,
                    format!(
                        "truncated: sequence {i} ends at byte {} but the file has {} bytes",
                        end.map_or("overflow".into(), |e| e.to_string()),
                        self.bin.len()
                    ),
                ));
            }
        }
        if self.bounds == 0 {
            return Err(format_err(
                idx_path,
                "no document bounds (expected at least [0])",
            ));
        }
        let mut previous = 0i64;
        for d in 0..self.bounds {
            let b = self.raw_bound(d);
            if b < previous || b as u64 > self.sequences as u64 {
                return Err(format_err(
                    idx_path,
                    format!(
                        "document bound {d} is {b}: bounds must rise from 0 to at most the \
                         {} sequences",
                        self.sequences
                    ),
                ));
            }
            previous = b;
        }
        if previous as u64 != self.sequences as u64 {
            return Err(format_err(
                idx_path,
                format!(
                    "the last document ends at sequence {previous} but there are {} \
                     (Megatron requires them equal)",
                    self.sequences
                ),
            ));
        }
        Ok(())
    }

    fn read<const N: usize>(&self, offset: usize) -> [u8; N] {
        self.idx[offset..offset + N].try_into().unwrap_or([0; N])
    }

    fn raw_length(&self, i: usize) -> i32 {
        i32::from_le_bytes(self.read(HEADER_BYTES + 4 * i))
    }

    fn raw_pointer(&self, i: usize) -> i64 {
        i64::from_le_bytes(self.read(HEADER_BYTES + 4 * self.sequences + 8 * i))
    }

    fn raw_bound(&self, d: usize) -> i64 {
        i64::from_le_bytes(self.read(HEADER_BYTES + 12 * self.sequences + 8 * d))
    }

    /// The dataset's path prefix.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The token dtype.
    pub fn dtype(&self) -> TokenDType {
        self.dtype
    }

    /// Whether the index carries per-sequence modes (Megatron's multimodal datasets).
    pub fn is_multimodal(&self) -> bool {
        self.multimodal
    }

    /// The number of sequences (for GPT data, documents; for BERT data, sentences).
    pub fn len(&self) -> usize {
        self.sequences
    }

    /// Whether there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.sequences == 0
    }

    /// The number of documents.
    pub fn num_documents(&self) -> usize {
        self.bounds - 1
    }

    /// The tokens of sequence `i` (checked at open: never negative).
    pub fn sequence_length(&self, i: usize) -> usize {
        self.raw_length(i) as usize
    }

    /// The sequences of document `d`.
    pub fn document(&self, d: usize) -> Range<usize> {
        self.raw_bound(d) as usize..self.raw_bound(d + 1) as usize
    }

    /// The tokens in all sequences.
    pub fn num_tokens(&self) -> u64 {
        (0..self.sequences)
            .map(|i| self.sequence_length(i) as u64)
            .sum()
    }

    /// `length` tokens (all to the end if `None`) of sequence `index` from `offset`, as
    /// `int64` (Megatron's `IndexedDataset.get`).
    pub fn get(
        &self,
        index: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Result<Vec<i64>, DataError> {
        let mut out = Vec::new();
        self.get_into(index, offset, length, &mut out)?;
        Ok(out)
    }

    /// [`get`](Self::get), appending to `out`.
    pub fn get_into(
        &self,
        index: usize,
        offset: usize,
        length: Option<usize>,
        out: &mut Vec<i64>,
    ) -> Result<(), DataError> {
        // The path is built only for an error: this runs for every sample read.
        let idx_path = || dataset_paths(&self.prefix).0;
        if index >= self.sequences {
            return Err(format_err(
                &idx_path(),
                format!("sequence {index} of {}", self.sequences),
            ));
        }
        let total = self.sequence_length(index);
        let length = length.unwrap_or(total.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > total) {
            return Err(format_err(
                &idx_path(),
                format!(
                    "tokens {offset}..{offset}+{length} of sequence {index}, which has {total}"
                ),
            ));
        }
        let size = self.dtype.size();
        let start = self.raw_pointer(index) as usize + offset * size;
        let bytes = &self.bin[start..start + length * size];
        out.extend(bytes.chunks_exact(size).map(|b| self.dtype.decode(b)));
        Ok(())
    }
}

/// Writes a Megatron indexed dataset (`IndexedDatasetBuilder` in Megatron-Core): tokens go
/// to `PREFIX.bin` as they come, the index to `PREFIX.idx` at [`finalize`](Self::finalize).
/// Both are written under temporary names and renamed when complete, `.idx` last, so a
/// crash never leaves a pair that opens.
#[derive(Debug)]
pub struct IndexedDatasetBuilder {
    prefix: PathBuf,
    bin: BufWriter<File>,
    dtype: TokenDType,
    lengths: Vec<i32>,
    bounds: Vec<i64>,
    buffer: Vec<u8>,
}

fn temporary(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".tmp");
    PathBuf::from(p)
}

impl IndexedDatasetBuilder {
    /// Starts `PREFIX.bin` / `PREFIX.idx` with tokens of `dtype`.
    pub fn new(prefix: impl AsRef<Path>, dtype: TokenDType) -> Result<Self, DataError> {
        let prefix = prefix.as_ref().to_path_buf();
        let (_, bin_path) = dataset_paths(&prefix);
        let tmp = temporary(&bin_path);
        let file = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        Ok(Self {
            prefix,
            bin: BufWriter::new(file),
            dtype,
            lengths: Vec::new(),
            bounds: vec![0],
            buffer: Vec::new(),
        })
    }

    /// Appends one sequence (`add_item`).
    pub fn add_item(&mut self, tokens: &[i64]) -> Result<(), DataError> {
        self.buffer.clear();
        for &t in tokens {
            if !self.dtype.encode(t, &mut self.buffer) {
                return Err(DataError::Config(format!(
                    "token {t} does not fit the dataset's dtype {}",
                    self.dtype.name()
                )));
            }
        }
        let length = i32::try_from(tokens.len()).map_err(|_| {
            DataError::Config(format!(
                "a sequence of {} tokens overflows i32",
                tokens.len()
            ))
        })?;
        let (_, bin_path) = dataset_paths(&self.prefix);
        self.bin
            .write_all(&self.buffer)
            .map_err(|e| io_err(&temporary(&bin_path), e))?;
        self.lengths.push(length);
        Ok(())
    }

    /// Ends the current document (`end_document`).
    pub fn end_document(&mut self) {
        self.bounds.push(self.lengths.len() as i64);
    }

    /// Appends a document of sequences given by their lengths (`add_document`).
    pub fn add_document(&mut self, tokens: &[i64], lengths: &[usize]) -> Result<(), DataError> {
        if lengths.iter().sum::<usize>() != tokens.len() {
            return Err(DataError::Config(format!(
                "sequence lengths sum to {} but the document has {} tokens",
                lengths.iter().sum::<usize>(),
                tokens.len()
            )));
        }
        let mut start = 0;
        for &l in lengths {
            self.add_item(&tokens[start..start + l])?;
            start += l;
        }
        self.end_document();
        Ok(())
    }

    /// Writes the index and makes both files visible under their names.
    pub fn finalize(self) -> Result<(), DataError> {
        let (idx_path, bin_path) = dataset_paths(&self.prefix);
        let (bin_tmp, idx_tmp) = (temporary(&bin_path), temporary(&idx_path));
        let file = self
            .bin
            .into_inner()
            .map_err(|e| io_err(&bin_tmp, e.into_error()))?;
        file.sync_all().map_err(|e| io_err(&bin_tmp, e))?;
        let mut idx = Vec::with_capacity(HEADER_BYTES + 12 * self.lengths.len());
        idx.extend(MAGIC);
        idx.extend(1u64.to_le_bytes());
        idx.push(self.dtype as u8);
        idx.extend((self.lengths.len() as u64).to_le_bytes());
        idx.extend((self.bounds.len() as u64).to_le_bytes());
        idx.extend(self.lengths.iter().flat_map(|l| l.to_le_bytes()));
        let size = self.dtype.size() as i64;
        let mut pointer = 0i64;
        for &l in &self.lengths {
            idx.extend(pointer.to_le_bytes());
            pointer += i64::from(l) * size;
        }
        idx.extend(self.bounds.iter().flat_map(|b| b.to_le_bytes()));
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&idx_tmp)?;
            f.write_all(&idx)?;
            f.sync_all()
        };
        write().map_err(|e| io_err(&idx_tmp, e))?;
        std::fs::rename(&bin_tmp, &bin_path).map_err(|e| io_err(&bin_path, e))?;
        std::fs::rename(&idx_tmp, &idx_path).map_err(|e| io_err(&idx_path, e))
    }
}
