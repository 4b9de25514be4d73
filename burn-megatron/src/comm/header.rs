//! The header members swap before each collective: what call each one is making.

use super::buffer::CommDType;
use super::group::{CommError, OpDesc, ProcessGroup};
use super::reduce::ReduceOp;

/// op, dtype, count, reduction, root, call number.
pub(crate) const HEADER: usize = 6;

const OPS: [&str; 5] = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
];

pub(crate) fn code<T: PartialEq>(table: &[T], value: Option<&T>) -> i64 {
    value.map_or(-1, |v| {
        table.iter().position(|t| t == v).expect("in the table") as i64
    })
}

pub(crate) fn decode<T: Copy>(table: &[T], code: i64) -> Option<T> {
    usize::try_from(code)
        .ok()
        .and_then(|i| table.get(i).copied())
}

pub(crate) fn encode(desc: &OpDesc, seq: u64) -> [i64; HEADER] {
    [
        code(&OPS, Some(&desc.op)),
        code(&CommDType::ALL, desc.dtype.as_ref()),
        desc.len as i64,
        code(&ReduceOp::ALL, desc.reduce.as_ref()),
        desc.root.map_or(-1, |r| r as i64),
        seq as i64,
    ]
}

pub(crate) fn describe(h: &[i64; HEADER]) -> String {
    let desc = OpDesc {
        op: decode(&OPS, h[0]).unwrap_or("?"),
        dtype: decode(&CommDType::ALL, h[1]),
        len: h[2].max(0) as usize,
        reduce: decode(&ReduceOp::ALL, h[3]),
        root: usize::try_from(h[4]).ok(),
    };
    format!("{desc} as call #{}", h[5])
}

/// The error every member reports when the members' headers (in group order) differ.
pub(crate) fn mismatch(
    label: &str,
    seq: u64,
    group: &ProcessGroup,
    headers: &[[i64; HEADER]],
) -> CommError {
    let detail = headers
        .iter()
        .enumerate()
        .map(|(i, h)| format!("global rank {}: {}", group.global_rank_of(i), describe(h)))
        .collect::<Vec<_>>()
        .join("; ");
    CommError::Mismatch {
        group: label.to_string(),
        seq,
        detail,
    }
}
