//! Records built here as Burn's recorder writes them (rmp-serde, named), each with one fault.

use super::*;
use serde::Serialize;

/// A byte string, as Burn's `Bytes` serializes its values.
struct Bin(Vec<u8>);

impl Serialize for Bin {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

#[derive(Serialize)]
struct Data<D: Serialize> {
    bytes: Bin,
    shape: Vec<usize>,
    dtype: D,
}

#[derive(Serialize)]
struct ParamSerde<D: Serialize> {
    id: String,
    param: Data<D>,
}

#[derive(Serialize)]
struct Layer {
    weight: ParamSerde<&'static str>,
    /// A constant field, as Burn records a `usize`.
    d_model: usize,
}

#[derive(Serialize)]
struct Item<D: Serialize> {
    layers: Vec<Layer>,
    norm: Option<ParamSerde<D>>,
    absent: Option<ParamSerde<D>>,
}

#[derive(Serialize)]
struct Metadata {
    float: &'static str,
    format: &'static str,
    version: &'static str,
}

#[derive(Serialize)]
struct Record<D: Serialize> {
    metadata: Metadata,
    item: Item<D>,
}

fn param<D: Serialize>(values: &[f32], dtype: D) -> ParamSerde<D> {
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    ParamSerde {
        id: "x".into(),
        param: Data {
            bytes: Bin(bytes),
            shape: vec![values.len()],
            dtype,
        },
    }
}

fn record<D: Serialize>(version: &'static str, norm: ParamSerde<D>) -> Vec<u8> {
    let layer = |v: f32| Layer {
        weight: param(&[v, v + 1.0], "F32"),
        d_model: 2,
    };
    let record = Record {
        metadata: Metadata {
            float: "f32",
            format: "burn_core::record::file::NamedMpkFileRecorder",
            version,
        },
        item: Item {
            layers: vec![layer(1.0), layer(3.0)],
            norm: Some(norm),
            absent: None,
        },
    };
    rmp_serde::to_vec_named(&record).expect("encodes")
}

#[test]
fn a_record_gives_its_tensors_by_module_path_as_views_of_the_buffer() {
    let buffer = record("0.21.0", param(&[0.5, 0.25, 2.0], "F32"));
    let (version, tensors) = tensors(&buffer).expect("reads");
    assert_eq!(version, "0.21.0");
    let names: Vec<_> = tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["layers.0.weight", "layers.1.weight", "norm"]);
    let norm = &tensors[2];
    assert_eq!((norm.dtype, norm.dims.as_slice()), (DType::F32, &[3][..]));
    let values: Vec<f32> = norm
        .bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    assert_eq!(values, [0.5, 0.25, 2.0]);
    let second = &tensors[1];
    let second: Vec<f32> = second
        .bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    assert_eq!(second, [3.0, 4.0]);
    // Not copied: the values are the buffer's own bytes.
    let range = buffer.as_ptr_range();
    assert!(range.contains(&norm.bytes.as_ptr()));
}

#[test]
fn a_bad_record_is_an_error_naming_the_tensor_and_the_fault() {
    let err = |buffer: &[u8]| match tensors(buffer) {
        Ok(_) => panic!("a bad record was read"),
        Err(e) => e,
    };
    let mut short = param(&[1.0, 2.0], "F32");
    short.param.shape = vec![3];
    let e = err(&record("0.21.0", short));
    assert!(
        e.contains("tensor norm: 8 bytes for shape [3] of F32 (12 expected)"),
        "{e}"
    );

    let e = err(&record("0.21.0", param(&[1.0], "Complex64")));
    assert!(e.contains("tensor norm: dtype Complex64"), "{e}");

    // A quantized tensor: a variant with data, a one-entry map.
    let quantized = std::collections::BTreeMap::from([("QFloat", 1)]);
    let e = err(&record("0.21.0", param(&[1.0], quantized)));
    assert!(e.contains("tensor norm: quantized"), "{e}");

    let e = err(&record("0.13.2", param(&[1.0], "F32")));
    assert!(e.contains("written by Burn 0.13.2"), "{e}");

    let whole = record("0.21.0", param(&[1.0], "F32"));
    let e = err(&whole[..whole.len() - 3]);
    assert!(
        e.contains("not a record of Burn's NamedMpkFileRecorder"),
        "{e}"
    );

    let e = err(&rmp_serde::to_vec_named(&[1, 2, 3]).expect("encodes"));
    assert!(e.contains("not a Burn record"), "{e}");
}

#[test]
fn half_precision_and_bool_dtypes_read_as_burn_0_22_names_them() {
    for (name, dtype) in [
        ("F16", DType::F16),
        ("BF16", DType::BF16),
        ("Flex32", DType::F32),
        ("U16", DType::U16),
        ("Bool", DType::Bool(BoolStore::Native)),
    ] {
        assert_eq!(burn_dtype(&Node::Str(name.into())).ok(), Some(dtype));
    }
    // Burn 0.21's `Bool(BoolStore)`.
    let stored = Node::Map(vec![("Bool".into(), Node::Str("U32".into()))]);
    assert_eq!(burn_dtype(&stored).ok(), Some(DType::Bool(BoolStore::U32)));
}

#[test]
fn a_gzipped_record_inflates_and_a_broken_one_is_an_error() {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("legacy-record-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let buffer = record("0.21.0", param(&[0.5], "F32"));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&buffer).expect("compresses");
    let good = dir.join("model.mpk.gz");
    std::fs::write(&good, gz.finish().expect("compresses")).expect("writes");
    let inflated = open(&good).expect("inflates");
    assert!(matches!(inflated, Buffer::Inflated(_)));
    assert_eq!(&inflated[..], &buffer[..]);
    let bad = dir.join("bad.mpk.gz");
    std::fs::write(&bad, &buffer).expect("writes");
    let e = open(&bad).err().expect("not gzip");
    assert!(e.contains("not a gzip stream"), "{e}");
    assert!(is_legacy(&good) && is_legacy(&dir.join("m.mpk")) && !is_legacy(&dir.join("m.bpk")));
    std::fs::remove_dir_all(dir).expect("cleans up");
}
