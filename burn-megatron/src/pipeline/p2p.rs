//! Point-to-point communication between adjacent pipeline stages (Megatron-Core's
//! `p2p_communication`).
//!
//! Activations travel forward on one communicator and gradients backward on another, so a
//! channel between two ranks only ever carries one kind of message in one direction. With
//! two stages and interleaving, rank 0 sends rank 1 both activations (its chunk v) and
//! gradients (its chunk v + 1, whose previous virtual stage is rank 1's chunk v); on one FIFO
//! channel the two kinds, of equal shape, could be taken for each other. Peers are the ring
//! neighbours: the last rank's "next" is rank 0, which interleaving uses to pass a
//! microbatch on to the next model chunk.
//!
//! Received tensors are fresh leaves on the receiving rank, so ranks never share an autodiff
//! graph. CUDA tensors over NCCL travel in device memory (`comm/cuda_tensor.rs`); everything
//! else through host memory.

use crate::comm::tensor::{invalid, recv, recv_sized, send_sized};
use crate::comm::{Comm, CommError};
use burn::tensor::{DType, Device, Tensor};

/// What the receiver knows of each message's shape.
#[derive(Debug, Clone, PartialEq)]
pub enum P2pShapes {
    /// Every message has these dims and this dtype (Megatron's `tensor_shape` and
    /// `pipeline_dtype`): nothing travels but the data.
    Fixed {
        /// The dims of every activation and gradient.
        dims: Vec<usize>,
        /// Their dtype.
        dtype: DType,
    },
    /// Megatron's `variable_seq_lengths`: a small header with the dtype and dims goes before
    /// each tensor, so microbatches may differ in sequence length.
    Variable,
}

/// One rank's pipeline channels: activations to the next stage and from the previous one,
/// gradients to the previous stage and from the next one.
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use burn_megatron::comm::LocalWorld;
/// use burn_megatron::pipeline::{P2pCommunicator, P2pShapes};
/// use std::sync::Arc;
///
/// let world = LocalWorld::new(1);
/// let fwd = Arc::new(world.communicator("pp", vec![0], 0).unwrap());
/// let bwd = Arc::new(world.communicator("pp-backward", vec![0], 0).unwrap());
/// let p2p = P2pCommunicator::new(fwd, bwd, P2pShapes::Variable, Device::flex());
/// // On a one-rank ring the next stage is this rank itself.
/// p2p.send_forward(Tensor::<2>::ones([2, 3], &Device::flex())).unwrap();
/// let x = p2p.recv_forward::<2>(false).unwrap();
/// assert_eq!(x.dims(), [2, 3]);
/// ```
#[derive(Debug, Clone)]
pub struct P2pCommunicator {
    forward: Comm,
    backward: Comm,
    shapes: P2pShapes,
    device: Device,
}

impl P2pCommunicator {
    /// Channels on `forward` and `backward`, two communicators over the same pipeline group
    /// (same ranks, same order); received tensors go to `device`.
    pub fn new(forward: Comm, backward: Comm, shapes: P2pShapes, device: Device) -> Self {
        Self {
            forward,
            backward,
            shapes,
            device,
        }
    }

    /// The pipeline group (of the forward channel).
    pub fn group(&self) -> &crate::comm::ProcessGroup {
        self.forward.group()
    }

    /// Opens the point-to-point pairs with both neighbours on both channels, in the group's
    /// one order ([`Communicator::connect`](crate::comm::Communicator::connect)); a no-op
    /// where pairs need no opening, and once they are open. Every stage calls it at the start
    /// of a schedule (`forward_backward_func` does): opened at their first message instead,
    /// the pairs of three or more stages interleaved (the last stage's next is the first)
    /// could wait on each other in a ring.
    pub fn connect(&self) -> Result<(), CommError> {
        let peers = [self.next(), self.prev()];
        self.forward.connect(&peers)?;
        self.backward.connect(&peers)
    }

    fn next(&self) -> usize {
        let g = self.forward.group();
        (g.rank() + 1) % g.size()
    }

    fn prev(&self) -> usize {
        let g = self.forward.group();
        (g.rank() + g.size() - 1) % g.size()
    }

    fn send<const D: usize>(
        &self,
        comm: &Comm,
        op: &'static str,
        tensor: Tensor<D>,
        peer: usize,
    ) -> Result<(), CommError> {
        let dims = tensor.dims();
        match &self.shapes {
            P2pShapes::Variable => return send_sized(&**comm, op, tensor, peer),
            P2pShapes::Fixed { dims: fixed, .. } => {
                if crate::comm::comm_dtype(tensor.dtype()).is_none() {
                    let reason = format!(
                        "dtype {:?} is not supported by the collectives",
                        tensor.dtype()
                    );
                    return Err(invalid(&**comm, op, reason));
                }
                if fixed[..] != dims[..] {
                    return Err(invalid(
                        &**comm,
                        op,
                        format!(
                            "tensor of dims {dims:?} on a channel fixed to {fixed:?}; use variable shapes for microbatches of different lengths"
                        ),
                    ));
                }
            }
        }
        // CUDA tensors over NCCL go from device memory (the same message either way).
        crate::comm::tensor::send(&**comm, tensor, peer)
    }

    fn recv<const D: usize>(
        &self,
        comm: &Comm,
        op: &'static str,
        peer: usize,
        require_grad: bool,
    ) -> Result<Tensor<D>, CommError> {
        let t: Tensor<D> = match &self.shapes {
            P2pShapes::Variable => recv_sized(&**comm, op, &self.device, peer)?,
            P2pShapes::Fixed { dims, dtype } => {
                let dims: [usize; D] = dims.as_slice().try_into().map_err(|_| {
                    invalid(
                        &**comm,
                        op,
                        format!("a {D}-d tensor on a channel fixed to dims {dims:?}"),
                    )
                })?;
                let dtype = crate::comm::comm_dtype(*dtype).ok_or_else(|| {
                    invalid(&**comm, op, format!("dtype {dtype:?} is not supported"))
                })?;
                recv(&**comm, dims, dtype.burn_dtype(), &self.device, peer)?
            }
        };
        Ok(if require_grad { t.require_grad() } else { t })
    }

    /// Sends a stage's output activation to the next stage.
    pub fn send_forward<const D: usize>(&self, output: Tensor<D>) -> Result<(), CommError> {
        self.send(&self.forward, "send_forward", output, self.next())
    }

    /// Receives the previous stage's output, as a leaf tracked when `require_grad`.
    pub fn recv_forward<const D: usize>(&self, require_grad: bool) -> Result<Tensor<D>, CommError> {
        self.recv(&self.forward, "recv_forward", self.prev(), require_grad)
    }

    /// Sends the gradient of a stage's input to the previous stage.
    pub fn send_backward<const D: usize>(&self, input_grad: Tensor<D>) -> Result<(), CommError> {
        self.send(&self.backward, "send_backward", input_grad, self.prev())
    }

    /// Receives the gradient of this stage's output from the next stage.
    pub fn recv_backward<const D: usize>(&self) -> Result<Tensor<D>, CommError> {
        self.recv(&self.backward, "recv_backward", self.next(), false)
    }

    /// Sends an output forward, then receives an output gradient from the same neighbour.
    /// The send is posted first and never waits for the receiver, so two neighbours that
    /// both call this (or [`send_backward_recv_forward`](Self::send_backward_recv_forward))
    /// cannot deadlock.
    pub fn send_forward_recv_backward<const D: usize>(
        &self,
        output: Tensor<D>,
    ) -> Result<Tensor<D>, CommError> {
        self.send_forward(output)?;
        self.recv_backward()
    }

    /// Sends an input gradient backward, then receives the next input from the same
    /// neighbour; see [`send_forward_recv_backward`](Self::send_forward_recv_backward).
    pub fn send_backward_recv_forward<const D: usize>(
        &self,
        input_grad: Tensor<D>,
        require_grad: bool,
    ) -> Result<Tensor<D>, CommError> {
        self.send_backward(input_grad)?;
        self.recv_forward(require_grad)
    }
}
