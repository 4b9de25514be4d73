//! Records of the Burn before 0.22: `NamedMpkFileRecorder` (`.mpk`) and
//! `NamedMpkGzFileRecorder` (`.mpk.gz`), in the tensor format of Burn 0.14 to 0.21.
//!
//! Burn 0.22 reads only burnpack, so the weights Burn users already have (tracel-ai's
//! pretrained Llama, BERT and ResNet records among them) would need the Burn that wrote them
//! to convert. Such a record is a named MessagePack tree: `{metadata, item}`, where `item`
//! holds the module's fields by name, `Vec`s as arrays, a parameter as `{id, param}`, and a
//! tensor as `{bytes, shape, dtype}`, its values little-endian in `bytes`. It is parsed with
//! `rmp-serde`, the crate that wrote it, into a tree whose tensors are views of the buffer
//! they were read from: no tensor is copied until its shard is cut.

use burn::tensor::{BoolStore, DType};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;
use std::io::Read;
use std::path::Path;

/// One tensor of a legacy record.
pub(crate) struct LegacyTensor<'a> {
    /// Its module path (`layers.0.mha.query.weight`).
    pub name: String,
    pub dtype: DType,
    pub dims: Vec<usize>,
    /// Its values, little-endian: a view of the record's buffer.
    pub bytes: &'a [u8],
}

/// Whether `path` names a legacy record by its extension.
pub(crate) fn is_legacy(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.ends_with(".mpk") || name.ends_with(".mpk.gz")
}

/// A record's bytes: the file mapped, or a `.mpk.gz` inflated into memory (gzip has no random
/// access; `gunzip` it once to read it through a map instead).
pub(crate) enum Buffer {
    Mapped(memmap2::Mmap),
    Inflated(Vec<u8>),
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Inflated(v) => v,
        }
    }
}

/// The bytes of the record at `path`.
pub(crate) fn open(path: &Path) -> Result<Buffer, String> {
    if !path.to_string_lossy().ends_with(".gz") {
        let map = crate::mapped_file::map(path).map_err(|e| e.to_string())?;
        return Ok(Buffer::Mapped(map));
    }
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut out)
        .map_err(|e| format!("not a gzip stream: {e}"))?;
    Ok(Buffer::Inflated(out))
}

/// The tensors of a legacy record, by module path, and the Burn version that wrote it.
pub(crate) fn tensors(buffer: &[u8]) -> Result<(String, Vec<LegacyTensor<'_>>), String> {
    let root = rmp_serde::from_slice::<Node<'_>>(buffer)
        .map_err(|e| format!("not a record of Burn's NamedMpkFileRecorder: {e}"))?;
    let (Some(metadata), Some(item)) = (root.get("metadata"), root.get("item")) else {
        return Err("not a Burn record: no `metadata` and `item` at its top level".into());
    };
    let version = match metadata.get("version") {
        Some(Node::Str(v)) => v.clone(),
        _ => "of unknown version".into(),
    };
    let old = version
        .split('.')
        .take(2)
        .map(|p| p.parse::<u32>().ok())
        .collect::<Option<Vec<_>>>()
        .is_some_and(|v| v.as_slice() < [0, 14].as_slice());
    if old {
        return Err(format!(
            "written by Burn {version}, whose tensor format Burn 0.14 replaced: re-save it with \
             Burn 0.14 to 0.16 and their `record-backward-compat` feature"
        ));
    }
    let mut out = Vec::new();
    walk(item, &mut Vec::new(), &mut out)?;
    Ok((version, out))
}

/// Writes the record at `from` as a burnpack file at `to` (exactly that path), each tensor
/// under its module path with its dtype and shape, read from the record when the writer
/// reaches it: the writer holds one tensor at a time. The number of tensors written.
pub(crate) fn to_burnpack(from: &Path, to: &Path) -> Result<usize, String> {
    let buffer = std::sync::Arc::new(open(from)?);
    let (_, tensors) = tensors(&buffer)?;
    let base = buffer.as_ptr() as usize;
    let packed: Vec<_> = tensors
        .into_iter()
        .map(|t| {
            let (start, len) = (t.bytes.as_ptr() as usize - base, t.bytes.len());
            let buffer = buffer.clone();
            burn_pack::Tensor::deferred(t.name, t.dtype, t.dims, None, len, move || {
                let bytes = buffer[start..start + len].to_vec();
                Ok(burn::tensor::Bytes::from_bytes_vec(bytes))
            })
        })
        .collect();
    let n = packed.len();
    burn_pack::Writer::new(packed)
        .auto_extension(false)
        .write_to_file(to)
        .map_err(|e| format!("{}: {e}", to.display()))?;
    Ok(n)
}

/// Collects the tensors under `node`, whose module path is `path`.
fn walk<'a>(
    node: &Node<'a>,
    path: &mut Vec<String>,
    out: &mut Vec<LegacyTensor<'a>>,
) -> Result<(), String> {
    let children: Vec<(String, &Node<'a>)> = match node {
        Node::Map(entries) => {
            // A parameter (`ParamSerde`) holds its tensor under `param`, at the same path.
            let param = match (entries.len(), node.get("param"), node.get("id")) {
                (2, Some(param), Some(_)) => param,
                _ => node,
            };
            if let Some(tensor) = tensor(param, path)? {
                out.push(tensor);
                return Ok(());
            }
            entries.iter().map(|(k, v)| (k.clone(), v)).collect()
        }
        Node::Seq(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect(),
        _ => Vec::new(),
    };
    for (key, child) in children {
        path.push(key);
        walk(child, path, out)?;
        path.pop();
    }
    Ok(())
}

/// The tensor `node` is, if it is one (`{bytes, shape, dtype}`, Burn's `TensorData`).
fn tensor<'a>(node: &Node<'a>, path: &[String]) -> Result<Option<LegacyTensor<'a>>, String> {
    let (Node::Map(entries), Some(bytes), Some(shape), Some(dtype)) = (
        node,
        node.get("bytes"),
        node.get("shape"),
        node.get("dtype"),
    ) else {
        return Ok(None);
    };
    if entries.len() != 3 {
        return Ok(None);
    }
    let name = path.join(".");
    let bad = |what: &str| format!("tensor {name}: {what}");
    let Node::Bytes(bytes) = bytes else {
        return Err(bad("its `bytes` are not a byte string"));
    };
    let dims = match shape {
        Node::Seq(dims) => dims
            .iter()
            .map(|d| match d {
                Node::Int(d) => usize::try_from(*d).ok(),
                _ => None,
            })
            .collect::<Option<Vec<_>>>(),
        _ => None,
    }
    .ok_or_else(|| bad("its `shape` is not a list of sizes"))?;
    let dtype = burn_dtype(dtype).map_err(|e| bad(&e))?;
    let expected = dims
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad("its shape overflows"))?;
    if bytes.len() != expected {
        return Err(bad(&format!(
            "{} bytes for shape {dims:?} of {dtype:?} ({expected} expected)",
            bytes.len()
        )));
    }
    Ok(Some(LegacyTensor {
        name,
        dtype,
        dims,
        bytes,
    }))
}

/// Burn 0.14–0.21's `DType`, as rmp-serde wrote it: a unit variant as its name, a variant
/// with data as a one-entry map.
fn burn_dtype(node: &Node<'_>) -> Result<DType, String> {
    let name = match node {
        Node::Str(name) => name.as_str(),
        Node::Map(entries) if entries.len() == 1 => entries[0].0.as_str(),
        _ => return Err("its `dtype` is not a dtype".into()),
    };
    Ok(match name {
        "F64" => DType::F64,
        // Flex32 is stored as f32.
        "F32" | "Flex32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "I16" => DType::I16,
        "I8" => DType::I8,
        "U64" => DType::U64,
        "U32" => DType::U32,
        "U16" => DType::U16,
        "U8" => DType::U8,
        "Bool" => match node.get("Bool") {
            Some(Node::Str(s)) if s == "U32" => DType::Bool(BoolStore::U32),
            Some(Node::Str(s)) if s == "U8" => DType::Bool(BoolStore::U8),
            _ => DType::Bool(BoolStore::Native),
        },
        "QFloat" => {
            return Err("quantized: load the float record it was quantized from".into());
        }
        other => return Err(format!("dtype {other} is not one Burn 0.14 to 0.21 writes")),
    })
}

/// A MessagePack value, its byte strings borrowed from the buffer.
enum Node<'a> {
    Map(Vec<(String, Node<'a>)>),
    Seq(Vec<Node<'a>>),
    Bytes(&'a [u8]),
    Str(String),
    Int(u64),
    /// Anything a tensor's place does not need: floats, booleans, negative integers, nil.
    Other,
}

impl<'a> Node<'a> {
    fn get(&self, key: &str) -> Option<&Node<'a>> {
        match self {
            Self::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Node<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a MessagePack value")
    }
    fn visit_borrowed_bytes<E>(self, v: &'de [u8]) -> Result<Node<'de>, E> {
        Ok(Node::Bytes(v))
    }
    fn visit_bytes<E: serde::de::Error>(self, _: &[u8]) -> Result<Node<'de>, E> {
        // Only a reader that copies gives bytes it does not borrow; ours reads a slice.
        Err(E::custom("a byte string not borrowed from the record"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node<'de>, E> {
        Ok(Node::Str(v.to_string()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node<'de>, E> {
        Ok(Node::Int(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node<'de>, E> {
        Ok(u64::try_from(v).map_or(Node::Other, Node::Int))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Node<'de>, E> {
        Ok(Node::Other)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Node<'de>, E> {
        Ok(Node::Other)
    }
    fn visit_unit<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Other)
    }
    fn visit_none<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Other)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node<'de>, D::Error> {
        Node::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node<'de>, A::Error> {
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(key) = map.next_key::<String>()? {
            entries.push((key, map.next_value()?));
        }
        Ok(Node::Map(entries))
    }
}

#[cfg(test)]
mod tests;
