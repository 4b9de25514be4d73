//! Collectives on Burn tensors, on top of the flat-buffer [`Communicator`] API.
//!
//! Tensors are read to the host, exchanged, and written back to the same device with the
//! same dtype (f16/bf16 stay f16/bf16), except that CUDA float tensors on a communicator with
//! device collectives (NCCL) stay in device memory ([`all_reduce`], [`all_gather`],
//! [`reduce_scatter`], [`send`], [`recv`]). These functions are *not* differentiable: inside an
//! autodiff graph use the mappings of `tensor_parallel`, whose backward is the conjugate
//! collective.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use burn_megatron::comm::{LocalWorld, tensor};
//!
//! let world = LocalWorld::new(1);
//! let comm = world.communicator("tp", vec![0], 0).unwrap();
//! let x = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &Device::flex());
//! let y = tensor::all_gather(&comm, x, 1).unwrap();
//! assert_eq!(y.dims(), [2, 2]);
//! ```

use super::{Buffer, CommError, Communicator, ReduceOp, buffer::with_vec};
use burn::tensor::kind::{Autodiff, Basic};
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};
use burn_megatron_kernels::device::ReadBack;

/// An `InvalidArgument` error of `op` on `comm`'s group.
pub(crate) fn invalid(
    comm: &(impl Communicator + ?Sized),
    op: &'static str,
    reason: String,
) -> CommError {
    CommError::InvalidArgument {
        group: comm.group().to_string(),
        op,
        reason,
    }
}

/// Reads a tensor's data into a flat buffer of the same dtype.
pub fn tensor_to_buffer<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    op: &'static str,
    tensor: Tensor<D, K>,
) -> Result<Buffer, CommError> {
    data_to_buffer(tensor.read_back()).map_err(|reason| invalid(comm, op, reason))
}

/// Converts tensor data to a flat buffer of the same dtype.
pub fn data_to_buffer(data: TensorData) -> Result<Buffer, String> {
    let dtype = data.dtype();
    let err = |e| format!("reading {dtype:?} tensor data: {e:?}");
    Ok(match dtype {
        DType::F32 => Buffer::F32(data.try_into_vec().map_err(err)?),
        DType::F16 => Buffer::F16(data.try_into_vec().map_err(err)?),
        DType::BF16 => Buffer::BF16(data.try_into_vec().map_err(err)?),
        DType::I32 => Buffer::I32(data.try_into_vec().map_err(err)?),
        DType::I64 => Buffer::I64(data.try_into_vec().map_err(err)?),
        other => {
            return Err(format!(
                "dtype {other:?} is not supported by the collectives"
            ));
        }
    })
}

/// Tensor data of `shape` holding a buffer's elements, with the buffer's dtype.
pub fn buffer_to_data(buf: Buffer, shape: impl Into<burn::tensor::Shape>) -> TensorData {
    with_vec!(buf, v => TensorData::new(v, shape))
}

/// Builds a tensor of `shape` on `device` from a buffer, keeping the buffer's dtype.
pub fn buffer_to_tensor<const D: usize, K: Basic>(
    buf: Buffer,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, K> {
    let data = buffer_to_data(buf, shape);
    let dtype = data.dtype();
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

fn check_dim<const D: usize>(
    comm: &(impl Communicator + ?Sized),
    op: &'static str,
    dims: &[usize; D],
    dim: usize,
    divisible: bool,
) -> Result<(), CommError> {
    if dim >= D {
        return Err(invalid(
            comm,
            op,
            format!("dim {dim} is out of range for a {D}-d tensor"),
        ));
    }
    let n = comm.group().size();
    if divisible && !dims[dim].is_multiple_of(n) {
        return Err(invalid(
            comm,
            op,
            format!(
                "dim {dim} of size {} does not split evenly over {n} ranks",
                dims[dim]
            ),
        ));
    }
    Ok(())
}

/// Runs `op` on the device when the communicator has device collectives (NCCL), the group
/// has more than one member and `tensor` is a CUDA float tensor they carry: `Ok(result)` of
/// `out_dims`, or `Err(tensor)` back for the host path.
#[cfg(feature = "cuda")]
fn on_device<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    out_dims: [usize; D],
    op: impl FnOnce(
        &dyn super::DeviceCollectives,
        super::DeviceSlice,
        super::DeviceSlice,
    ) -> Result<(), CommError>,
) -> Result<Result<Tensor<D, K>, Tensor<D, K>>, CommError> {
    match comm.device_collectives() {
        Some(dev) if comm.group().size() > 1 => {
            let group = comm.group().to_string();
            super::cuda_tensor::on_device(dev, &group, tensor, out_dims, |s, r| op(dev, s, r))
        }
        _ => Ok(Err(tensor)),
    }
}

/// Reduces `tensor` over the group (every member gets the result). A float tensor on a CUDA
/// device stays there when the communicator has device collectives (NCCL); everything else
/// goes through host memory.
pub fn all_reduce<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    op: ReduceOp,
) -> Result<Tensor<D, K>, CommError> {
    #[cfg(feature = "cuda")]
    let tensor = {
        let dims = tensor.dims();
        // SAFETY: `on_device` hands live contiguous buffers of the input's and the output's
        // lengths, held until the call returns.
        match on_device(comm, tensor, dims, |dev, s, r| unsafe {
            dev.all_reduce(s, r, op)
        })? {
            Ok(reduced) => return Ok(reduced),
            Err(tensor) => tensor,
        }
    };
    let (dims, device) = (tensor.dims(), tensor.device());
    let mut buf = tensor_to_buffer(comm, "all_reduce", tensor)?;
    comm.all_reduce(&mut buf, op)?;
    Ok(buffer_to_tensor(buf, dims, &device))
}

/// Concatenates every member's `tensor` along `dim`, in group order.
pub fn all_gather<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    dim: usize,
) -> Result<Tensor<D, K>, CommError> {
    let (dims, device) = (tensor.dims(), tensor.device());
    check_dim(comm, "all_gather", &dims, dim, false)?;
    let n = comm.group().size();
    // Members' blocks, contiguous: as a tensor of [n · d0, d1, ...] they are stacked on dim
    // 0, which is already the answer when gathering along dim 0.
    let mut stacked = dims;
    stacked[0] *= n;
    // SAFETY: `on_device` hands live contiguous buffers of the input's and the output's
    // lengths (`n ×` the input), held until the call returns.
    #[cfg(feature = "cuda")]
    let gathered = on_device(comm, tensor, stacked, |dev, s, r| unsafe {
        dev.all_gather(s, r)
    })?;
    #[cfg(not(feature = "cuda"))]
    let gathered: Result<Tensor<D, K>, Tensor<D, K>> = Err(tensor);
    let stacked = match gathered {
        Ok(on_device) => on_device,
        Err(tensor) => {
            let buf = comm.all_gather(tensor_to_buffer(comm, "all_gather", tensor)?)?;
            buffer_to_tensor(buf, stacked, &device)
        }
    };
    if dim == 0 || n == 1 {
        return Ok(stacked);
    }
    Ok(Tensor::cat(stacked.chunk(n, 0), dim))
}

/// Reduces `tensor` over the group and returns this member's slice along `dim`, whose size
/// must be divisible by the group size.
pub fn reduce_scatter<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    dim: usize,
    op: ReduceOp,
) -> Result<Tensor<D, K>, CommError> {
    let (dims, device) = (tensor.dims(), tensor.device());
    check_dim(comm, "reduce_scatter", &dims, dim, true)?;
    let n = comm.group().size();
    let mut out_dims = dims;
    out_dims[dim] /= n;
    // Lay each member's destination slice out contiguously, in group order.
    let contiguous = if dim == 0 || n == 1 {
        tensor
    } else {
        Tensor::cat(tensor.chunk(n, dim), 0)
    };
    #[cfg(feature = "cuda")]
    let contiguous = {
        let mut mine = contiguous.dims();
        mine[0] /= n;
        // SAFETY: as in `all_reduce`; the output holds `input / n` elements.
        match on_device(comm, contiguous, mine, |dev, s, r| unsafe {
            dev.reduce_scatter(s, r, op)
        })? {
            // This member's block of the reduced, reordered tensor is its slice along `dim`.
            Ok(block) => return Ok(block.reshape(out_dims)),
            Err(tensor) => tensor,
        }
    };
    let buf = tensor_to_buffer(comm, "reduce_scatter", contiguous)?;
    let mine = comm.reduce_scatter(buf, op)?;
    Ok(buffer_to_tensor(mine, out_dims, &device))
}

/// This member's slice of `tensor` along `dim` (no communication). The size of `dim` must
/// be divisible by the group size.
pub fn split<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    dim: usize,
) -> Result<Tensor<D, K>, CommError> {
    let dims = tensor.dims();
    check_dim(comm, "split", &dims, dim, true)?;
    let part = dims[dim] / comm.group().size();
    Ok(tensor.narrow(dim, comm.group().rank() * part, part))
}

/// Every member gets member `root`'s `tensor` (same shape and dtype on every member).
pub fn broadcast<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    root: usize,
) -> Result<Tensor<D, K>, CommError> {
    let (dims, device) = (tensor.dims(), tensor.device());
    let mut buf = tensor_to_buffer(comm, "broadcast", tensor)?;
    comm.broadcast(&mut buf, root)?;
    Ok(buffer_to_tensor(buf, dims, &device))
}

/// Sends `tensor` to member `peer` (not this member), returning once it is queued: the
/// receiver need not be waiting. A float tensor on a CUDA device goes from device memory when
/// the communicator has device collectives (NCCL); everything else through host memory. The
/// message is the same either way, so the peer may receive it into either
/// ([`P2pStats`](super::P2pStats) counts both paths).
pub fn send<const D: usize, K: Autodiff>(
    comm: &(impl Communicator + ?Sized),
    tensor: Tensor<D, K>,
    peer: usize,
) -> Result<(), CommError> {
    #[cfg(feature = "cuda")]
    let tensor = {
        use super::cuda_tensor::{Carried, carried, count_host};
        let mut tensor = tensor;
        if let Some(dev) = comm
            .device_collectives()
            .filter(|_| peer != comm.group().rank())
        {
            match carried(dev, tensor) {
                Carried::Device(x) => {
                    return super::cuda_tensor::send(dev, comm.group().to_string(), x, peer);
                }
                Carried::Host(t) => tensor = t,
            }
        }
        count_host();
        tensor
    };
    comm.send(tensor_to_buffer(comm, "send", tensor)?, peer)
}

/// Receives a tensor of `shape` and `dtype` from member `peer` onto `device`: into device
/// memory for a float dtype on a CUDA device when the communicator has device collectives
/// (NCCL), else through host memory. Not tracked by autodiff.
pub fn recv<const D: usize, K: Basic>(
    comm: &(impl Communicator + ?Sized),
    shape: [usize; D],
    dtype: DType,
    device: &Device,
    peer: usize,
) -> Result<Tensor<D, K>, CommError> {
    let comm_dtype = super::buffer::comm_dtype(dtype)
        .ok_or_else(|| invalid(comm, "recv", format!("dtype {dtype:?} is not supported")))?;
    #[cfg(feature = "cuda")]
    {
        use super::cuda_tensor::{count_host, recv_tensor};
        let dev = comm.device_collectives();
        if let Some(dev) = dev.filter(|_| peer != comm.group().rank()) {
            let group = comm.group().to_string();
            if let Some(got) = recv_tensor(dev, group, device, shape, comm_dtype, peer) {
                // A float tensor, as the float dtype says.
                return got.map(|t| Tensor::from_dispatch(t.into_dispatch()));
            }
        }
        count_host();
    }
    let mut buf = Buffer::zeros(comm_dtype, shape.iter().product());
    comm.recv(&mut buf, peer)?;
    Ok(buffer_to_tensor(buf, shape, device))
}

/// The dtypes a [`send_sized`] header names, by their code.
const SIZED_DTYPES: [super::CommDType; 5] = [
    super::CommDType::F32,
    super::CommDType::F16,
    super::CommDType::BF16,
    super::CommDType::I32,
    super::CommDType::I64,
];

/// [`send`] after a small header with the tensor's dtype and dims, so that the receiver
/// ([`recv_sized`]) needs to know neither (Megatron's `variable_seq_lengths`). `op` names
/// the caller's operation in errors.
pub(crate) fn send_sized<const D: usize>(
    comm: &(impl Communicator + ?Sized),
    op: &'static str,
    tensor: Tensor<D>,
    peer: usize,
) -> Result<(), CommError> {
    let dtype = tensor.dtype();
    let code = super::comm_dtype(dtype)
        .and_then(|d| SIZED_DTYPES.iter().position(|&s| s == d))
        .ok_or_else(|| {
            invalid(
                comm,
                op,
                format!("dtype {dtype:?} is not supported by the collectives"),
            )
        })?;
    let mut header = vec![code as i64, D as i64];
    header.extend(tensor.dims().iter().map(|&d| d as i64));
    comm.send(Buffer::I64(header), peer)?;
    send(comm, tensor, peer)
}

/// Receives from member `peer` what [`send_sized`] sent, onto `device`. Errors on a header
/// of another rank than `D`, an unknown dtype or a negative dim.
pub(crate) fn recv_sized<const D: usize>(
    comm: &(impl Communicator + ?Sized),
    op: &'static str,
    device: &Device,
    peer: usize,
) -> Result<Tensor<D>, CommError> {
    let mut header = Buffer::I64(vec![0; 2 + D]);
    comm.recv(&mut header, peer)?;
    let Buffer::I64(h) = header else {
        unreachable!("received into an i64 buffer")
    };
    let dtype = usize::try_from(h[0])
        .ok()
        .and_then(|c| SIZED_DTYPES.get(c))
        .ok_or_else(|| invalid(comm, op, format!("unknown dtype code {} in header", h[0])))?;
    if h[1] != D as i64 {
        return Err(invalid(
            comm,
            op,
            format!("expected a {D}-d tensor, the sender sent {}-d", h[1]),
        ));
    }
    let mut dims = [0usize; D];
    for (d, &v) in dims.iter_mut().zip(&h[2..]) {
        *d = usize::try_from(v)
            .map_err(|_| invalid(comm, op, format!("negative dim {v} in header")))?;
    }
    recv(comm, dims, dtype.burn_dtype(), device, peer)
}
