//! The mappings on Burn's CUDA tensors, on device memory, when the communicator has device
//! collectives (NCCL): activations and gradients never leave the GPU. Splits are slices on the
//! device; gathers and reductions hand the tensors' buffers to NCCL; ring shifts (context
//! parallelism's) and the all-to-all (experts' token dispatch, Ulysses) send and receive them.
//!
//! NCCL runs on a stream of its own, made to wait on the device for what Burn's stream has
//! queued (`burn_megatron_kernels::cuda::order`; `BURN_MEGATRON_STREAM_ORDER=host` drains
//! Burn's stream on the host instead), and the collective has finished (the communicator
//! waits, with its deadline) before Burn reads its output.

use super::Mapping;
use crate::comm::all_to_all::{agree, peers, starts};
use crate::comm::cuda_tensor::{self, collective};
use crate::comm::{Comm, CommError, DeviceCollectives, ReduceOp, comm_dtype};
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{Shape, Slice};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::RuntimeId;

/// The communicator's device collectives, when they apply to `x`: a CUDA tensor of a dtype
/// they carry, not empty, on a group of more than one.
pub(crate) fn collectives<'a>(x: &CubeTensor, comm: &'a Comm) -> Option<&'a dyn DeviceCollectives> {
    // An empty tensor has no buffer to hand over; the host path costs nothing for it.
    let applies = comm.group().size() > 1
        && x.meta.shape().num_elements() > 0
        && x.device.runtime() == RuntimeId::Cuda
        && comm_dtype(x.dtype).is_some();
    comm.device_collectives().filter(|_| applies)
}

/// `mapping` of `x` on the device, over `dev` (from [`collectives`]).
pub(crate) fn forward(
    mapping: Mapping,
    x: CubeTensor,
    comm: &Comm,
    dev: &dyn DeviceCollectives,
) -> CubeTensor {
    run(mapping, x, comm, dev).unwrap_or_else(|e| panic!("tensor-parallel {mapping:?} failed: {e}"))
}

fn run(
    mapping: Mapping,
    x: CubeTensor,
    comm: &Comm,
    dev: &dyn DeviceCollectives,
) -> Result<CubeTensor, CommError> {
    let (n, me) = (comm.group().size(), comm.group().rank());
    let group = comm.group().to_string();
    let dims = x.meta.shape().to_vec();
    let last = dims.len() - 1;
    let part = |dim: usize| super::host::split_size(mapping, comm, &dims, dim);
    let with = |dim: usize, size: usize| {
        let mut d = dims.clone();
        d[dim] = size;
        Shape::from(d)
    };
    Ok(match mapping {
        Mapping::CopyTo => x,
        Mapping::ScatterToTp => narrow(x, last, me * part(last)?, part(last)?),
        Mapping::ScatterToSp => narrow(x, 0, me * part(0)?, part(0)?),
        Mapping::ReduceFrom => {
            let shape = Shape::from(dims.clone());
            collective(&x, shape, &group, dev, |s, r| unsafe {
                dev.all_reduce(s, r, ReduceOp::Sum)
            })?
        }
        Mapping::GatherFromSp { .. } => {
            let shape = with(0, dims[0] * n);
            collective(&x, shape, &group, dev, |s, r| unsafe {
                dev.all_gather(s, r)
            })?
        }
        Mapping::ReduceScatterToSp => {
            let shape = with(0, part(0)?);
            collective(&x, shape, &group, dev, |s, r| unsafe {
                dev.reduce_scatter(s, r, ReduceOp::Sum)
            })?
        }
        Mapping::GatherFromTp => {
            // Gathered as n blocks of [rows, cols]; the blocks go side by side on the last dim.
            let rows: usize = dims[..last].iter().product();
            let cols = dims[last];
            let blocks = collective(
                &x,
                Shape::from([n, rows, cols]),
                &group,
                dev,
                |s, r| unsafe { dev.all_gather(s, r) },
            )?;
            let side_by_side = into_contiguous(CubeBackend::float_swap_dims(blocks, 0, 1));
            CubeBackend::float_reshape(side_by_side, with(last, cols * n))
        }
    })
}

fn narrow(x: CubeTensor, dim: usize, start: usize, len: usize) -> CubeTensor {
    let slices: Vec<Slice> = (0..x.meta.shape().num_dims())
        .map(|d| {
            if d == dim {
                Slice::from(start..start + len)
            } else {
                Slice::from(..)
            }
        })
        .collect();
    CubeBackend::float_slice(x, &slices)
}

/// [`all_to_all_rows`](super::host::all_to_all_rows) in device memory: the members agree on
/// the count matrix (one small host all-gather, as on the host path), then each non-empty
/// piece of rows goes to its member as one device message (queued, never waiting for the
/// receiver), and the pieces received (this member's own in place) are concatenated in group
/// order on the device.
pub(crate) fn all_to_all(
    x: CubeTensor,
    send: &[usize],
    recv: &[usize],
    comm: &Comm,
    dev: &dyn DeviceCollectives,
) -> CubeTensor {
    let _span = tracing::debug_span!("moe.all_to_all").entered();
    all_to_all_pieces(x, send, recv, comm, dev)
        .unwrap_or_else(|e| panic!("expert-parallel all_to_all failed: {e}"))
}

fn all_to_all_pieces(
    x: CubeTensor,
    send: &[usize],
    recv: &[usize],
    comm: &Comm,
    dev: &dyn DeviceCollectives,
) -> Result<CubeTensor, CommError> {
    let (n, me) = (comm.group().size(), comm.group().rank());
    let group = comm.group().to_string();
    let x = into_contiguous(x);
    let dims = x.meta.shape().to_vec();
    let row: usize = dims[1..].iter().product();
    let elements = |rows: &[usize]| rows.iter().map(|&r| r * row).collect::<Vec<_>>();
    let dtype = comm_dtype(x.dtype).expect("collectives() admits only the collectives' dtypes");
    agree(&**comm, dtype, &elements(send), &elements(recv))?;
    comm.connect(&peers(send, recv))?;
    let at = starts(send);
    for j in (0..n).filter(|&j| j != me && send[j] > 0) {
        let piece = into_contiguous(narrow(x.clone(), 0, at[j], send[j]));
        cuda_tensor::send(dev, group.clone(), piece, j)?;
    }
    let mut pieces = Vec::with_capacity(n);
    for (i, &rows) in recv.iter().enumerate() {
        let mut piece_dims = dims.clone();
        piece_dims[0] = rows;
        if i == me && rows > 0 {
            pieces.push(narrow(x.clone(), 0, at[me], rows));
        } else if rows > 0 {
            pieces.push(cuda_tensor::recv(
                dev,
                group.clone(),
                &x,
                &piece_dims,
                x.dtype,
                i,
            )?);
        }
    }
    let mut out_dims = dims;
    out_dims[0] = recv.iter().sum();
    Ok(match pieces.len() {
        0 => CubeBackend::float_zeros(Shape::from(out_dims), &x.device, x.dtype.into()),
        1 => pieces.pop().expect("one piece"),
        _ => CubeBackend::float_cat(pieces, 0),
    })
}
