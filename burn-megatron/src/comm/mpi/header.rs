//! The header members swap before each collective: what call each one is making.

use super::super::buffer::CommDType;
use super::super::group::OpDesc;
use super::super::reduce::ReduceOp;

/// op, dtype, count, reduction, root, call number.
const HEADER: usize = 6;

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
