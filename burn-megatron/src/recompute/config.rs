//! Which activations a transformer recomputes: Megatron's `--recompute-granularity`,
//! `--recompute-method`, `--recompute-num-layers` and `--recompute-modules`, checked as
//! Megatron-Core's `TransformerConfig` checks them.

use burn::config::Config;
use std::ops::Range;

/// What is recomputed (Megatron's `--recompute-granularity`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RecomputeGranularity {
    /// Whole layers keep only their input (`full`; with a [`RecomputeMethod`]).
    Full,
    /// Only the [`RecomputeModule`]s inside each layer (`selective`).
    Selective,
}

/// Which layers `full` recomputes (Megatron's `--recompute-method`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// Every layer, in regions of `--recompute-num-layers` layers: each region keeps only
    /// its input.
    Uniform,
    /// The first `--recompute-num-layers` layers of each pipeline chunk, one region each;
    /// the rest keep their activations.
    Block,
}

/// A sub-module whose activations `selective` drops (Megatron's `--recompute-modules`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RecomputeModule {
    /// Attention's core: scores, softmax, dropout and the weighted values (the `s²` terms).
    CoreAttn,
    /// The MLP: its `ffn`-wide activations.
    Mlp,
    /// The pre-norm layers' norms: their outputs, and under sequence parallelism the
    /// gathered copies the next linear layers keep (see [`recompute_linear_input`]). The MLP's
    /// norm is left alone where `mlp` recomputes the MLP, or in an MoE layer.
    ///
    /// [`recompute_linear_input`]: super::recompute_linear_input
    Layernorm,
    /// The dense MLP's activation output (the second layer's input): backward forms it
    /// again from the first layers' outputs, which the activation kept anyway (see
    /// [`recompute_row_linear_input`]). Megatron-Core's `moe_act` does this for experts;
    /// this is it for a dense MLP (MindSpeed's `--recompute-activation-function`). Left
    /// alone where `mlp` recomputes the MLP, or in an MoE layer.
    ///
    /// [`recompute_row_linear_input`]: super::recompute_row_linear_input
    MlpAct,
}

impl RecomputeModule {
    /// The name in `--recompute-modules` (Megatron's `core_attn`, `mlp`, `layernorm`; and
    /// `mlp_act`).
    pub fn name(self) -> &'static str {
        match self {
            Self::CoreAttn => "core_attn",
            Self::Mlp => "mlp",
            Self::Layernorm => "layernorm",
            Self::MlpAct => "mlp_act",
        }
    }
}

impl std::str::FromStr for RecomputeModule {
    type Err = RecomputeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::CoreAttn, Self::Mlp, Self::Layernorm, Self::MlpAct]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                RecomputeError(format!(
                    "unknown --recompute-modules entry {s:?} (known: core_attn, mlp, layernorm, mlp_act)"
                ))
            })
    }
}

/// An invalid recomputation setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RecomputeError(pub String);

/// Activation recomputation of a transformer's layers. The default recomputes nothing.
#[derive(Config, Debug, PartialEq)]
pub struct RecomputeConfig {
    /// `None`: keep every activation.
    #[config(default = "None")]
    pub granularity: Option<RecomputeGranularity>,
    /// With `full`: which layers.
    #[config(default = "None")]
    pub method: Option<RecomputeMethod>,
    /// With `full`: layers per region (`uniform`) or recomputed layers per chunk (`block`).
    #[config(default = "None")]
    pub num_layers: Option<usize>,
    /// With `selective`: which sub-modules (Megatron's default: `core_attn`).
    #[config(default = "vec![RecomputeModule::CoreAttn]")]
    pub modules: Vec<RecomputeModule>,
}

impl RecomputeConfig {
    /// Checks the combination as Megatron-Core does, for a pipeline rank holding
    /// `layers_per_rank` layers; the error names the flags.
    pub fn check(&self, layers_per_rank: usize) -> Result<(), RecomputeError> {
        let err = |m: String| Err(RecomputeError(m));
        match self.granularity {
            Some(RecomputeGranularity::Full) => {
                if self.method.is_none() {
                    return err(
                        "--recompute-granularity full needs --recompute-method (uniform or block)"
                            .into(),
                    );
                }
                match self.num_layers {
                    Some(n) if (1..=layers_per_rank.max(1)).contains(&n) => Ok(()),
                    n => err(format!(
                        "--recompute-num-layers must lie between 1 and the {layers_per_rank} layers of a pipeline rank with --recompute-granularity full, got {}",
                        n.map_or("none".to_string(), |n| n.to_string())
                    )),
                }
            }
            Some(RecomputeGranularity::Selective) => {
                if let Some(m) = self.method {
                    return err(format!(
                        "--recompute-method {m:?} applies only to --recompute-granularity full, not selective"
                    ));
                }
                if self.num_layers.is_some() {
                    return err("--recompute-num-layers applies only to --recompute-granularity full, not selective".into());
                }
                if self.modules.is_empty() {
                    return err("--recompute-granularity selective needs at least one --recompute-modules entry".into());
                }
                Ok(())
            }
            None => {
                if self.method.is_some() || self.num_layers.is_some() {
                    return err("--recompute-method and --recompute-num-layers need --recompute-granularity full".into());
                }
                Ok(())
            }
        }
    }

    /// Whether `selective` recomputes `module` in every layer.
    pub fn selects(&self, module: RecomputeModule) -> bool {
        self.granularity == Some(RecomputeGranularity::Selective) && self.modules.contains(&module)
    }

    /// A pipeline chunk of `layers` layers as consecutive runs, each with whether it is one
    /// recomputed region (`full`), or its layers run one by one.
    pub fn layer_regions(&self, layers: usize) -> Vec<(Range<usize>, bool)> {
        let n = self.num_layers.unwrap_or(1).max(1);
        match (self.granularity, self.method) {
            (Some(RecomputeGranularity::Full), Some(RecomputeMethod::Uniform)) => (0..layers)
                .step_by(n)
                .map(|l| (l..(l + n).min(layers), true))
                .collect(),
            (Some(RecomputeGranularity::Full), Some(RecomputeMethod::Block)) => {
                let k = n.min(layers);
                let mut runs: Vec<_> = (0..k).map(|l| (l..l + 1, true)).collect();
                if k < layers {
                    runs.push((k..layers, false));
                }
                runs
            }
            _ if layers == 0 => Vec::new(),
            _ => vec![(0..layers, false)],
        }
    }
}
