//! Token dispatch over the expert-parallel group (Megatron's `--moe-token-dispatcher-type`):
//! every rank routes its own tokens, the experts live on one rank each, and the tokens
//! travel to their experts and back.
//!
//! - `alltoall`: each rank sorts its tokens by expert (`permute`), sends each rank the
//!   tokens of its experts with one variable-size all-to-all, regroups what it received by
//!   local expert, runs the experts, and sends the results back the same way; `unpermute`
//!   adds each token's expert outputs.
//! - `allgather`: every rank all-gathers the group's tokens and weights, runs its experts on
//!   the tokens routed to them, and reduce-scatters the partial outputs back.
//!
//! Under expert tensor parallelism both hand this rank's rows to [`run_split_experts`],
//! which gathers the rows of the same experts from the expert tensor-parallel group, runs
//! this rank's slice of the experts, and sums the partial outputs back to the rows' ranks.
//!
//! All are differentiable: the all-to-all's backward is the reverse exchange, the
//! all-gather's a reduce-scatter.

use super::ExpertGroups;
use super::experts::ExpertMlp;
use super::router::Routing;
use crate::comm::{Comm, CommunicatorExt};
use crate::tensor_parallel::TpError;
use crate::tensor_parallel::mappings::{
    all_to_all, gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use burn::tensor::{
    DType, Device, IndexingUpdateOp, Int, Tensor, TensorCreationOptions, TensorData,
};

fn index(v: Vec<i64>, device: &Device) -> Tensor<1, Int> {
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

/// The routing weights with a zero appended at index `T · k`, where padding tokens point.
fn weights_with_zero(routing: &Routing) -> Tensor<1> {
    let device = routing.probs.device();
    Tensor::cat(vec![routing.probs.clone(), Tensor::zeros([1], &device)], 0)
}

/// Runs `experts` (this rank's, experts `first..first + experts.len()` of the layer) on
/// `rows` grouped by expert: `counts[i]` consecutive rows for local expert `i`, each with its
/// weight in `weights` (`[rows, 1]`). Experts without rows add zero so that their
/// gradients exist; that zero is returned separately.
fn run_experts(
    experts: &[ExpertMlp],
    rows: Tensor<2>,
    weights: Tensor<2>,
    counts: &[usize],
) -> (Option<Tensor<2>>, Option<Tensor<1>>) {
    let _span = tracing::debug_span!("moe.experts").entered();
    let mut outs = Vec::new();
    let mut zero: Option<Tensor<1>> = None;
    let mut at = 0;
    for (expert, &n) in experts.iter().zip(counts) {
        if n == 0 {
            let z = expert.zero_touch();
            zero = Some(match zero {
                Some(acc) => acc + z,
                None => z,
            });
            continue;
        }
        let x = rows.clone().narrow(0, at, n);
        let w = weights.clone().narrow(0, at, n);
        outs.push(expert.forward(x, w));
        at += n;
    }
    ((!outs.is_empty()).then(|| Tensor::cat(outs, 0)), zero)
}

/// Rows ordered by source, then local expert (`count(source, l)` rows of local expert `l`
/// from each of `sources`) regrouped by local expert (Megatron's `sort_chunks_by_idxs`):
/// the order that groups them, its inverse (back to the sources' order), and each local
/// expert's rows.
fn by_local_expert(
    sources: usize,
    local: usize,
    count: impl Fn(usize, usize) -> usize,
) -> (Vec<i64>, Vec<i64>, Vec<usize>) {
    let mut starts = vec![vec![0usize; local]; sources];
    let mut at = 0;
    for (r, row) in starts.iter_mut().enumerate() {
        for (l, start) in row.iter_mut().enumerate() {
            *start = at;
            at += count(r, l);
        }
    }
    let mut order = Vec::with_capacity(at);
    let mut per_expert = vec![0usize; local];
    for (l, total) in per_expert.iter_mut().enumerate() {
        for (r, row) in starts.iter().enumerate() {
            let c = count(r, l);
            order.extend((row[l]..row[l] + c).map(|i| i as i64));
            *total += c;
        }
    }
    let mut inverse = vec![0i64; order.len()];
    for (pos, &i) in order.iter().enumerate() {
        inverse[i as usize] = pos as i64;
    }
    (order, inverse, per_expert)
}

/// [`run_experts`], or, when there is no row at all, `x` (empty) with a zero of `w`.
fn run_or_link(
    experts: &[ExpertMlp],
    x: Tensor<2>,
    w: Tensor<2>,
    counts: &[usize],
) -> (Tensor<2>, Option<Tensor<1>>) {
    let dtype = x.dtype();
    match run_experts(experts, x.clone(), w.clone(), counts) {
        (Some(out), zero) => (out, zero),
        (None, zero) => (x + zero_of(w, dtype), zero),
    }
}

/// A zero that depends on every element of `t`: added to an output that would otherwise not
/// use `t`, it keeps the exchanges that made `t` in this rank's backward, as in its peers'.
fn zero_of(t: Tensor<2>, dtype: DType) -> Tensor<2> {
    (t.sum().cast(DType::F32) * 0.0).cast(dtype).unsqueeze()
}

/// [`run_experts`] over the expert tensor-parallel group `etp`, whose members hold slices of
/// the same experts: `rows` (`[n, H]`, grouped by local expert, `counts[i]` for expert `i`;
/// possibly empty) and their `weights` (`[n, 1]`) are gathered from every member, grouped
/// by expert, run through this member's slices, and the partial outputs summed back to the
/// members the rows came from (Megatron's all-gather and reduce-scatter over the expert
/// tensor-parallel group, here variable-size, as all-to-alls). Returns this member's rows'
/// outputs (`[n, H]`) and the zero of experts without rows. Every member calls it.
///
/// The same operations run whatever the counts (empty tensors where there is nothing):
/// Burn's backward runs a graph's nodes by depth, so only graphs of one shape on every rank
/// run the collectives of the expert-parallel and expert tensor-parallel groups in one order.
/// Rows are picked with `select`, which keeps an empty result in the graph (Burn's `cat` of
/// empty tensors and empty `slice`s drop out of it).
fn run_split_experts(
    experts: &[ExpertMlp],
    rows: Tensor<2>,
    weights: Tensor<2>,
    counts: &[usize],
    etp: &Comm,
) -> Result<(Tensor<2>, Option<Tensor<1>>), TpError> {
    let n: usize = counts.iter().sum();
    let (dtype, device, h) = (rows.dtype(), rows.device(), rows.dims()[1]);
    if etp.group().size() == 1 {
        // No row: the (empty) rows and a zero of the weights keep both in the graph.
        if n == 0 {
            return Ok((rows + zero_of(weights, dtype), None));
        }
        return Ok(run_or_link(experts, rows, weights, counts));
    }
    let (m, local) = (etp.group().size(), experts.len());
    let all = etp.all_gather_vec(counts.iter().map(|&c| c as i64).collect())?;
    let count = |member: usize, expert: usize| all[member * local + expert] as usize;
    let sizes: Vec<usize> = (0..m)
        .map(|j| (0..local).map(|l| count(j, l)).sum())
        .collect();
    // Rows and weights in one message (f32 holds the rows' values exactly), sent to every
    // member: one exchange, downstream of both expert-parallel ones.
    let both = Tensor::cat(vec![rows.cast(DType::F32), weights.cast(DType::F32)], 1);
    let each: Vec<i64> = (0..m).flat_map(|_| 0..n as i64).collect();
    let each = index(each, &device);
    let gathered = all_to_all(both.select(0, each.clone()), &vec![n; m], &sizes, etp)?;
    // Member-major as gathered; the experts take them expert-major.
    let (by_expert, inverse, per_expert) = by_local_expert(m, local, count);
    let picked = gathered.select(0, index(by_expert, &device));
    let columns = |c: std::ops::Range<usize>| index(c.map(|c| c as i64).collect(), &device);
    let x = picked.clone().select(1, columns(0..h)).cast(dtype);
    let w = picked.select(1, columns(h..h + 1));
    let (out, zero) = run_or_link(experts, x, w, &per_expert);
    let out = out.select(0, index(inverse, &device));
    let partial = all_to_all(out, &sizes, &vec![n; m], etp)?;
    // Each member's partial sums of this member's rows, added up.
    let zeros = TensorCreationOptions::new(device.clone()).with_dtype(dtype);
    let summed =
        Tensor::<2>::zeros([n, h], zeros).select_assign(0, each, partial, IndexingUpdateOp::Add);
    Ok((summed, zero))
}

/// The `alltoall` dispatcher: `tokens` (`[T, H]`) through this rank's `experts`
/// (layer experts `ep_rank · L .. (ep_rank + 1) · L`) and back, `[T, H]`.
pub(crate) fn alltoall(
    tokens: Tensor<2>,
    routing: &Routing,
    experts: &[ExpertMlp],
    groups: &ExpertGroups,
) -> Result<Tensor<2>, TpError> {
    let ep = &groups.ep;
    let device = tokens.device();
    let [t, h] = tokens.dims();
    let zeros = TensorCreationOptions::new(device.clone()).with_dtype(tokens.dtype());
    let (n, me, local) = (ep.group().size(), ep.group().rank(), experts.len());
    let e = routing.num_experts;
    // permute: expert-major, token order within an expert.
    let (mut token_idx, mut weight_idx) = (Vec::new(), Vec::new());
    let padding = (routing.num_tokens * routing.topk) as i64;
    for list in &routing.assignments {
        for &(token, slot) in list {
            token_idx.push(token as i64);
            weight_idx.push(slot.map_or(padding, |s| s as i64));
        }
    }
    let counts: Vec<i64> = routing.assignments.iter().map(|l| l.len() as i64).collect();
    let all = ep.all_gather_vec(counts)?;
    let count = |rank: usize, expert: usize| all[rank * e + expert] as usize;
    let input_splits: Vec<usize> = (0..n)
        .map(|r| (r * local..(r + 1) * local).map(|x| count(me, x)).sum())
        .collect();
    let output_splits: Vec<usize> = (0..n)
        .map(|r| (me * local..(me + 1) * local).map(|x| count(r, x)).sum())
        .collect();
    let token_idx = index(token_idx, &device);
    let permuted = tokens.select(0, token_idx.clone());
    let weights = weights_with_zero(routing)
        .select(0, index(weight_idx, &device))
        .unsqueeze_dim::<2>(1);
    let received = all_to_all(permuted, &input_splits, &output_splits, ep)?;
    let received_weights = all_to_all(weights, &input_splits, &output_splits, ep)?;

    // What arrived is ordered by source rank, then local expert: regrouped by local expert
    // for the experts, and back after them.
    let (by_expert, inverse, per_expert) =
        by_local_expert(n, local, |r, l| count(r, me * local + l));
    let sorted = index(by_expert, &device);
    let (outputs, zero) = run_split_experts(
        experts,
        received.select(0, sorted.clone()),
        received_weights.select(0, sorted),
        &per_expert,
        &groups.etp,
    )?;
    let outputs = outputs.select(0, index(inverse, &device));
    let back = all_to_all(outputs, &output_splits, &input_splits, ep)?;
    // unpermute: each token's outputs summed in place.
    let out =
        Tensor::<2>::zeros([t, h], zeros).select_assign(0, token_idx, back, IndexingUpdateOp::Add);
    Ok(match zero {
        Some(z) => out + z.unsqueeze(),
        None => out,
    })
}

/// The `allgather` dispatcher: the group's tokens gathered, this rank's experts run on
/// theirs, the outputs reduce-scattered back to their ranks.
pub(crate) fn allgather(
    tokens: Tensor<2>,
    routing: &Routing,
    experts: &[ExpertMlp],
    groups: &ExpertGroups,
) -> Result<Tensor<2>, TpError> {
    let ep = &groups.ep;
    let (device, dtype) = (tokens.device(), tokens.dtype());
    let [t, h] = tokens.dims();
    let zeros = TensorCreationOptions::new(device.clone()).with_dtype(dtype);
    let (n, me, local) = (ep.group().size(), ep.group().rank(), experts.len());
    let tk = routing.num_tokens * routing.topk;
    // Every rank's assignments to this rank's experts, as (token, weight index) in the
    // gathered tensors. Lists are length-prefixed, then padded to one length to gather.
    let mut mine = Vec::new();
    for list in &routing.assignments {
        mine.push(list.len() as i64);
        for &(token, slot) in list {
            mine.push(token as i64);
            mine.push(slot.map_or(-1, |s| s as i64));
        }
    }
    // Lengths, and token counts: the gathers below need the same count on every rank.
    let sizes = ep.all_gather_vec(vec![mine.len() as i64, t as i64])?;
    if let Some(other) = sizes.chunks(2).map(|c| c[1]).find(|&c| c != t as i64) {
        return Err(TpError::Invalid(format!(
            "the allgather dispatcher needs the same tokens on every expert-parallel rank: \
             {t} here, {other} on another rank of {}",
            ep.group()
        )));
    }
    let width = sizes.chunks(2).map(|c| c[0]).max().unwrap_or(0) as usize;
    mine.resize(width, 0);
    let all = ep.all_gather_vec(mine)?;
    let padding = (n * (tk + 1) - 1) as i64;
    let (mut rows, mut weight_rows, mut per_expert) = (Vec::new(), Vec::new(), vec![0; local]);
    for (l, total) in per_expert.iter_mut().enumerate() {
        let expert = me * local + l;
        for r in 0..n {
            let list = &all[r * width..(r + 1) * width];
            let mut at = 0;
            for x in 0..=expert {
                let len = list[at] as usize;
                if x == expert {
                    for p in 0..len {
                        let (token, slot) = (list[at + 1 + 2 * p], list[at + 2 + 2 * p]);
                        rows.push((r * t) as i64 + token);
                        weight_rows.push(if slot < 0 {
                            padding
                        } else {
                            (r * (tk + 1)) as i64 + slot
                        });
                    }
                    *total += len;
                }
                at += 1 + 2 * len;
            }
        }
    }
    let gathered = gather_from_sequence_parallel_region(tokens, ep, true);
    let weights = gather_from_sequence_parallel_region(
        weights_with_zero(routing).unsqueeze_dim::<2>(1),
        ep,
        true,
    );
    let rows = index(rows, &device);
    let (out, zero) = run_split_experts(
        experts,
        gathered.select(0, rows.clone()),
        weights.select(0, index(weight_rows, &device)),
        &per_expert,
        &groups.etp,
    )?;
    let partial =
        Tensor::<2>::zeros([n * t, h], zeros).select_assign(0, rows, out, IndexingUpdateOp::Add);
    let out = reduce_scatter_to_sequence_parallel_region(partial, ep);
    Ok(match zero {
        Some(z) => out + z.unsqueeze(),
        None => out,
    })
}
