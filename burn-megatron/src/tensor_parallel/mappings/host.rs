//! Forward implementations of the mappings on any backend, through host memory.
//!
//! The local communicator exchanges host buffers, so a backend tensor is read to the host,
//! exchanged and written back, with its dtype kept. A failed collective panics: Burn's op
//! signatures cannot carry an error, and a panic inside a rank is reported by the launcher
//! with the rank, while its peers fail promptly instead of waiting for it.
//!
//! `comm::tensor` moves whole `Tensor`s the same way for code outside the graph; the
//! mappings run inside a backend extension, on the backend's primitives, where that API is
//! not available, hence these readers of their own.

use super::super::init::slice_cols;
use super::Mapping;
use crate::comm::tensor::data_to_buffer;
use crate::comm::{Buffer, Comm, CommError, ReduceOp, map_vec};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::try_read_sync;

/// Reads a backend tensor into a host buffer of the same dtype, panicking (inside the graph
/// there is no error channel) with the op and group named.
fn read_to_host<B: Backend>(x: FloatTensor<B>, op: &str, comm: &Comm) -> Buffer {
    burn_megatron_kernels::device::count_host_read();
    let data = try_read_sync(B::float_into_data(x))
        .expect("synchronous reads are supported on this platform")
        .unwrap_or_else(|e| {
            panic!(
                "{op} on group {}: reading the tensor failed: {e:?}",
                comm.group()
            )
        });
    data_to_buffer(data).unwrap_or_else(|e| panic!("{op} on group {}: {e}", comm.group()))
}

/// Runs `mapping`'s forward on `x` over `comm`.
pub(crate) fn forward<B: Backend>(
    mapping: Mapping,
    x: FloatTensor<B>,
    comm: &Comm,
) -> FloatTensor<B> {
    let n = comm.group().size();
    if n == 1 {
        return x;
    }
    if mapping == Mapping::CopyTo {
        return x;
    }
    let device = x.device();
    let dims = x.shape().to_vec();
    let buf = read_to_host::<B>(x, mapping.name(), comm);
    let (out, out_dims) = exchange(mapping, buf, dims, comm)
        .unwrap_or_else(|e| panic!("tensor-parallel {mapping:?} failed: {e}"));
    let data = crate::comm::tensor::buffer_to_data(out, out_dims);
    B::float_from_data(data, &device)
}

fn exchange(
    mapping: Mapping,
    buf: Buffer,
    mut dims: Vec<usize>,
    comm: &Comm,
) -> Result<(Buffer, Vec<usize>), CommError> {
    let (n, me) = (comm.group().size(), comm.group().rank());
    let last = dims.len() - 1;
    let divisible = |dim: usize| split_size(mapping, comm, &dims, dim);
    Ok(match mapping {
        Mapping::CopyTo => (buf, dims),
        Mapping::ReduceFrom => {
            let mut buf = buf;
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
            (buf, dims)
        }
        Mapping::ScatterToTp => {
            let part = divisible(last)?;
            let out = select_columns(&buf, dims[last], me * part, part);
            dims[last] = part;
            (out, dims)
        }
        Mapping::GatherFromTp => {
            let cols = dims[last];
            let gathered = comm.all_gather(buf)?;
            dims[last] = cols * n;
            (interleave_columns(&gathered, n, cols), dims)
        }
        Mapping::ScatterToSp => {
            let part = divisible(0)?;
            let row = dims[1..].iter().product::<usize>();
            let out = buf.slice(me * part * row..(me + 1) * part * row);
            dims[0] = part;
            (out, dims)
        }
        Mapping::GatherFromSp { .. } => {
            let out = comm.all_gather(buf)?;
            dims[0] *= n;
            (out, dims)
        }
        Mapping::ReduceScatterToSp => {
            let part = divisible(0)?;
            let out = comm.reduce_scatter(buf, ReduceOp::Sum)?;
            dims[0] = part;
            (out, dims)
        }
    })
}

/// Sends `send[j]` rows (dim 0) of `x` to member `j` and returns the rows received,
/// `recv[i]` from member `i`, in group order.
pub(crate) fn all_to_all_rows<B: Backend>(
    x: FloatTensor<B>,
    send: &[usize],
    recv: &[usize],
    comm: &Comm,
) -> FloatTensor<B> {
    // Named for profiles (moe_bench's all-to-all share), forward and backward alike.
    let _span = tracing::debug_span!("moe.all_to_all").entered();
    let device = x.device();
    let mut dims = x.shape().to_vec();
    let row: usize = dims[1..].iter().product();
    let elements = |rows: &[usize]| rows.iter().map(|&r| r * row).collect::<Vec<_>>();
    let buf = read_to_host::<B>(x, "all_to_all", comm);
    let out = comm
        .all_to_all_v(buf, &elements(send), &elements(recv))
        .unwrap_or_else(|e| panic!("expert-parallel all_to_all failed: {e}"));
    dims[0] = recv.iter().sum();
    B::float_from_data(crate::comm::tensor::buffer_to_data(out, dims), &device)
}

/// Each member's part of `dims[dim]` split over `comm`'s group, or the error naming it.
pub(super) fn split_size(
    mapping: Mapping,
    comm: &Comm,
    dims: &[usize],
    dim: usize,
) -> Result<usize, CommError> {
    let n = comm.group().size();
    if dims[dim].is_multiple_of(n) {
        return Ok(dims[dim] / n);
    }
    Err(CommError::InvalidArgument {
        group: comm.group().to_string(),
        op: mapping.name(),
        reason: format!(
            "dim {dim} of size {} does not split evenly over {n} ranks",
            dims[dim]
        ),
    })
}

/// Columns `[start, start + len)` of a row-major matrix with `cols` columns.
fn select_columns(buf: &Buffer, cols: usize, start: usize, len: usize) -> Buffer {
    map_vec!(buf, v => slice_cols(v, cols, start, len))
}

/// `n` row-major blocks of `cols` columns each (concatenated) → one matrix with the blocks
/// side by side, `n · cols` columns.
fn interleave_columns(buf: &Buffer, n: usize, cols: usize) -> Buffer {
    fn interleave<T: Copy>(v: &[T], n: usize, cols: usize) -> Vec<T> {
        let block = v.len() / n;
        let rows = block.checked_div(cols).unwrap_or(0);
        let mut out = Vec::with_capacity(v.len());
        for r in 0..rows {
            for b in 0..n {
                let at = b * block + r * cols;
                out.extend_from_slice(&v[at..at + cols]);
            }
        }
        out
    }
    map_vec!(buf, v => interleave(v, n, cols))
}

/// All-reduces several tensors with one collective (packed into one buffer). Shapes are
/// kept; all must share a dtype.
pub(crate) fn all_reduce_many<B: Backend, const N: usize>(
    tensors: [FloatTensor<B>; N],
    op: ReduceOp,
    comm: &Comm,
) -> [FloatTensor<B>; N] {
    if comm.group().size() == 1 {
        return tensors;
    }
    let device = tensors[0].device();
    let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape().to_vec()).collect();
    let bufs: Vec<Buffer> = tensors
        .into_iter()
        .map(|t| read_to_host::<B>(t, "all_reduce", comm))
        .collect();
    let dtype = bufs[0].dtype();
    let mut packed = Buffer::concat(dtype, &bufs);
    comm.all_reduce(&mut packed, op)
        .unwrap_or_else(|e| panic!("tensor-parallel all_reduce failed: {e}"));
    let mut at = 0;
    let out: Vec<FloatTensor<B>> = shapes
        .into_iter()
        .map(|shape| {
            let len: usize = shape.iter().product();
            let part = packed.slice(at..at + len);
            at += len;
            B::float_from_data(crate::comm::tensor::buffer_to_data(part, shape), &device)
        })
        .collect();
    out.try_into()
        .unwrap_or_else(|_| unreachable!("one output per input"))
}
