//! The distributed optimizer (ZeRO-1) around a burn-optim optimizer: this data-parallel
//! rank's pieces of the trainable parameters (from its [`ShardPlan`]s) are the 1-D FP32
//! parameters of a module of their own, which the burn-optim optimizer steps. Adam's update
//! is element-wise, so stepping a piece is stepping those elements of the whole parameter.

use super::fused_adam::{Place, Replace, Sharding, gather_pieces};
use super::grad_norm::{NormType, clip_coefficient};
use super::megatron::{OptimizerError, to_model_dtype};
use crate::comm::{Comm, CommError, CommunicatorExt};
use crate::data_parallel::ShardPlan;
use crate::param_grads::with_flat;
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::multi_tensor_sum_of_squares;
use std::collections::HashMap;

/// One piece of a parameter: elements `[start, start + len)` of its flattened value.
#[derive(Debug, Clone)]
struct Piece {
    param: ParamId,
    rank: usize,
    start: usize,
    len: usize,
    dtype: DType,
    place: Place,
}

/// This rank's FP32 master pieces, as parameters a burn-optim optimizer can step.
#[derive(Module, Debug)]
pub(crate) struct Pieces {
    parts: Vec<Param<Tensor<1>>>,
}

/// What one step measured before the reduction: flags and norm parts.
pub(crate) struct Measured {
    grads: Vec<Tensor<1>>,
    pub(crate) non_finite: bool,
    pub(crate) norm_part: f64,
}

pub(crate) struct ShardedBurn {
    inner: ModuleOptimizer,
    pieces: Vec<Piece>,
    master: Option<Pieces>,
    pub(crate) sharding: Sharding,
}

impl ShardedBurn {
    pub(crate) fn new<M: Module>(
        inner: ModuleOptimizer,
        model: &M,
        plans: Vec<ShardPlan>,
        dp: Comm,
    ) -> Result<Self, CommError> {
        let (size, rank) = (dp.group().size(), dp.group().rank());
        if let Some(p) = plans.iter().find(|p| (p.size(), p.rank()) != (size, rank)) {
            return Err(CommError::InvalidArgument {
                group: dp.group().to_string(),
                op: "distributed optimizer",
                reason: format!(
                    "a plan is for rank {} of {}, the group has this rank at {rank} of {size}",
                    p.rank(),
                    p.size()
                ),
            });
        }
        let values = flat_values(model);
        let mut pieces = Vec::new();
        let mut parts = Vec::new();
        for (plan, shard) in plans.iter().enumerate() {
            for p in shard.pieces() {
                let Some(v) = values.get(&p.id) else { continue };
                let part = v.clone().cast(DType::F32).narrow(0, p.start, p.len);
                parts.push(Param::from_tensor(part.detach().require_grad()));
                pieces.push(Piece {
                    param: p.id,
                    rank: p.rank,
                    start: p.start,
                    len: p.len,
                    dtype: v.dtype(),
                    place: Place {
                        plan,
                        bucket: p.bucket,
                        at: p.at,
                    },
                });
            }
        }
        Ok(Self {
            inner,
            pieces,
            master: Some(Pieces { parts }),
            sharding: Sharding { plans, dp },
        })
    }

    /// Elements of FP32 master weights this rank holds.
    pub(crate) fn state_elements(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// This rank's unscaled gradient pieces, with their overflow flag and norm part (pieces
    /// of duplicated parameters counted on TP rank 0 only, as without sharding).
    pub(crate) fn measure(
        &self,
        grads: &GradientsParams,
        tp_rank: usize,
        norm_type: NormType,
        inv_scale: f64,
    ) -> Measured {
        let grads: Vec<Tensor<1>> = self
            .pieces
            .iter()
            .zip(&self.master.as_ref().expect("between steps").parts)
            .map(|(p, part)| {
                let g = with_flat(grads, p.param, p.rank, |g| g.cast(DType::F32))
                    .map(|g| g.narrow(0, p.start, p.len))
                    .unwrap_or_else(|| part.val().inner().zeros_like());
                if inv_scale == 1.0 { g } else { g * inv_scale }
            })
            .collect();
        let non_finite = grads.iter().any(|g| {
            let finite: Tensor<1> = g.clone().is_finite().float();
            g.dims()[0] > 0 && finite.min().into_scalar::<f32>() < 1.0
        });
        let counted: Vec<Tensor<1>> = self
            .pieces
            .iter()
            .zip(&grads)
            .filter(|(p, _)| parallel_attrs(p.param).counts_in_grad_norm(tp_rank))
            .map(|(_, g)| g.clone())
            .collect();
        let norm_part = match norm_type {
            NormType::L2 if counted.is_empty() => 0.0,
            NormType::L2 => multi_tensor_sum_of_squares(&counted)
                .expect("the gradients of one module share a device")
                .into_data()
                .iter::<f32>()
                .map(f64::from)
                .sum(),
            NormType::Inf => counted
                .iter()
                .filter(|g| g.dims()[0] > 0)
                .map(|g| f64::from(g.clone().abs().max().into_scalar::<f32>()))
                .fold(0.0, f64::max),
        };
        Measured {
            grads,
            non_finite,
            norm_part,
        }
    }

    /// Clips the measured pieces, decays the master pieces of weight-decayed parameters
    /// (`factor`, Megatron's no-decay group being the 1-D ones), steps them, and returns
    /// `model` with the all-gathered weights.
    pub(crate) fn apply<M: Module>(
        &mut self,
        measured: Measured,
        lr: f64,
        clip: f64,
        norm: f64,
        decay: Option<f64>,
        model: M,
    ) -> Result<(M, f64), OptimizerError> {
        let coeff = clip_coefficient(clip, norm);
        let master = self.master.take().expect("between steps");
        let mut grads = GradientsParams::new();
        let parts: Vec<Param<Tensor<1>>> = master
            .parts
            .into_iter()
            .zip(measured.grads)
            .zip(&self.pieces)
            .map(|((part, g), piece)| {
                let g = if coeff == 1.0 { g } else { g * coeff };
                grads.register(part.id, g);
                match decay.filter(|_| piece.rank > 1) {
                    Some(f) => part.map(|t| t.mul_scalar(f).detach().require_grad()),
                    None => part,
                }
            })
            .collect();
        let stepped = self.inner.step(lr, Pieces { parts }, grads);
        let placed: Vec<(Place, Tensor<1>)> = self
            .pieces
            .iter()
            .zip(&stepped.parts)
            .map(|(p, part)| (p.place, to_model_dtype(part.val().detach(), p.dtype)))
            .collect();
        self.master = Some(stepped);
        let device = self.device();
        let values = gather_pieces(&self.sharding, &device, placed, |d| d)?;
        Ok((model.map(&mut Replace(values)), coeff))
    }

    fn device(&self) -> burn::tensor::Device {
        self.master
            .as_ref()
            .and_then(|m| m.parts.first())
            .map_or_else(burn::tensor::Device::flex, |p| p.val().device())
    }

    /// The data-parallel group.
    pub(crate) fn dp(&self) -> &Comm {
        &self.sharding.dp
    }

    /// The flag and norm parts of every data-parallel rank, combined in f64 in rank order.
    pub(crate) fn combine(
        &self,
        measured: &mut Measured,
        norm_type: NormType,
    ) -> Result<(), CommError> {
        let mine = vec![
            i64::from(measured.non_finite),
            measured.norm_part.to_bits() as i64,
        ];
        let all = self.sharding.dp.all_gather_vec(mine)?;
        measured.non_finite = all.chunks(2).any(|c| c[0] != 0);
        let parts = all.chunks(2).map(|c| f64::from_bits(c[1] as u64));
        measured.norm_part = match norm_type {
            NormType::L2 => parts.sum(),
            NormType::Inf => parts.fold(0.0, f64::max),
        };
        Ok(())
    }
}

/// Each float parameter's flattened value (no autodiff), by id.
fn flat_values<M: Module>(model: &M) -> HashMap<ParamId, Tensor<1>> {
    struct Values(HashMap<ParamId, Tensor<1>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if p.val().is_require_grad() {
                self.0.insert(p.id, p.val().detach().reshape([-1]));
            }
        }
    }
    let mut v = Values(HashMap::new());
    model.visit(&mut v);
    v.0
}
