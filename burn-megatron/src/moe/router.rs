//! Megatron-Core's `TopKRouter`: FP32 router logits, top-k scores (softmax before or after
//! the top-k, or sigmoid), capacity dropping and padding, and the load-balancing and z
//! losses.
//!
//! What is differentiable stays on the device (logits → scores → the top-k probabilities,
//! the losses); which tokens go to which expert is read to the host once per forward, since
//! the token exchange needs its counts there anyway.

use super::{DropPolicy, MoeConfig, ScoreFunction};
use crate::comm::{Comm, CommunicatorExt, ReduceOp};
use crate::tensor_parallel::TpError;
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};
use burn_megatron_kernels::device::ReadBack;

/// Per expert, its tokens with the index of their weight (`None`: a padding token).
pub type Assignments = Vec<Vec<(usize, Option<usize>)>>;

/// Which expert each token goes to, with which weight.
#[derive(Debug, Clone)]
pub struct Routing {
    /// Tokens routed.
    pub num_tokens: usize,
    /// Experts of the layer.
    pub num_experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// `[T · k]`: the weight of each token's `k` choices, token-major (differentiable).
    pub probs: Tensor<1>,
    /// `[T · k]` host copy of each token's chosen experts, token-major.
    pub experts: Vec<usize>,
    /// Per expert, the tokens it processes in token order, each with the index of its
    /// weight in [`Routing::probs`], or `None` for a padding token (weight 0) that
    /// `--moe-pad-expert-input-to-capacity` adds. Dropped choices are absent.
    pub assignments: Assignments,
    /// Tokens each expert was chosen by before any dropping (the load-balancing counts),
    /// summed over the group the router's tokens are split over.
    pub tokens_per_expert: Vec<usize>,
}

impl Routing {
    /// The routing probabilities as Megatron's dense `[T, E]` matrix: each kept choice's
    /// weight, zero elsewhere (differentiable).
    pub fn dense_probs(&self) -> Tensor<2> {
        let (t, e) = (self.num_tokens, self.num_experts);
        let mut at = Vec::new();
        let mut slots = Vec::new();
        for (expert, list) in self.assignments.iter().enumerate() {
            for &(token, slot) in list {
                if let Some(slot) = slot {
                    at.push((token * e + expert) as i64);
                    slots.push(slot as i64);
                }
            }
        }
        let device = self.probs.device();
        let index = |v: Vec<i64>| -> Tensor<1, Int> {
            let n = v.len();
            Tensor::from_data(TensorData::new(v, [n]), &device)
        };
        let values = self.probs.clone().select(0, index(slots));
        Tensor::<1>::zeros([t * e], &device)
            .select_assign(0, index(at), values, IndexingUpdateOp::Add)
            .reshape([t, e])
    }

    /// Megatron's `routing_map`: whether token `t` is processed by expert `e` (padding
    /// included), row-major `[T, E]`.
    pub fn routing_map(&self) -> Vec<bool> {
        let mut map = vec![false; self.num_tokens * self.num_experts];
        for (expert, list) in self.assignments.iter().enumerate() {
            for &(token, _) in list {
                map[token * self.num_experts + expert] = true;
            }
        }
        map
    }
}

/// The router's output: the routing and the auxiliary losses to attach (each `None` when
/// its coefficient is 0).
#[derive(Debug, Clone)]
pub struct RouterOutput {
    /// Which expert each token goes to.
    pub routing: Routing,
    /// The load-balancing loss (`--moe-aux-loss-coeff`, Switch-style).
    pub aux_loss: Option<Tensor<1>>,
    /// The z-loss (`--moe-z-loss-coeff`).
    pub z_loss: Option<Tensor<1>>,
}

/// `ceil(tokens · k / experts · factor)`: how many tokens each expert takes at most
/// (Megatron's `get_capacity`).
pub fn expert_capacity(num_tokens: usize, topk: usize, num_experts: usize, factor: f64) -> usize {
    ((num_tokens * topk) as f64 / num_experts as f64 * factor).ceil() as usize
}

/// Routes `logits` (`[T, E]`, FP32) as `config` says. `token_group` is the group the
/// layer's tokens are split over (TP under sequence parallelism): the load-balancing counts
/// are summed over it and the losses normalised by its size, as Megatron's `tp_cp_group`.
pub fn route(
    config: &MoeConfig,
    logits: Tensor<2>,
    token_group: &Comm,
) -> Result<RouterOutput, TpError> {
    let [t, e] = logits.dims();
    let k = config.moe_router_topk;
    if e != config.num_experts || t == 0 {
        return Err(TpError::Invalid(format!(
            "router logits of shape [{t}, {e}] for {} experts (at least one token)",
            config.num_experts
        )));
    }
    let logits = logits.cast(DType::F32);
    let device = logits.device();
    let group = token_group.group().size();
    let scores = match config.moe_router_score_function {
        ScoreFunction::Softmax if config.moe_router_pre_softmax => softmax(logits.clone(), 1),
        ScoreFunction::Softmax => logits.clone(),
        ScoreFunction::Sigmoid => sigmoid(logits.clone()),
    };
    // Group-limited routing counts the load-balancing loss over the unlimited top-k, as
    // Megatron's `compute_routing_scores_for_aux_loss` does: both are read at once.
    let unlimited = || scores.clone().detach().topk_with_indices(k, 1).1;
    let (indices, unlimited) = match (config.moe_router_num_groups, config.moe_router_group_topk) {
        (Some(groups), Some(group_topk)) => (
            group_limited_topk(scores.clone().detach(), k, groups, group_topk),
            (config.moe_aux_loss_coeff != 0.0).then(unlimited),
        ),
        _ => (unlimited(), None),
    };
    let mut probs = scores.gather(1, indices.clone());
    probs = match config.moe_router_score_function {
        ScoreFunction::Softmax if !config.moe_router_pre_softmax => softmax(probs, 1),
        ScoreFunction::Sigmoid if k > 1 => {
            let sum = probs.clone().sum_dim(1) + 1e-20;
            probs / sum
        }
        _ => probs,
    };
    if let Some(factor) = config.moe_router_topk_scaling_factor.filter(|&f| f != 0.0) {
        probs = probs * factor;
    }
    let read = match unlimited {
        Some(unlimited) => Tensor::cat(vec![indices, unlimited], 1),
        None => indices,
    };
    let read: Vec<usize> = (read.read_back().convert::<i64>().iter::<i64>())
        .map(|i| i as usize)
        .collect();
    let width = read.len() / t;
    let experts: Vec<usize> = read
        .chunks(width)
        .flat_map(|row| &row[..k])
        .copied()
        .collect();
    // This rank's counts of the routed top-k, then of the unlimited one when it differs.
    let mut counts = vec![0i64; e * (width / k)];
    for row in read.chunks(width) {
        for (i, &x) in row.iter().enumerate() {
            counts[(i / k) * e + x] += 1;
        }
    }
    token_group.all_reduce_vec(&mut counts, ReduceOp::Sum)?;
    let tokens_per_expert: Vec<usize> = counts[..e].iter().map(|&c| c as usize).collect();
    let aux_counts: Vec<f32> = counts[counts.len() - e..]
        .iter()
        .map(|&c| c as f32)
        .collect();

    let probs = probs.reshape([t * k]);
    let assignments = assign(config, t, e, k, &experts, &probs)?;

    let aux_loss = (config.moe_aux_loss_coeff != 0.0).then(|| {
        let aux_scores = match config.moe_router_score_function {
            ScoreFunction::Softmax => softmax(logits.clone(), 1),
            ScoreFunction::Sigmoid => {
                let s = sigmoid(logits.clone());
                let sum = s.clone().sum_dim(1) + 1e-20;
                s / sum
            }
        };
        let counts = Tensor::<1>::from_data(TensorData::new(aux_counts, [e]), &device);
        let total = (t * group) as f64;
        let coeff = e as f64 * config.moe_aux_loss_coeff / (k as f64 * total * total);
        (aux_scores.sum_dim(0).reshape([e]) * counts).sum() * coeff
    });
    let z_loss = config.moe_z_loss_coeff.filter(|&c| c != 0.0).map(|coeff| {
        let max = logits.clone().detach().max_dim(1);
        let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        lse.powi_scalar(2).mean() * (coeff / group as f64)
    });
    Ok(RouterOutput {
        routing: Routing {
            num_tokens: t,
            num_experts: e,
            topk: k,
            probs,
            experts,
            assignments,
            tokens_per_expert,
        },
        aux_loss,
        z_loss,
    })
}

/// The `k` experts of each row of `scores` (`[T, E]`) among the `group_topk` of `groups`
/// equal groups whose top `k / group_topk` scores sum highest (Megatron's
/// `group_limited_topk`).
fn group_limited_topk(
    scores: Tensor<2>,
    k: usize,
    groups: usize,
    group_topk: usize,
) -> Tensor<2, Int> {
    let [t, e] = scores.dims();
    let grouped = scores.clone().reshape([t, groups, e / groups]);
    let group_scores = grouped
        .topk(k / group_topk, 2)
        .sum_dim(2)
        .reshape([t, groups]);
    let (_, chosen) = group_scores.clone().topk_with_indices(group_topk, 1);
    let device = scores.device();
    let mask = Tensor::<2>::zeros([t, groups], &device).scatter(
        1,
        chosen,
        Tensor::ones([t, group_topk], &device),
        IndexingUpdateOp::Add,
    );
    let mask = mask
        .reshape([t, groups, 1])
        .expand([t, groups, e / groups])
        .reshape([t, e]);
    let masked = scores.mask_fill(mask.equal_elem(0.0), f32::NEG_INFINITY);
    masked.topk_with_indices(k, 1).1
}

/// Each expert's tokens after capacity dropping and padding.
fn assign(
    config: &MoeConfig,
    t: usize,
    e: usize,
    k: usize,
    experts: &[usize],
    probs: &Tensor<1>,
) -> Result<Assignments, TpError> {
    let mut lists: Assignments = vec![Vec::new(); e];
    for (slot, &x) in experts.iter().enumerate() {
        lists[x].push((slot / k, Some(slot)));
    }
    let Some(factor) = config.moe_expert_capacity_factor else {
        return Ok(lists);
    };
    let capacity = expert_capacity(t, k, e, factor);
    let values: Vec<f32> = match config.moe_token_drop_policy {
        DropPolicy::Probs => probs
            .clone()
            .read_back()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| TpError::Invalid(format!("reading the router's probabilities: {e:?}")))?,
        DropPolicy::Position => Vec::new(),
    };
    for list in &mut lists {
        if list.len() > capacity {
            if config.moe_token_drop_policy == DropPolicy::Probs {
                // The highest weights stay; ties go to the earlier token.
                let weight = |s: &Option<usize>| s.map_or(0.0, |s| values[s]);
                list.sort_by(|a, b| weight(&b.1).total_cmp(&weight(&a.1)).then(a.0.cmp(&b.0)));
            }
            list.truncate(capacity);
            list.sort_unstable_by_key(|&(token, _)| token);
        } else if config.moe_pad_expert_input_to_capacity {
            // Zero-weight tokens fill the expert up to its capacity, the earliest first.
            let mut taken = vec![false; t];
            for &(token, _) in list.iter() {
                taken[token] = true;
            }
            let pad = (0..t).filter(|&x| !taken[x]).take(capacity - list.len());
            list.extend(pad.map(|token| (token, None)).collect::<Vec<_>>());
            list.sort_unstable_by_key(|&(token, _)| token);
        }
    }
    Ok(lists)
}
