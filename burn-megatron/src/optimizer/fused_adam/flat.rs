//! The flat state and the step: gradients taken per group, measured in one read-back,
//! and stepped by one fused kernel per group.

use super::config::{FusedAdam, FusedAdamConfig};
use super::mappers::walk;
use crate::optimizer::NormType;
use crate::optimizer::cast::{half_dtype, to_model_dtype};
use crate::param_grads::with_flat;
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_megatron_kernels::device::ReadBack;
use burn_megatron_kernels::{
    AdamHyper, FlatAdamState, KernelError, WeightDecay, master_to_model_segments,
    multi_tensor_fused_adam_step, multi_tensor_sum_of_squares,
};

/// Which flat buffer of the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buffer {
    Master,
    ExpAvg,
    ExpAvgSq,
}

impl Buffer {
    pub(crate) const ALL: [Buffer; 3] = [Buffer::Master, Buffer::ExpAvg, Buffer::ExpAvgSq];

    pub(crate) fn file_stem(self) -> &'static str {
        match self {
            Buffer::Master => "master",
            Buffer::ExpAvg => "exp_avg",
            Buffer::ExpAvgSq => "exp_avg_sq",
        }
    }

    pub(super) fn of(self, state: &FlatAdamState) -> &Tensor<1> {
        match self {
            Buffer::Master => &state.param,
            Buffer::ExpAvg => &state.exp_avg,
            Buffer::ExpAvgSq => &state.exp_avg_sq,
        }
    }
}

/// One parameter's place in its group's buffers: its elements `[offset, offset + len)` of
/// `numel` (all of them, unless the distributed optimizer gave this rank only a piece).
#[derive(Debug, Clone)]
pub(super) struct Slot {
    pub(super) id: ParamId,
    pub(super) rank: usize,
    pub(super) len: usize,
    pub(super) dtype: DType,
    pub(super) offset: usize,
    pub(super) numel: usize,
    /// Where the piece sits in the distributed optimizer's shards.
    pub(super) place: Option<Place>,
}

/// A piece's plan (among the optimizer's plans), bucket, and position in this rank's shard.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Place {
    pub(crate) plan: usize,
    pub(crate) bucket: usize,
    pub(crate) at: usize,
}

impl Slot {
    /// This slot's elements of the flattened parameter (or of its gradient).
    pub(super) fn of(&self, flat: Tensor<1>) -> Tensor<1> {
        if self.len == self.numel {
            flat
        } else {
            flat.narrow(0, self.offset, self.len)
        }
    }
}

#[derive(Debug)]
pub(super) struct Group {
    pub(super) slots: Vec<Slot>,
    /// The group's weight decay is `weight_decay × wd_mult`.
    pub(super) wd_mult: f32,
    pub(super) lr_mult: f64,
    pub(super) state: FlatAdamState,
}

impl Group {
    fn lengths(&self) -> Vec<usize> {
        self.slots.iter().map(|s| s.len).collect()
    }

    /// `flat` (one of the group's buffers, or its gradient) cut into one `[len]` segment per
    /// slot.
    pub(super) fn cut(&self, flat: &Tensor<1>) -> Vec<Tensor<1>> {
        let mut offset = 0;
        self.slots
            .iter()
            .map(|s| {
                offset += s.len;
                flat.clone().narrow(0, offset - s.len, s.len)
            })
            .collect()
    }

    /// `buffer` cut into one `[len]` segment per slot.
    pub(super) fn segments(&self, buffer: Buffer) -> Vec<Tensor<1>> {
        self.cut(buffer.of(&self.state))
    }

    /// The master segments in each slot's model dtype: one rounding pass when the group has
    /// one half dtype.
    pub(super) fn model_segments(&self) -> Result<Vec<Tensor<1>>, KernelError> {
        let first = self.slots[0].dtype;
        if let (Some(h), true) = (
            half_dtype(first),
            self.slots.iter().all(|s| s.dtype == first),
        ) && let Ok(segments) =
            master_to_model_segments(self.state.param.clone(), &self.lengths(), h)
        {
            return Ok(segments);
        }
        // Mixed dtypes, or a device without the half type.
        Ok(self
            .segments(Buffer::Master)
            .into_iter()
            .zip(&self.slots)
            .map(|(t, s)| to_model_dtype(t, s.dtype))
            .collect())
    }
}

/// What one rank's gradients say before the model-parallel reduction.
pub(crate) struct LocalStats {
    /// Each group's gradient, still multiplied by the loss scale: one f32 piece per slot,
    /// in order (the fused step reads them where they lie).
    pub pieces: Vec<Vec<Tensor<1>>>,
    /// Whether any gradient element is inf or NaN (or so large its square overflows f32).
    pub non_finite: bool,
    /// This rank's part of the unscaled norm: the sum of squares (L2) or the largest |g| (Inf)
    /// over the dense parameters it counts.
    pub norm_part: f64,
    /// The same over its experts' parameters (summed over another group).
    pub expert_norm_part: f64,
}

/// The flat state of [`FusedAdam`] for one model.
#[derive(Debug)]
pub(crate) struct FlatAdam {
    pub(super) config: FusedAdamConfig,
    /// The weight decay that `wd_mult` scales: the config's, or the schedule's latest.
    pub(super) weight_decay: f32,
    pub(super) groups: Vec<Group>,
    pub(super) step: u32,
    /// The distributed optimizer's plans and group, when this rank holds shards only.
    pub(super) sharding: Option<Sharding>,
}

/// What a distributed (ZeRO-1) optimizer needs beyond its pieces: the plans they come from
/// and the groups to gather over.
pub(crate) type Sharding = crate::data_parallel::advanced::OptimizerShards;

impl FlatAdam {
    /// Flat buffers for `model`'s trainable parameters (cast to f32), grouped by
    /// `(wd_mult, lr_mult)` in the order the groups are first met.
    pub(crate) fn new<M: Module>(adam: &FusedAdam, model: &M) -> Self {
        let mut entries = Vec::new();
        walk(model, |path, id, dims, flat, trainable| {
            if !trainable {
                return;
            }
            let len = flat.dims()[0];
            let slot = Slot {
                id,
                rank: dims,
                len,
                dtype: flat.dtype(),
                offset: 0,
                numel: len,
                place: None,
            };
            entries.push((slot, adam.options(&id, path, dims), flat));
        });
        Self::grouped(adam, entries, None)
    }

    /// The state of `entries` (slot, its group's `(wd_mult, lr_mult)`, its values), grouped
    /// in the order the groups are first met.
    pub(super) fn grouped(
        adam: &FusedAdam,
        entries: Vec<(Slot, (f32, f64), Tensor<1>)>,
        sharding: Option<Sharding>,
    ) -> Self {
        let mut groups: Vec<(f32, f64, Vec<Slot>, Vec<Tensor<1>>)> = Vec::new();
        for (slot, (wd_mult, lr_mult), values) in entries {
            let same = |g: &(f32, f64, Vec<Slot>, Vec<Tensor<1>>)| {
                g.0.to_bits() == wd_mult.to_bits() && g.1.to_bits() == lr_mult.to_bits()
            };
            let g = match groups.iter().position(same) {
                Some(g) => g,
                None => {
                    groups.push((wd_mult, lr_mult, Vec::new(), Vec::new()));
                    groups.len() - 1
                }
            };
            groups[g].2.push(slot);
            groups[g].3.push(values.cast(DType::F32));
        }
        let groups = groups
            .into_iter()
            .map(|(wd_mult, lr_mult, slots, flats)| Group {
                slots,
                wd_mult,
                lr_mult,
                state: FlatAdamState::new(Tensor::cat(flats, 0)),
            })
            .collect();
        Self {
            config: adam.config.clone(),
            weight_decay: adam.config.weight_decay,
            groups,
            step: 0,
            sharding,
        }
    }

    /// Steps taken (skipped ones not counted), as burn-optim's time counter.
    pub(crate) fn steps(&self) -> u32 {
        self.step
    }

    /// Gathers the gradients (zeros for a trainable parameter without one) and measures them.
    pub(crate) fn local_stats(
        &self,
        grads: &GradientsParams,
        tp_rank: usize,
        norm_type: NormType,
        inv_scale: f64,
    ) -> Result<LocalStats, KernelError> {
        let pieces: Vec<Vec<Tensor<1>>> = self
            .groups
            .iter()
            .map(|g| {
                let device = g.state.param.device();
                let piece = |s: &Slot| {
                    with_flat(grads, s.id, s.rank, |t| s.of(t.inner().cast(DType::F32)))
                        .unwrap_or_else(|| Tensor::zeros([s.len], &device))
                };
                g.slots.iter().map(piece).collect()
            })
            .collect();
        if pieces.is_empty() {
            return Ok(LocalStats {
                pieces,
                non_finite: false,
                norm_part: 0.0,
                expert_norm_part: 0.0,
            });
        }
        // One read-back for every group: per-parameter sums of squares, then (Inf norm) the
        // per-parameter largest |g|.
        let mut stats = Vec::new();
        for group in &pieces {
            stats.push(multi_tensor_sum_of_squares(group)?);
        }
        if norm_type == NormType::Inf {
            for seg in pieces.iter().flatten() {
                stats.push(match seg.dims()[0] {
                    0 => Tensor::zeros([1], &seg.device()),
                    _ => seg.clone().abs().max(),
                });
            }
        }
        let values: Vec<f32> = Tensor::cat(stats, 0).read_back().iter::<f32>().collect();
        let slots: Vec<&Slot> = self.groups.iter().flat_map(|g| &g.slots).collect();
        let (sums, maxes) = values.split_at(slots.len());
        let non_finite = sums.iter().any(|s| !s.is_finite());
        let part = |experts: bool| {
            let counted = |i: &usize| {
                let attrs = parallel_attrs(slots[*i].id);
                attrs.expert == experts && attrs.counts_in_grad_norm(tp_rank)
            };
            match norm_type {
                NormType::L2 => {
                    let sum: f64 = (0..slots.len())
                        .filter(counted)
                        .map(|i| f64::from(sums[i]))
                        .sum();
                    sum * inv_scale * inv_scale
                }
                NormType::Inf => {
                    let max = (0..slots.len())
                        .filter(counted)
                        .map(|i| f64::from(maxes[i]))
                        .fold(0.0, f64::max);
                    max * inv_scale
                }
            }
        };
        Ok(LocalStats {
            pieces,
            non_finite,
            norm_part: part(false),
            expert_norm_part: part(true),
        })
    }

    /// The weight decay every group's `wd_mult` scales from the next step on.
    pub(crate) fn set_weight_decay(&mut self, wd: f32) {
        self.weight_decay = wd;
    }

    /// One fused step per group on the gradient pieces of [`Self::local_stats`].
    pub(crate) fn apply(
        &mut self,
        pieces: Vec<Vec<Tensor<1>>>,
        lr: f64,
        inv_scale: f64,
        clip_coef: f64,
    ) -> Result<(), KernelError> {
        let c = &self.config;
        let step = self.step + 1;
        let hypers: Vec<AdamHyper> = self
            .groups
            .iter()
            .map(|g| AdamHyper {
                lr: lr * g.lr_mult,
                beta1: c.beta_1,
                beta2: c.beta_2,
                eps: c.epsilon,
                weight_decay: match (self.weight_decay * g.wd_mult, c.decoupled_weight_decay) {
                    (0.0, _) => WeightDecay::None,
                    (w, true) => WeightDecay::Decoupled(w),
                    (w, false) => WeightDecay::L2(w),
                },
                step,
                inv_scale: inv_scale as f32,
                clip_coef: clip_coef as f32,
            })
            .collect();
        // Every group's arguments are checked before any state is handed over, so a refused
        // step leaves the optimizer as it was.
        for h in &hypers {
            h.validate()?;
        }
        for ((g, grad), hyper) in self.groups.iter_mut().zip(pieces).zip(&hypers) {
            // The state is moved in (nothing else holds it), so Flex updates it in place. The
            // non-finite count is known to be zero: overflow was checked before the step.
            let empty = placeholder(&g.state);
            let state = std::mem::replace(&mut g.state, empty);
            g.state = multi_tensor_fused_adam_step(state, grad, hyper)?.0;
        }
        self.step = step;
        Ok(())
    }
}

/// Empty buffers standing in for a group's state while the step owns it.
fn placeholder(state: &FlatAdamState) -> FlatAdamState {
    let empty = || Tensor::<1>::zeros([0], &state.param.device());
    FlatAdamState {
        param: empty(),
        exp_avg: empty(),
        exp_avg_sq: empty(),
    }
}
