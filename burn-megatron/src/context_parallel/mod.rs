//! Context parallelism: one sequence split over the context-parallel (CP) group. This folder
//! splits the sequence and gathers K/V; the attention of each comm type is the models':
//! `models/attention/context_parallel.rs` (all-gather and Ulysses) and
//! `models/attention/ring.rs` (the ring).
//!
//! Causal attention makes later tokens cost more, so the sequence is cut into `2·CP`
//! chunks and rank `r` holds chunks `r` and `2·CP − 1 − r` (Megatron's
//! `get_batch_on_this_cp_rank`): every rank gets the same work. Each token keeps its global
//! position (rotary tables, learned positions, the causal mask).
//!
//! Attention needs every key: with `all_gather` (Megatron's `--cp-comm-type all_gather`)
//! each layer all-gathers K and V over CP ([`ContextParallel::gather_sequence`], a
//! differentiable mapping whose backward reduce-scatters their gradients). Causal attention
//! then runs per local chunk against the keys up to that chunk's end in sequence order
//! ([`ContextParallel::global_order`]): the fused kernel's causal mode masks the last
//! block, and fully masked blocks are never computed. With `p2p` (ring attention) the K/V
//! blocks travel around the CP ring instead, and partial results are merged by their
//! log-sum-exp: one op with a handwritten backward that recomputes each block's scores,
//! its exchanges posted before each step's compute and received after it (timed in
//! [`RingStats`]). With `a2a` (Ulysses) an all-to-all trades this rank's tokens for `1/CP` of
//! its heads, attention runs over the whole sequence for those heads, and a second
//! all-to-all trades back: two exchanges of `(CP − 1)/CP` of the activations per layer,
//! independent of how many ranks there are, where `all_gather` moves `CP − 1` shares of K/V. The loss of a rank is its tokens' loss over the whole sequence's token
//! count, so the CP ranks' losses sum to the unsplit loss and their gradients sum to its
//! gradients.
//!
//! ```
//! use burn_megatron::context_parallel::cp_positions;
//!
//! // 8 tokens over CP 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
//! assert_eq!(cp_positions(8, 2, 0).unwrap(), [0, 1, 6, 7]);
//! assert_eq!(cp_positions(8, 2, 1).unwrap(), [2, 3, 4, 5]);
//! ```

use crate::comm::{Comm, CommunicatorExt, ReduceOp};
use crate::tensor_parallel::TpError;
use crate::tensor_parallel::mappings::{Mapping, apply, gather_from_sequence_parallel_region};
use burn::tensor::kind::Basic;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The global positions rank `rank` of a CP group of `cp` holds of a sequence of
/// `seq_length` tokens: chunks `rank` and `2·cp − 1 − rank` of `2·cp`.
pub fn cp_positions(seq_length: usize, cp: usize, rank: usize) -> Result<Vec<usize>, TpError> {
    if cp == 0 || rank >= cp {
        return Err(TpError::Invalid(format!(
            "rank {rank} of a context-parallel group of {cp}"
        )));
    }
    if !seq_length.is_multiple_of(2 * cp) {
        return Err(TpError::Invalid(format!(
            "--seq-length {seq_length} must be divisible by 2 × --context-parallel-size ({})",
            2 * cp
        )));
    }
    let chunk = seq_length / (2 * cp);
    let first = rank * chunk;
    let second = (2 * cp - 1 - rank) * chunk;
    Ok((first..first + chunk)
        .chain(second..second + chunk)
        .collect())
}

/// How attention reaches the other ranks' keys and values (Megatron's `--cp-comm-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpCommType {
    /// Every layer all-gathers K and V over CP.
    #[default]
    AllGather,
    /// Ring attention: K/V blocks passed around the ring, partial results merged by their
    /// log-sum-exp.
    P2p,
    /// Ulysses (DeepSpeed's sequence parallelism): an all-to-all trades this rank's share of
    /// the sequence for a share of the heads, attention runs over the whole sequence for
    /// those heads, and a second all-to-all trades back. Needs the heads each
    /// tensor-parallel rank holds to be divisible by CP.
    A2a,
}

/// What the ring (`p2p`) exchanges of a [`ContextParallel`] and its clones did since they
/// were last taken ([`ContextParallel::take_ring_stats`]): enough to tell the communication
/// a rank waited for from the compute its peer had not finished (`cp_bench` pairs each
/// receive with the previous rank's send, in order: ranks as threads share one clock).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RingStats {
    /// Blocks sent (K/V, and their gradients in backward), and their bytes.
    pub sends: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Time inside the send calls (queueing the block; a send never waits for the peer).
    pub send_time: Duration,
    /// When each send returned: the block was on its way.
    pub posted: Vec<Instant>,
    /// When each receive started and returned.
    pub received: Vec<(Instant, Instant)>,
}

/// One rank's view of a sequence split over its CP group.
#[derive(Debug, Clone)]
pub struct ContextParallel {
    comm: Comm,
    seq_length: usize,
    positions: Vec<usize>,
    key_positions: Vec<usize>,
    comm_type: CpCommType,
    ring_stats: Arc<Mutex<RingStats>>,
}

impl ContextParallel {
    /// This rank's share of sequences of `seq_length` tokens over `comm` (the CP group).
    /// Errors unless `seq_length` is divisible by `2 · comm.size()`.
    pub fn new(comm: Comm, seq_length: usize) -> Result<Self, TpError> {
        let (cp, rank) = (comm.group().size(), comm.group().rank());
        let positions = cp_positions(seq_length, cp, rank)?;
        let key_positions = (0..cp)
            .map(|r| cp_positions(seq_length, cp, r))
            .collect::<Result<Vec<_>, _>>()?
            .concat();
        Ok(Self {
            comm,
            seq_length,
            positions,
            key_positions,
            comm_type: CpCommType::AllGather,
            ring_stats: Arc::default(),
        })
    }

    /// With attention reaching the other ranks through `comm_type`.
    pub fn with_comm_type(mut self, comm_type: CpCommType) -> Self {
        self.comm_type = comm_type;
        self
    }

    /// How attention reaches the other ranks' keys and values.
    pub fn comm_type(&self) -> CpCommType {
        self.comm_type
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.comm.group().rank()
    }

    /// The CP group.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The group's size.
    pub fn size(&self) -> usize {
        self.comm.group().size()
    }

    /// The whole sequence's length.
    pub fn seq_length(&self) -> usize {
        self.seq_length
    }

    /// The global positions of this rank's tokens, in the order it holds them.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// The global positions of the keys after [`gather_sequence`](Self::gather_sequence):
    /// each rank's tokens, rank after rank.
    pub fn key_positions(&self) -> &[usize] {
        &self.key_positions
    }

    /// Tokens per chunk: the sequence is cut into `2 · CP` chunks.
    pub fn chunk_length(&self) -> usize {
        self.seq_length / (2 * self.size())
    }

    /// The global indices of this rank's two chunks, in the order it holds them.
    pub fn chunks(&self) -> [usize; 2] {
        let (cp, r) = (self.size(), self.comm.group().rank());
        [r, 2 * cp - 1 - r]
    }

    /// For each global position, where the gathered keys hold it: `select`ing the
    /// gathered keys with it puts them in sequence order.
    pub fn global_order(&self, device: &Device) -> Tensor<1, Int> {
        let mut order = vec![0i64; self.seq_length];
        for (gathered, &p) in self.key_positions.iter().enumerate() {
            order[p] = gathered as i64;
        }
        Tensor::from_data(TensorData::new(order, [self.seq_length]), device)
    }

    /// The inverse of [`global_order`](Self::global_order): for each gathered row, its
    /// global position. `select`ing rows in sequence order with it puts them in gathered
    /// (rank) order again.
    pub fn gathered_order(&self, device: &Device) -> Tensor<1, Int> {
        let order: Vec<i64> = self.key_positions.iter().map(|&p| p as i64).collect();
        Tensor::from_data(TensorData::new(order, [self.seq_length]), device)
    }

    /// This rank's tokens of one full-sequence row (`get_batch_on_this_cp_rank`).
    pub fn split<T: Clone>(&self, row: &[T]) -> Result<Vec<T>, TpError> {
        if row.len() != self.seq_length {
            return Err(TpError::Invalid(format!(
                "a row of {} tokens for a context-parallel split of {}",
                row.len(),
                self.seq_length
            )));
        }
        Ok(self.positions.iter().map(|&p| row[p].clone()).collect())
    }

    /// This rank's tokens of full-sequence rows along `dim` (`get_batch_on_this_cp_rank` on
    /// tensors: token ids, labels, loss masks, `[b, s]`). Errors unless `dim` has the
    /// sequence's length.
    pub fn split_tensor<const D: usize, K: Basic>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>, TpError> {
        let dims = x.dims();
        if dim >= D || dims[dim] != self.seq_length {
            return Err(TpError::Invalid(format!(
                "dim {dim} of a tensor of dims {dims:?} for a context-parallel split of {}",
                self.seq_length
            )));
        }
        let index: Vec<i64> = self.positions.iter().map(|&p| p as i64).collect();
        let index = Tensor::from_data(TensorData::new(index, [self.positions.len()]), &x.device());
        Ok(x.select(dim, index))
    }

    /// Refuses `--cp-comm-type a2a` when the `heads` a tensor-parallel rank holds do not
    /// split over the group (Ulysses trades tokens for heads), naming both numbers.
    pub fn check_heads(&self, heads: usize) -> Result<(), TpError> {
        if self.comm_type == CpCommType::A2a && !heads.is_multiple_of(self.size()) {
            return Err(TpError::Invalid(format!(
                "--cp-comm-type a2a splits the attention heads over context parallelism: \
                 the {heads} heads of a tensor-parallel rank are not divisible by \
                 --context-parallel-size {}",
                self.size()
            )));
        }
        Ok(())
    }

    /// All-gathers dim 0 (the sequence) over CP; backward reduce-scatters the gradient,
    /// since every rank's queries contribute to every key's gradient.
    pub fn gather_sequence<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        gather_from_sequence_parallel_region(x, &self.comm, true)
    }

    /// A full-sequence key padding (`[b, seq_length]`, true at padded keys) reordered as the
    /// gathered keys are.
    pub fn gathered_padding(
        &self,
        padding: &[Vec<bool>],
        device: &Device,
    ) -> Result<Tensor<2, Bool>, TpError> {
        let b = padding.len();
        let mut values = Vec::with_capacity(b * self.key_positions.len());
        for row in padding {
            if row.len() != self.seq_length {
                return Err(TpError::Invalid(format!(
                    "a padding row of {} for sequences of {}",
                    row.len(),
                    self.seq_length
                )));
            }
            values.extend(self.key_positions.iter().map(|&p| row[p]));
        }
        Ok(Tensor::from_data(
            TensorData::new(values, [b, self.key_positions.len()]),
            device,
        ))
    }

    /// The ring exchanges' cost since the last call, and counting afresh.
    pub fn take_ring_stats(&self) -> RingStats {
        std::mem::take(&mut *crate::comm::lock(&self.ring_stats))
    }

    pub(crate) fn record_ring_send(&self, started: Instant, bytes: usize) {
        let now = Instant::now();
        let mut stats = crate::comm::lock(&self.ring_stats);
        stats.sends += 1;
        stats.bytes += bytes as u64;
        stats.send_time += now - started;
        stats.posted.push(now);
    }

    pub(crate) fn record_ring_receive(&self, started: Instant) {
        let now = Instant::now();
        crate::comm::lock(&self.ring_stats)
            .received
            .push((started, now));
    }

    /// The sum of `value` over the CP group (a host value: token counts, losses to report).
    pub fn sum(&self, value: f32) -> Result<f32, TpError> {
        let mut v = vec![value];
        self.comm.all_reduce_vec(&mut v, ReduceOp::Sum)?;
        Ok(v[0])
    }

    /// The sum of `x` over the CP group, as a constant (detached): on NCCL an all-reduce on
    /// the device, so a loss's token count needs no host read (host-staged, and counted,
    /// on the other communicators). Like the mappings, a failed collective panics inside
    /// the rank, which the launcher reports.
    pub fn sum_tensor(&self, x: Tensor<1>) -> Tensor<1> {
        apply(x.detach(), Mapping::ReduceFrom, &self.comm)
    }
}

#[cfg(test)]
mod tests;
