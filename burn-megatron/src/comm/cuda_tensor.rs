//! Burn's CUDA tensors sent and received point to point on the device, for communicators with
//! device collectives (NCCL): pipeline stages' activations and gradients, and context
//! parallelism's ring, never pass through host memory. The message format is the host
//! path's, so a peer may take either path.
//!
//! `BURN_MEGATRON_P2P=host` keeps point-to-point messages in host memory (for comparison).

use super::{CommDType, CommError, DeviceCollectives, DeviceSlice, comm_dtype};
use burn::backend::{BackendTensor, DispatchTensor, DispatchTensorKind};
use burn::tensor::kind::{Autodiff, Basic};
use burn::tensor::{DType, Device, Shape, Tensor, TensorCreationOptions};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::RuntimeId;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

type CudaServer = <cubecl::cuda::CudaRuntime as cubecl_runtime::runtime::Runtime>::Server;

/// The variable that keeps point-to-point messages in host memory when set to `host`.
pub const P2P_VAR: &str = "BURN_MEGATRON_P2P";

/// Point-to-point tensors sent and received so far in this process, by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct P2pStats {
    /// Sent or received in device memory.
    pub device: u64,
    /// Copied through host memory (every backend but CUDA over NCCL, or `BURN_MEGATRON_P2P=host`).
    pub host: u64,
}

static DEVICE: AtomicU64 = AtomicU64::new(0);
static HOST: AtomicU64 = AtomicU64::new(0);

/// The counts so far.
pub fn p2p_stats() -> P2pStats {
    P2pStats {
        device: DEVICE.load(Ordering::Relaxed),
        host: HOST.load(Ordering::Relaxed),
    }
}

/// Counts a tensor message that went through host memory.
pub(crate) fn count_host() {
    HOST.fetch_add(1, Ordering::Relaxed);
}

/// Whether CUDA tensor `x` can take the device path of `dev`: on its GPU (NCCL reads and
/// writes addresses of the device its communicator was made on), of a dtype it carries.
fn carries(dev: &dyn DeviceCollectives, x: &CubeTensor) -> bool {
    x.device.runtime() == RuntimeId::Cuda
        && x.device.to_id().index_id as usize == dev.ordinal()
        && comm_dtype(x.dtype).is_some()
}

fn device_path_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var(P2P_VAR).map_or(true, |v| v != "host"))
}

fn engine(group: String, op: &'static str) -> impl Fn(String) -> CommError {
    move |reason| CommError::Engine {
        group: group.clone(),
        op,
        reason,
    }
}

/// `t`'s buffer (contiguous, of a dtype the collectives carry) as a device slice, and what
/// keeps its allocation in place while the slice is in use.
pub(crate) fn device_slice(
    t: &CubeTensor,
) -> Result<(DeviceSlice, Box<dyn std::any::Any + Send>), String> {
    let dtype = comm_dtype(t.dtype).ok_or_else(|| format!("dtype {:?}", t.dtype))?;
    let resource = t
        .client
        .get_resource::<CudaServer>(t.handle.clone())
        .map_err(|e| format!("{e:?}"))?;
    let slice = DeviceSlice {
        ptr: resource.resource().ptr,
        dtype,
        len: t.meta.shape().num_elements(),
    };
    Ok((slice, Box::new(resource)))
}

/// Sends CUDA tensor `x` to `peer` over `dev` (on `group`, for errors).
pub(crate) fn send(
    dev: &dyn DeviceCollectives,
    group: String,
    x: CubeTensor,
    peer: usize,
) -> Result<(), CommError> {
    let x = into_contiguous(x);
    let (slice, resource) = device_slice(&x).map_err(engine(group, "send"))?;
    let order =
        |stream: usize| burn_megatron_kernels::cuda::order::wait_for_cubecl(&x, stream as _);
    // SAFETY: the resource and the tensor (which keeps the buffer from being reused) live in
    // `keep` until NCCL has sent it; the stream waits for the kernels that wrote it.
    unsafe { dev.send(slice, peer, Box::new((resource, x.clone())), &order) }?;
    DEVICE.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// A new contiguous CUDA tensor of `dims` and `dtype` like `like`'s device, received from
/// `peer` over `dev`.
pub(crate) fn recv(
    dev: &dyn DeviceCollectives,
    group: String,
    like: &CubeTensor,
    dims: &[usize],
    dtype: DType,
    peer: usize,
) -> Result<CubeTensor, CommError> {
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        dims.to_vec().into(),
        dtype,
    );
    receive_into(dev, &out, peer, &engine(group, "recv"))?;
    Ok(out)
}

fn receive_into(
    dev: &dyn DeviceCollectives,
    out: &CubeTensor,
    peer: usize,
    fail: &dyn Fn(String) -> CommError,
) -> Result<(), CommError> {
    let (slice, _resource) = device_slice(out).map_err(fail)?;
    // The buffer may be memory CubeCL's queued kernels still read: NCCL writes after them.
    let order =
        |stream: usize| burn_megatron_kernels::cuda::order::wait_for_cubecl(out, stream as _);
    // SAFETY: a live contiguous buffer of `len` elements, held until the call returns.
    unsafe { dev.recv(slice, peer, &order) }?;
    DEVICE.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Runs collective `op` from `x`'s buffer into a new contiguous tensor of `shape` on the same
/// device (`group` names the group in errors).
pub(crate) fn collective(
    x: &CubeTensor,
    shape: Shape,
    group: &str,
    dev: &dyn DeviceCollectives,
    op: impl FnOnce(DeviceSlice, DeviceSlice) -> Result<(), CommError>,
) -> Result<CubeTensor, CommError> {
    let engine = |reason: String| CommError::Engine {
        group: group.to_string(),
        op: "device collective",
        reason,
    };
    let x = into_contiguous(x.clone());
    // Contiguous: Burn's default CUDA layout pads each row to an aligned pitch, and NCCL
    // writes packed rows.
    let out = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), shape, x.dtype);
    // The resources keep both allocations in place until `op` has waited for NCCL. Taken
    // first: taking them puts this thread's CubeCL stream after whatever stream last wrote
    // the buffers, so the mark below covers those writes too.
    let (src, _src) = device_slice(&x).map_err(engine)?;
    let (dst, _dst) = device_slice(&out).map_err(engine)?;
    // NCCL reads `x` on its own stream: it starts once everything Burn queued has run.
    let stream = dev.stream() as cudarc::driver::sys::CUstream;
    burn_megatron_kernels::cuda::order::wait_for_cubecl(&x, stream).map_err(engine)?;
    op(src, dst)?;
    Ok(out)
}

/// Collective `op` of `t` into a tensor of `out_dims` on the device, when `t` is a CUDA float
/// tensor the device path carries (not empty, a dtype the collectives take); `Err(t)` hands
/// it back for the host path otherwise. A tensor of an autodiff device comes back as one
/// (untracked).
pub(crate) fn on_device<const D: usize, K: Basic>(
    dev: &dyn DeviceCollectives,
    group: &str,
    t: Tensor<D, K>,
    out_dims: [usize; D],
    op: impl FnOnce(DeviceSlice, DeviceSlice) -> Result<(), CommError>,
) -> Result<Result<Tensor<D, K>, Tensor<D, K>>, CommError> {
    if !device_path_allowed() || t.shape().num_elements() == 0 {
        return Ok(Err(t));
    }
    let DispatchTensor { kind, autodiff } = t.into_dispatch();
    let x = match kind {
        DispatchTensorKind::Cube(BackendTensor::Float(x)) if carries(dev, &x) => x,
        kind => {
            return Ok(Err(Tensor::from_dispatch(DispatchTensor {
                kind,
                autodiff,
            })));
        }
    };
    let out = collective(&x, Shape::from(out_dims.to_vec()), group, dev, op)?;
    // A float tensor, as it came: `K` is the float kind.
    let kind = DispatchTensorKind::Cube(BackendTensor::Float(out));
    Ok(Ok(Tensor::from_dispatch(DispatchTensor { kind, autodiff })))
}

/// Which path a tensor to send takes.
pub(crate) enum Carried<const D: usize, K: Basic> {
    /// Its CUDA buffer (the autodiff graph dropped), for the device path.
    Device(CubeTensor),
    /// The tensor, for the host path.
    Host(Tensor<D, K>),
}

/// The path `t` takes: the device when it is a CUDA float tensor `dev` carries (see
/// `carries`), not empty, and the device path is allowed; else the host.
pub(crate) fn carried<const D: usize, K: Autodiff>(
    dev: &dyn DeviceCollectives,
    t: Tensor<D, K>,
) -> Carried<D, K> {
    if !device_path_allowed() || t.shape().num_elements() == 0 {
        return Carried::Host(t);
    }
    let DispatchTensor { kind, autodiff } = t.inner().into_dispatch();
    match kind {
        DispatchTensorKind::Cube(BackendTensor::Float(x)) if carries(dev, &x) => Carried::Device(x),
        kind => Carried::Host(Tensor::from_dispatch(DispatchTensor { kind, autodiff })),
    }
}

/// Receives a tensor of `dims` and `dtype` from `peer` into device memory on `device` when it
/// is a CUDA device and the device path is allowed; `None` leaves it to the host path.
pub(crate) fn recv_tensor<const D: usize>(
    dev: &dyn DeviceCollectives,
    group: String,
    device: &Device,
    dims: [usize; D],
    dtype: CommDType,
    peer: usize,
) -> Option<Result<Tensor<D>, CommError>> {
    let n: usize = dims.iter().product();
    let float = matches!(dtype, CommDType::F32 | CommDType::F16 | CommDType::BF16);
    if !device_path_allowed() || n == 0 || !float {
        return None;
    }
    let dtype = dtype.burn_dtype();
    // One dim: CUDA pads each row of a 2-d-or-more allocation, and NCCL writes packed rows.
    let options = TensorCreationOptions::new(device.clone().inner()).with_dtype(dtype);
    let flat = Tensor::<1>::empty([n], options);
    let DispatchTensor { kind, autodiff } = flat.into_dispatch();
    let DispatchTensorKind::Cube(BackendTensor::Float(out)) = kind else {
        return None;
    };
    if !carries(dev, &out) {
        return None;
    }
    let fail = engine(group, "recv");
    Some(receive_into(dev, &out, peer, &fail).map(|()| {
        let kind = DispatchTensorKind::Cube(BackendTensor::Float(out));
        let flat = Tensor::<1>::from_dispatch(DispatchTensor { kind, autodiff });
        let t = flat.reshape(dims);
        if device.is_autodiff() {
            t.autodiff()
        } else {
            t
        }
    }))
}

/// A CUDA float tensor's buffer for the device collectives to reduce in place, from any
/// thread (see [`Handoff`](super::handoff::Handoff)): made on the thread whose kernels wrote
/// it, which marks its CubeCL stream there; the reducing thread makes the collectives' stream
/// wait for the mark right before its collective. (Queued at the handover instead, a later
/// bucket's wait would sit in front of an earlier bucket's collective on that stream, and no
/// reduction would start before backward's last bucket.)
pub(crate) struct InPlace {
    /// Holds the allocation; no one else holds its buffer.
    tensor: Tensor<1>,
    slice: DeviceSlice,
    _resource: Box<dyn std::any::Any + Send>,
    /// `None`: CubeCL's stream was drained from the host instead (host stream order).
    signal: Option<burn_megatron_kernels::cuda::order::CubeclSignal>,
    group: String,
}

impl InPlace {
    /// `flat` in device memory, its writers marked on this thread's CubeCL stream; `Err(flat)`
    /// back for the host path when it is not a CUDA float tensor `dev` carries, or when its
    /// address or the mark cannot be had (then every member still takes part in the
    /// collective, through host memory).
    pub(crate) fn new(
        dev: &dyn DeviceCollectives,
        group: &str,
        flat: Tensor<1>,
    ) -> Result<Self, Box<Tensor<1>>> {
        if !device_path_allowed() || flat.shape().num_elements() == 0 {
            return Err(Box::new(flat));
        }
        let DispatchTensor { kind, autodiff } = flat.into_dispatch();
        let x = match kind {
            DispatchTensorKind::Cube(BackendTensor::Float(x)) if carries(dev, &x) => x,
            kind => {
                return Err(Box::new(Tensor::from_dispatch(DispatchTensor {
                    kind,
                    autodiff,
                })));
            }
        };
        // NCCL writes the buffer: it must be this tensor's alone, and packed.
        let x = into_contiguous(x);
        let x = if x.can_mut() && x.is_contiguous_buffer() {
            x
        } else {
            x.copy()
        };
        // The address first: taking it puts this thread's stream after the buffer's writers.
        let marked = device_slice(&x).and_then(|(slice, resource)| {
            let signal = burn_megatron_kernels::cuda::order::signal_cubecl(&x)?;
            Ok((slice, resource, signal))
        });
        let kind = DispatchTensorKind::Cube(BackendTensor::Float(x));
        let tensor = Tensor::from_dispatch(DispatchTensor { kind, autodiff });
        match marked {
            Ok((slice, resource, signal)) => Ok(Self {
                tensor,
                slice,
                _resource: resource,
                signal,
                group: group.to_string(),
            }),
            Err(why) => {
                tracing::warn!(
                    "group {group}: reducing a bucket through host memory, the device path \
                     failed: {why}"
                );
                Err(Box::new(tensor))
            }
        }
    }

    /// The communicator's device collectives, with their stream waiting for the mark.
    fn ordered<'a>(
        &self,
        comm: &'a (impl super::Communicator + ?Sized),
        op: &'static str,
    ) -> Result<&'a dyn DeviceCollectives, CommError> {
        let dev = comm
            .device_collectives()
            .ok_or_else(|| CommError::InvalidArgument {
                group: self.group.clone(),
                op,
                reason: "the communicator has no device collectives".into(),
            })?;
        if let Some(signal) = &self.signal {
            // SAFETY: the communicator's own stream, live while it is, on the buffer's device
            // (`carries` checked the ordinal); the signalling thread (the rank's) waits for
            // this reduction before it ends.
            unsafe { signal.wait_on(dev.stream() as _) }.map_err(engine(self.group.clone(), op))?;
        }
        Ok(dev)
    }

    /// All-reduces the buffer in place.
    pub(crate) fn all_reduce(
        self,
        comm: &(impl super::Communicator + ?Sized),
        op: super::ReduceOp,
    ) -> Result<super::handoff::Reduced, CommError> {
        let dev = self.ordered(comm, "all_reduce")?;
        // SAFETY: a live buffer of `len` elements held by `self` and no one else, its
        // writers ordered before the collectives' stream just above; NCCL reduces in place
        // when send and receive are the same slice.
        unsafe { dev.all_reduce(self.slice, self.slice, op) }?;
        let len = self.slice.len;
        Ok(super::handoff::Reduced::Tensor(
            Box::new(self.tensor),
            0..len,
        ))
    }

    /// Reduce-scatters the buffer in place: this member's block is reduced where it lies
    /// (NCCL's in-place convention, receive = send + rank × block).
    pub(crate) fn reduce_scatter(
        self,
        comm: &(impl super::Communicator + ?Sized),
        op: super::ReduceOp,
    ) -> Result<super::handoff::Reduced, CommError> {
        let dev = self.ordered(comm, "reduce_scatter")?;
        let (n, rank) = (comm.group().size(), comm.group().rank());
        // An uneven length is the collective's own error (its receive length is checked).
        let block = self.slice.len / n;
        let recv = DeviceSlice {
            ptr: self.slice.ptr + (rank * block * self.slice.dtype.size()) as u64,
            len: block,
            ..self.slice
        };
        // SAFETY: as in `all_reduce`; `recv` lies inside the same buffer.
        unsafe { dev.reduce_scatter(self.slice, recv, op) }?;
        let range = rank * block..(rank + 1) * block;
        Ok(super::handoff::Reduced::Tensor(
            Box::new(self.tensor),
            range,
        ))
    }
}
