//! Mixture of experts with expert parallelism (Megatron-Core's `MoELayer`): a router picks
//! `k` experts per token, a token dispatcher sends each token to the expert-parallel rank
//! that holds its experts and brings the results back, and the experts are MLPs.
//!
//! - [`route`]: Megatron's `TopKRouter` (softmax before or after the top-k, or sigmoid;
//!   capacity dropping and padding; the load-balancing and z losses), logits in FP32.
//! - `dispatcher`: `alltoall` and `allgather` over the expert-parallel group
//!   ([`GroupKind::ExpertModelParallel`](crate::topology::GroupKind)), differentiable.
//! - [`ExpertMlp`]: the experts, run one after the other (Megatron's `SequentialMLP`),
//!   each split over the expert tensor-parallel group when it has more than one rank.
//!
//! Each rank holds `num_experts / EP` experts, initialised from their global index, so a
//! model split over any EP starts from the same weights. The auxiliary losses enter
//! backward through [`crate::aux_loss::attach_aux_loss`] on whichever
//! pipeline stage the layer runs.

mod dispatcher;
mod experts;
mod router;
mod shared;
#[cfg(test)]
mod tests;

pub use experts::ExpertMlp;
pub use router::{Assignments, RouterOutput, Routing, expert_capacity, route};
pub use shared::SharedExpert;

use crate::activation::ActivationFunc;
use crate::aux_loss::attach_aux_loss;
use crate::comm::Comm;
use crate::tensor_parallel::mappings::{
    gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region,
};
use crate::tensor_parallel::{
    LayoutOwner, MasterInit, ParallelAttrs, TpError, derive_seed, host_param,
};
use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::device::ReadBack;
use experts::ExpertShape;
use std::sync::{Arc, Mutex};

/// How router scores are computed (`--moe-router-score-function`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ScoreFunction {
    /// Softmax over the experts (before the top-k with `moe_router_pre_softmax`, else over
    /// the `k` chosen logits).
    Softmax,
    /// Sigmoid per expert, the `k` chosen normalised to sum to 1 when `k > 1`.
    Sigmoid,
}

/// Which tokens an expert over its capacity keeps (`--moe-token-drop-policy`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum DropPolicy {
    /// Those with the highest routing weight.
    Probs,
    /// The earliest in the sequence.
    Position,
}

/// How tokens reach their experts (`--moe-token-dispatcher-type`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum TokenDispatcherType {
    /// A variable-size all-to-all over the expert-parallel group.
    AllToAll,
    /// All-gather the group's tokens, reduce-scatter the outputs.
    AllGather,
}

/// A mixture-of-experts MLP, with Megatron's flag names and defaults.
///
/// ```
/// use burn_megatron::moe::MoeConfig;
/// let moe = MoeConfig::new(8).with_moe_router_topk(2).with_moe_aux_loss_coeff(1e-2);
/// assert!(moe.validate(1).is_ok());
/// assert!(moe.validate(3).unwrap_err().to_string().contains("8 experts over 3"));
/// ```
#[derive(Config, Debug)]
pub struct MoeConfig {
    /// Experts per MoE layer (`--num-experts`).
    pub num_experts: usize,
    /// Experts per token (`--moe-router-topk`).
    #[config(default = 2)]
    pub moe_router_topk: usize,
    /// Each expert's hidden size (`--moe-ffn-hidden-size`); the dense FFN size when unset.
    #[config(default = "None")]
    pub moe_ffn_hidden_size: Option<usize>,
    /// `--moe-router-score-function`.
    #[config(default = "ScoreFunction::Softmax")]
    pub moe_router_score_function: ScoreFunction,
    /// Softmax before the top-k (`--moe-router-pre-softmax`).
    #[config(default = false)]
    pub moe_router_pre_softmax: bool,
    /// Groups the experts are divided into for group-limited routing
    /// (`--moe-router-num-groups`, DeepSeek's device-limited routing); none when unset.
    #[config(default = "None")]
    pub moe_router_num_groups: Option<usize>,
    /// Groups each token may route to (`--moe-router-group-topk`): the groups with the
    /// largest sums of their top `topk / group_topk` scores, the experts chosen among theirs.
    #[config(default = "None")]
    pub moe_router_group_topk: Option<usize>,
    /// Multiplies the routing weights (`--moe-router-topk-scaling-factor`).
    #[config(default = "None")]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// Weight of the Switch-style load-balancing loss (`--moe-aux-loss-coeff`).
    #[config(default = 0.0)]
    pub moe_aux_loss_coeff: f64,
    /// Weight of the router z-loss (`--moe-z-loss-coeff`).
    #[config(default = "None")]
    pub moe_z_loss_coeff: Option<f64>,
    /// Tokens an expert takes at most, as a multiple of an even share
    /// (`--moe-expert-capacity-factor`); no limit when unset.
    #[config(default = "None")]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Fill every expert up to its capacity (`--moe-pad-expert-input-to-capacity`).
    #[config(default = false)]
    pub moe_pad_expert_input_to_capacity: bool,
    /// `--moe-token-drop-policy`.
    #[config(default = "DropPolicy::Probs")]
    pub moe_token_drop_policy: DropPolicy,
    /// `--moe-token-dispatcher-type`.
    #[config(default = "TokenDispatcherType::AllToAll")]
    pub moe_token_dispatcher_type: TokenDispatcherType,
    /// The inner size of a shared expert every token also goes through
    /// (`--moe-shared-expert-intermediate-size`); none when unset.
    #[config(default = "None")]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Scale the shared expert's output per token by `sigmoid(x · w)` (Qwen2-MoE's
    /// `shared_expert_gate`; `--moe-shared-expert-gate`).
    #[config(default = false)]
    pub moe_shared_expert_gate: bool,
}

impl MoeConfig {
    /// Checks the settings against an expert-parallel size `ep`, naming the numbers.
    pub fn validate(&self, ep: usize) -> Result<(), TpError> {
        let (e, k) = (self.num_experts, self.moe_router_topk);
        let invalid = |m: String| Err(TpError::Invalid(m));
        if e == 0 || k == 0 {
            return invalid(format!(
                "--num-experts {e} and --moe-router-topk {k} must be ≥ 1"
            ));
        }
        if k > e {
            return invalid(format!(
                "--moe-router-topk {k} is greater than --num-experts {e}"
            ));
        }
        if ep == 0 || !e.is_multiple_of(ep) {
            return invalid(format!(
                "{e} experts over {ep} expert-parallel ranks: --num-experts must be divisible \
                 by --expert-model-parallel-size"
            ));
        }
        match (self.moe_router_num_groups, self.moe_router_group_topk) {
            (None, None) => {}
            (Some(g), Some(gk)) => {
                if g == 0 || !e.is_multiple_of(g) || gk == 0 || gk > g || !k.is_multiple_of(gk) {
                    return invalid(format!(
                        "--moe-router-num-groups {g} and --moe-router-group-topk {gk} with {e} \
                         experts and --moe-router-topk {k}: the groups must divide the \
                         experts, and the group top-k be at most the groups and divide the top-k"
                    ));
                }
                if k / gk > e / g {
                    return invalid(format!(
                        "--moe-router-topk {k} over --moe-router-group-topk {gk} groups of \
                         {} experts: each group's top {} do not fit in it",
                        e / g,
                        k / gk
                    ));
                }
            }
            (g, gk) => {
                return invalid(format!(
                    "--moe-router-num-groups ({g:?}) and --moe-router-group-topk ({gk:?}) go \
                     together"
                ));
            }
        }
        if let Some(f) = self.moe_expert_capacity_factor
            && !(f > 0.0 && f.is_finite())
        {
            return invalid(format!(
                "--moe-expert-capacity-factor must be positive, got {f}"
            ));
        }
        if self.moe_shared_expert_intermediate_size == Some(0)
            || self.moe_shared_expert_gate && self.moe_shared_expert_intermediate_size.is_none()
        {
            return invalid(
                "--moe-shared-expert-intermediate-size must be ≥ 1, and is needed by \
                 --moe-shared-expert-gate"
                    .into(),
            );
        }
        if self.moe_pad_expert_input_to_capacity && self.moe_expert_capacity_factor.is_none() {
            return invalid(
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor".into(),
            );
        }
        if self.moe_router_score_function == ScoreFunction::Softmax
            && k == 1
            && !self.moe_router_pre_softmax
        {
            return invalid(
                "--moe-router-topk 1 with softmax after the top-k gives every token weight 1; \
                 use --moe-router-pre-softmax"
                    .into(),
            );
        }
        let coeffs = [
            ("--moe-aux-loss-coeff", Some(self.moe_aux_loss_coeff)),
            ("--moe-z-loss-coeff", self.moe_z_loss_coeff),
            (
                "--moe-router-topk-scaling-factor",
                self.moe_router_topk_scaling_factor,
            ),
        ];
        for (name, value) in coeffs {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return invalid(format!("{name} must be finite and ≥ 0, got {v}"));
            }
        }
        Ok(())
    }
}

/// The layout-independent name of a parameter named `name` on a rank whose first expert is
/// `first_expert`: each local expert `moe.local_experts.{i}` becomes
/// `moe.experts.{first_expert + i}`, so that checkpoints key experts by their global index
/// and a run saved at one expert-parallel size loads at another.
///
/// ```
/// use burn_megatron::moe::global_expert_name;
/// assert_eq!(
///     global_expert_name("layers.3.moe.local_experts.1.linear_fc1", 4),
///     "layers.3.moe.experts.5.linear_fc1"
/// );
/// assert_eq!(global_expert_name("layers.3.moe.router", 4), "layers.3.moe.router");
/// ```
pub fn global_expert_name(name: &str, first_expert: usize) -> String {
    const LOCAL: &str = "moe.local_experts.";
    let Some((head, tail)) = name.split_once(LOCAL) else {
        return name.to_string();
    };
    match tail
        .split_once('.')
        .and_then(|(i, rest)| Some((i.parse::<usize>().ok()?, rest)))
    {
        Some((i, rest)) => format!("{head}moe.experts.{}.{rest}", first_expert + i),
        None => name.to_string(),
    }
}

/// What one MoE layer saw in its forwards since its stats were last taken: for the log
/// line ([`MoeLayer::take_stats`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeLayerStats {
    /// Forwards counted.
    pub forwards: usize,
    /// The sum over those forwards of the load-balancing loss without its coefficient
    /// (Megatron logs it so: about 1 when the experts are balanced), this rank's part when
    /// the tokens are split over TP; 0 when the loss is off.
    pub load_balancing_loss: f64,
    /// Tokens routed to each expert (before dropping) over those forwards, summed over the
    /// ranks the layer's tokens are split over.
    pub tokens_per_expert: Vec<usize>,
}

/// [`MoeLayerStats`] being counted: the load-balancing losses summed on the device, read
/// once when the stats are taken (not in every forward).
#[derive(Debug, Default)]
struct StatsSoFar {
    stats: MoeLayerStats,
    load_balancing_loss: Option<Tensor<1>>,
}

/// The groups an MoE layer's experts are split over: whole experts over expert parallelism,
/// each expert's weights over expert tensor parallelism (Megatron's `ep` and `expt_tp`
/// process groups). [`RankGroups::experts`](crate::launch::RankGroups::experts) gives a
/// rank's.
#[derive(Debug, Clone)]
pub struct ExpertGroups {
    /// The expert-parallel group (`--expert-model-parallel-size`), which exchanges tokens.
    pub ep: Comm,
    /// The expert tensor-parallel group (`--expert-tensor-parallel-size`): this rank alone,
    /// or the tensor-parallel group's ranks.
    pub etp: Comm,
}

impl ExpertGroups {
    /// Every expert, whole, on this rank.
    pub fn solo() -> Self {
        Self {
            ep: crate::comm::solo_group("ep"),
            etp: crate::comm::solo_group("etp"),
        }
    }
}

/// A mixture-of-experts MLP: router, token dispatch over the expert-parallel group, and
/// this rank's experts (its slices of them under expert tensor parallelism).
#[derive(Module, Debug)]
pub struct MoeLayer {
    /// The router's weight, `[num_experts, hidden]`, FP32 logits.
    pub router: Param<Tensor<2>>,
    /// This rank's experts: global experts `ep_rank · L .. (ep_rank + 1) · L`.
    pub local_experts: Vec<ExpertMlp>,
    /// The shared expert, when configured.
    pub shared_expert: Option<SharedExpert>,
    #[module(skip)]
    config: MoeConfig,
    #[module(skip)]
    experts: ExpertGroups,
    #[module(skip)]
    tp: Comm,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    stats: Arc<Mutex<StatsSoFar>>,
    #[module(skip)]
    layout: LayoutOwner,
}

/// The dense layer's settings an MoE layer takes over.
#[derive(Debug, Clone, Copy)]
pub struct MoeLayerShape {
    /// Model width.
    pub hidden_size: usize,
    /// Dense FFN width (each expert's unless `moe_ffn_hidden_size`).
    pub ffn_hidden_size: usize,
    /// SwiGLU-style experts.
    pub gated_linear_unit: bool,
    /// The experts' activation.
    pub activation: ActivationFunc,
    /// Weight initialisation.
    pub initializer: MasterInit,
    /// The down projections' initialisation.
    pub output_initializer: MasterInit,
    /// Whether the layer's activations are split along the sequence over `tp`.
    pub sequence_parallel: bool,
    /// The layer's seed.
    pub seed: u64,
}

impl MoeConfig {
    /// This rank's MoE layer: its share of the experts over `experts.ep`, each split over
    /// `experts.etp`; `tp` is the tensor-parallel group the layer's tokens are split over (by
    /// sequence parallelism, or inside the layer when it is off: each TP rank routes its part
    /// of the sequence, as Megatron-Core's sequence-parallel MoE does). An expert
    /// tensor-parallel group of more than one rank must be `tp`'s ranks.
    pub fn init(
        &self,
        shape: MoeLayerShape,
        tp: &Comm,
        experts: &ExpertGroups,
        device: &Device,
    ) -> Result<MoeLayer, TpError> {
        let n = experts.ep.group().size();
        self.validate(n)?;
        let etp = experts.etp.group();
        if etp.size() > 1 && (etp.size(), etp.rank()) != (tp.group().size(), tp.group().rank()) {
            return Err(TpError::Invalid(format!(
                "the experts' tensor-parallel group {etp} is not the tensor-parallel group {}: \
                 --expert-tensor-parallel-size must be 1 or the tensor-parallel size",
                tp.group()
            )));
        }
        let local = self.num_experts / n;
        let first = experts.ep.group().rank() * local;
        let split = (etp.rank(), etp.size());
        let expert_shape = ExpertShape {
            hidden: shape.hidden_size,
            ffn: self.moe_ffn_hidden_size.unwrap_or(shape.ffn_hidden_size),
            gated: shape.gated_linear_unit,
            activation: shape.activation,
            initializer: shape.initializer,
            output_initializer: shape.output_initializer,
            seed: shape.seed,
        };
        let local_experts = (first..first + local)
            .map(|g| expert_shape.init(g, split, device))
            .collect::<Result<Vec<_>, _>>()?;
        let shared_expert = self
            .moe_shared_expert_intermediate_size
            .map(|ffn| {
                let shared = ExpertShape {
                    ffn,
                    ..expert_shape
                };
                let gate = self.moe_shared_expert_gate;
                SharedExpert::init(shared, gate, shape.sequence_parallel, tp, device)
            })
            .transpose()?;
        let (e, h) = (self.num_experts, shape.hidden_size);
        let values = shape
            .initializer
            .values(e * h, h, derive_seed(shape.seed, "router"));
        let layer = MoeLayer {
            router: host_param(values, [e, h], device),
            local_experts,
            shared_expert,
            config: self.clone(),
            experts: experts.clone(),
            tp: tp.clone(),
            sequence_parallel: shape.sequence_parallel,
            stats: Arc::default(),
            layout: LayoutOwner::default(),
        };
        layer.state_attrs();
        Ok(layer)
    }
}

impl MoeLayer {
    fn state_attrs(&self) {
        // Each TP rank routes its own part of the sequence: the router's gradient is summed
        // over TP, as a sequence-parallel LayerNorm's.
        let attrs = if self.tp.group().size() > 1 {
            ParallelAttrs::sequence_parallel()
        } else {
            ParallelAttrs::default()
        };
        self.layout.state(self.router.id, attrs);
    }

    /// The layer's settings.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The global index of this rank's first expert.
    pub fn first_expert(&self) -> usize {
        self.experts.ep.group().rank() * self.local_experts.len()
    }

    /// What the forwards since the last call saw (and starts counting afresh).
    pub fn take_stats(&self) -> MoeLayerStats {
        let so_far = std::mem::take(&mut *crate::comm::lock(&self.stats));
        let mut stats = so_far.stats;
        if let Some(sum) = so_far.load_balancing_loss {
            let sum: f32 = sum.read_back().iter::<f32>().next().unwrap_or(f32::NAN);
            stats.load_balancing_loss = f64::from(sum) / self.config.moe_aux_loss_coeff;
        }
        stats
    }

    /// Every expert of the layer, whole, by global index: each expert's weights by name
    /// (`linear_fc1_gate` when gated, `linear_fc1`, `linear_fc2`), detached, gathered over
    /// the expert tensor-parallel and expert-parallel groups (for an export). Collective over
    /// both.
    pub fn gather_experts(&self) -> Result<Vec<Vec<(&'static str, Tensor<2>)>>, TpError> {
        let (ep, etp) = (&self.experts.ep, &self.experts.etp);
        let n = ep.group().size();
        let gather = |p: &Param<Tensor<2>>, dim: usize| -> Result<Vec<Tensor<2>>, TpError> {
            let whole = crate::comm::tensor::all_gather(&**etp, p.val().detach(), dim)?;
            let all: Tensor<3> = crate::comm::tensor::all_gather(&**ep, whole.unsqueeze(), 0)?;
            Ok((0..n)
                .map(|r| all.clone().narrow(0, r, 1).squeeze_dim::<2>(0))
                .collect())
        };
        let mut by_rank: Vec<Vec<Vec<(&'static str, Tensor<2>)>>> = vec![Vec::new(); n];
        for e in &self.local_experts {
            let weights = [
                ("linear_fc1_gate", e.linear_fc1_gate.as_ref(), 1),
                ("linear_fc1", Some(&e.linear_fc1), 1),
                ("linear_fc2", Some(&e.linear_fc2), 0),
            ];
            let mut per_rank: Vec<Vec<(&'static str, Tensor<2>)>> = vec![Vec::new(); n];
            for (name, p, dim) in weights {
                let Some(p) = p else { continue };
                for (r, t) in gather(p, dim)?.into_iter().enumerate() {
                    per_rank[r].push((name, t));
                }
            }
            for (r, expert) in per_rank.into_iter().enumerate() {
                by_rank[r].push(expert);
            }
        }
        Ok(by_rank.into_iter().flatten().collect())
    }

    /// Router logits (`[T, E]`, FP32) of `tokens` (`[T, hidden]`).
    pub fn router_logits(&self, tokens: Tensor<2>) -> Tensor<2> {
        tokens
            .cast(DType::F32)
            .matmul(self.router.val().cast(DType::F32).transpose())
    }

    /// `x` (`[s, b, hidden]`, this rank's tokens) through the experts the router picks.
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, TpError> {
        self.state_attrs();
        let _span = tracing::debug_span!("moe").entered();
        let dtype = x.dtype();
        let shared = self.shared_expert.as_ref().map(|e| e.forward(x.clone()));
        // Without sequence parallelism every TP rank holds the whole sequence: each routes
        // its part, and the outputs are gathered back.
        let tp = self.tp.group().size();
        let whole = tp > 1 && !self.sequence_parallel;
        let divisible = x.dims()[0].is_multiple_of(tp);
        // A sequence that does not split (a decoding step) is routed whole on every rank:
        // the outputs are right, but an expert shared by TP ranks would see its tokens
        // twice in backward, so only untracked activations may take that path.
        if whole && !divisible && x.is_tracked() {
            return Err(TpError::Invalid(format!(
                "a mixture-of-experts layer splits the sequence over tensor parallelism: \
                 {} tokens do not split over {tp} ranks (train with a sequence length \
                 divisible by the TP size, or run inference on an untracked model)",
                x.dims()[0]
            )));
        }
        let split = whole && divisible;
        let x = if split {
            scatter_to_sequence_parallel_region(x, &self.tp)
        } else {
            x
        };
        let [s, b, h] = x.dims();
        let tokens = x.reshape([s * b, h]);
        let span = tracing::debug_span!("moe.router").entered();
        let routed = route(&self.config, self.router_logits(tokens.clone()), &self.tp)?;
        drop(span);
        let routing = &routed.routing;
        let out = match self.config.moe_token_dispatcher_type {
            TokenDispatcherType::AllToAll => {
                dispatcher::alltoall(tokens, routing, &self.local_experts, &self.experts)?
            }
            TokenDispatcherType::AllGather => {
                dispatcher::allgather(tokens, routing, &self.local_experts, &self.experts)?
            }
        };
        let mut out = out.cast(dtype);
        let aux = (routed.aux_loss.as_ref()).map(|a| a.clone().detach().cast(DType::F32));
        for loss in [routed.aux_loss, routed.z_loss].into_iter().flatten() {
            out = attach_aux_loss(out, loss);
        }
        let mut so_far = crate::comm::lock(&self.stats);
        if let Some(aux) = aux {
            so_far.load_balancing_loss = Some(match so_far.load_balancing_loss.take() {
                Some(sum) => sum + aux,
                None => aux,
            });
        }
        let stats = &mut so_far.stats;
        stats.forwards += 1;
        let counts = &routed.routing.tokens_per_expert;
        stats.tokens_per_expert.resize(counts.len(), 0);
        for (total, c) in stats.tokens_per_expert.iter_mut().zip(counts) {
            *total += c;
        }
        drop(so_far);
        let out = out.reshape([s, b, h]);
        let out = if split {
            gather_from_sequence_parallel_region(out, &self.tp, false)
        } else {
            out
        };
        Ok(match shared {
            Some(shared) => out + shared,
            None => out,
        })
    }
}
