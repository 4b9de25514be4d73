//! The variable-size all-to-all (`all_to_all_v`) that mixture-of-experts token dispatch
//! needs, on any backend: the members first agree on the whole count matrix with one
//! all-gather (so a count one member got wrong is an error on every member, naming both),
//! then each piece travels as one point-to-point message (an empty piece as none). Sends
//! never block on the receiver, so every member can send all its pieces before receiving.
//! CUDA tensors over NCCL take the same steps in device memory
//! (`tensor_parallel/mappings/device.rs`), so members on either path agree.

use super::buffer::{Buffer, CommDType};
use super::group::CommError;
use super::{Communicator, CommunicatorExt};

/// [`Communicator::all_to_all_v`] over `comm`'s collectives and point-to-point calls.
pub(crate) fn all_to_all_v<C: Communicator + ?Sized>(
    comm: &C,
    input: Buffer,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<Buffer, CommError> {
    let (n, me) = (comm.group().size(), comm.group().rank());
    let dtype = input.dtype();
    let total: usize = send_counts.iter().sum();
    if total != input.len() && send_counts.len() == n {
        return Err(CommError::InvalidArgument {
            group: comm.group().to_string(),
            op: "all_to_all_v",
            reason: format!(
                "send counts {send_counts:?} add up to {total}, the input holds {}",
                input.len()
            ),
        });
    }
    if n == 1 && send_counts.len() == 1 && recv_counts.len() == 1 {
        return Ok(input);
    }
    agree(comm, dtype, send_counts, recv_counts)?;
    comm.connect(&peers(send_counts, recv_counts))?;
    let starts = starts(send_counts);
    for j in (0..n).filter(|&j| j != me && send_counts[j] > 0) {
        comm.send(input.slice(starts[j]..starts[j] + send_counts[j]), j)?;
    }
    let mut pieces = Vec::with_capacity(n);
    for (i, &count) in recv_counts.iter().enumerate() {
        if i == me {
            pieces.push(input.slice(starts[me]..starts[me] + count));
        } else if count > 0 {
            let mut piece = Buffer::zeros(dtype, count);
            comm.recv(&mut piece, i)?;
            pieces.push(piece);
        }
    }
    Ok(Buffer::concat(dtype, &pieces))
}

/// The members this one exchanges a piece with, either way. The counts were agreed, so the
/// relation is symmetric: opening these pairs first (in the group's order, see
/// [`Communicator::connect`]) keeps the sends and receives that follow, in their own order,
/// from opening pairs in a cycle of waits when some pieces are empty.
pub(crate) fn peers(send_counts: &[usize], recv_counts: &[usize]) -> Vec<usize> {
    (0..send_counts.len())
        .filter(|&j| send_counts[j] > 0 || recv_counts[j] > 0)
        .collect()
}

/// Where each member's piece starts in the input: the running sums of `counts`.
pub(crate) fn starts(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

/// Every member of `comm`'s group agrees on the whole count matrix of an all-to-all of
/// `dtype` with one all-gather, before any data moves: counts of the wrong length, or a
/// member sending a count (or dtype) its peer does not expect, are an error on every member,
/// naming both. Pieces of zero elements then travel as no message at all, on every path.
pub(crate) fn agree<C: Communicator + ?Sized>(
    comm: &C,
    dtype: CommDType,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<(), CommError> {
    let group = comm.group();
    let n = group.size();
    if send_counts.len() != n || recv_counts.len() != n {
        return Err(CommError::InvalidArgument {
            group: group.to_string(),
            op: "all_to_all_v",
            reason: format!(
                "{} send and {} receive counts for a group of {n}",
                send_counts.len(),
                recv_counts.len()
            ),
        });
    }
    if n == 1 {
        return Ok(());
    }
    // Header: dtype, then this member's send and receive counts.
    let dtype_code = CommDType::ALL.iter().position(|&d| d == dtype).unwrap_or(0) as i64;
    let header: Vec<i64> = std::iter::once(dtype_code)
        .chain(send_counts.iter().chain(recv_counts).map(|&c| c as i64))
        .collect();
    let all = comm.all_gather_vec(header)?;
    let row = |i: usize| &all[i * (2 * n + 1)..(i + 1) * (2 * n + 1)];
    for i in 0..n {
        if row(i)[0] != dtype_code {
            return Err(mismatch(
                comm,
                format!(
                    "global rank {} sends {:?}, global rank {} sends {dtype}",
                    group.global_rank_of(i),
                    usize::try_from(row(i)[0])
                        .ok()
                        .and_then(|c| CommDType::ALL.get(c)),
                    group.global_rank(),
                ),
            ));
        }
        for j in 0..n {
            let (sent, expected) = (row(i)[1 + j], row(j)[1 + n + i]);
            if sent != expected {
                return Err(mismatch(
                    comm,
                    format!(
                        "global rank {} sends {sent} elements to global rank {}, which expects {expected}",
                        group.global_rank_of(i),
                        group.global_rank_of(j),
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn mismatch<C: Communicator + ?Sized>(comm: &C, detail: String) -> CommError {
    CommError::Mismatch {
        group: comm.group().to_string(),
        seq: 0,
        detail: format!("all_to_all_v: {detail}"),
    }
}

#[cfg(test)]
mod tests;
