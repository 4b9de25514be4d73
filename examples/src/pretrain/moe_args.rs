//! `gpt_pretrain`'s mixture-of-experts flags (Megatron's names and defaults).

use super::args::{Domain, check_float};
use burn_megatron::moe::{DropPolicy, MoeConfig, ScoreFunction, TokenDispatcherType};
use clap::{Args, ValueEnum};

/// `--moe-router-score-function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RouterScore {
    /// Softmax over the experts.
    Softmax,
    /// Sigmoid per expert.
    Sigmoid,
}

/// `--moe-token-drop-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenDrop {
    /// Keep the tokens with the highest routing weight.
    Probs,
    /// Keep the earliest tokens.
    Position,
}

/// `--moe-token-dispatcher-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dispatcher {
    /// A variable-size all-to-all over the expert-parallel group.
    Alltoall,
    /// All-gather the group's tokens, reduce-scatter the outputs.
    Allgather,
}

/// Mixture of experts: with `--num-experts`, the MLPs of the layers `--moe-layer-freq`
/// picks become routed experts, split over `--expert-model-parallel-size` ranks.
#[derive(Debug, Clone, Args)]
pub struct MoeArgs {
    /// Experts per MoE layer (none: a dense model).
    #[arg(long)]
    pub num_experts: Option<usize>,
    /// Experts each token is routed to.
    #[arg(long, default_value_t = 2)]
    pub moe_router_topk: usize,
    /// Each expert's hidden size (default: --ffn-hidden-size).
    #[arg(long)]
    pub moe_ffn_hidden_size: Option<usize>,
    /// Every N-th layer, from the first, is an MoE layer.
    #[arg(long, default_value_t = 1)]
    pub moe_layer_freq: usize,
    /// How router scores are computed.
    #[arg(long, value_enum, default_value_t = RouterScore::Softmax)]
    pub moe_router_score_function: RouterScore,
    /// Softmax before the top-k (else over the k chosen logits).
    #[arg(long)]
    pub moe_router_pre_softmax: bool,
    /// Multiplies the routing weights.
    #[arg(long)]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// Groups the experts are divided into for group-limited routing (with
    /// --moe-router-group-topk; DeepSeek's device- or node-limited routing).
    #[arg(long)]
    pub moe_router_num_groups: Option<usize>,
    /// Groups each token may route to: those whose top (top-k / group top-k) scores sum
    /// highest.
    #[arg(long)]
    pub moe_router_group_topk: Option<usize>,
    /// Weight of the load-balancing loss.
    #[arg(long, default_value_t = 0.0)]
    pub moe_aux_loss_coeff: f64,
    /// Weight of the router z-loss.
    #[arg(long)]
    pub moe_z_loss_coeff: Option<f64>,
    /// Tokens an expert takes at most, as a multiple of an even share (none: no limit).
    #[arg(long)]
    pub moe_expert_capacity_factor: Option<f64>,
    /// Fill every expert up to its capacity.
    #[arg(long)]
    pub moe_pad_expert_input_to_capacity: bool,
    /// Which tokens an expert over its capacity keeps.
    #[arg(long, value_enum, default_value_t = TokenDrop::Probs)]
    pub moe_token_drop_policy: TokenDrop,
    /// How tokens reach their experts.
    #[arg(long, value_enum, default_value_t = Dispatcher::Alltoall)]
    pub moe_token_dispatcher_type: Dispatcher,
    /// The inner size of a shared expert every token also goes through (none: no shared
    /// expert).
    #[arg(long)]
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Scale the shared expert's output per token by a learned sigmoid gate (Qwen2-MoE).
    #[arg(long)]
    pub moe_shared_expert_gate: bool,
}

impl MoeArgs {
    /// The MoE settings of these flags (`None` without `--num-experts`).
    pub fn config(&self) -> Option<MoeConfig> {
        let experts = self.num_experts?;
        Some(
            MoeConfig::new(experts)
                .with_moe_router_topk(self.moe_router_topk)
                .with_moe_ffn_hidden_size(self.moe_ffn_hidden_size)
                .with_moe_router_score_function(match self.moe_router_score_function {
                    RouterScore::Softmax => ScoreFunction::Softmax,
                    RouterScore::Sigmoid => ScoreFunction::Sigmoid,
                })
                .with_moe_router_pre_softmax(self.moe_router_pre_softmax)
                .with_moe_router_topk_scaling_factor(self.moe_router_topk_scaling_factor)
                .with_moe_router_num_groups(self.moe_router_num_groups)
                .with_moe_router_group_topk(self.moe_router_group_topk)
                .with_moe_aux_loss_coeff(self.moe_aux_loss_coeff)
                .with_moe_z_loss_coeff(self.moe_z_loss_coeff)
                .with_moe_expert_capacity_factor(self.moe_expert_capacity_factor)
                .with_moe_pad_expert_input_to_capacity(self.moe_pad_expert_input_to_capacity)
                .with_moe_token_drop_policy(match self.moe_token_drop_policy {
                    TokenDrop::Probs => DropPolicy::Probs,
                    TokenDrop::Position => DropPolicy::Position,
                })
                .with_moe_token_dispatcher_type(match self.moe_token_dispatcher_type {
                    Dispatcher::Alltoall => TokenDispatcherType::AllToAll,
                    Dispatcher::Allgather => TokenDispatcherType::AllGather,
                })
                .with_moe_shared_expert_intermediate_size(self.moe_shared_expert_intermediate_size)
                .with_moe_shared_expert_gate(self.moe_shared_expert_gate),
        )
    }

    /// The checks that need the layout: experts over `ep` ranks, sequences of `seq` tokens
    /// at TP `tp` (an MoE layer splits the sequence over TP).
    pub fn validate(&self, (ep, etp): (usize, usize), tp: usize, seq: usize) -> Result<(), String> {
        let floats = [
            (
                "--moe-router-topk-scaling-factor",
                self.moe_router_topk_scaling_factor,
                Domain::Positive,
            ),
            (
                "--moe-aux-loss-coeff",
                Some(self.moe_aux_loss_coeff),
                Domain::NonNegative,
            ),
            (
                "--moe-z-loss-coeff",
                self.moe_z_loss_coeff,
                Domain::NonNegative,
            ),
            (
                "--moe-expert-capacity-factor",
                self.moe_expert_capacity_factor,
                Domain::Positive,
            ),
        ];
        for (flag, value, domain) in floats {
            if let Some(value) = value {
                check_float(flag, value, domain)?;
            }
        }
        let Some(config) = self.config() else {
            if ep > 1 || etp > 1 {
                return Err(format!(
                    "--expert-model-parallel-size {ep} and --expert-tensor-parallel-size {etp} \
                     without --num-experts: nothing to split"
                ));
            }
            return Ok(());
        };
        config.validate(ep).map_err(|e| e.to_string())?;
        if self.moe_layer_freq == 0 {
            return Err("--moe-layer-freq must be at least 1".into());
        }
        if !seq.is_multiple_of(tp) {
            return Err(format!(
                "--seq-length {seq} must be divisible by --tensor-model-parallel-size {tp}: \
                 each TP rank routes its part of the sequence"
            ));
        }
        Ok(())
    }
}
