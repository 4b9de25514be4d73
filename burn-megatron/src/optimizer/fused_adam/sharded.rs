//! The distributed optimizer's side of the flat state (ZeRO-1): each data-parallel rank holds
//! the master weights and moments of the elements its [`ShardPlan`](crate::data_parallel::advanced::ShardPlan)s give it, and rebuilds
//! whole parameters (weights after a step, state for a checkpoint) by all-gathering every
//! bucket's shards.

use super::config::FusedAdam;
use super::flat::{Buffer, FlatAdam, Place, Sharding, Slot};
use super::mappers::{Replace, walk};
use crate::comm::tensor;
use crate::comm::{CommError, comm_dtype};
use crate::optimizer::error::OptimizerError;
use crate::param_grads::zero_padded;
use burn::module::{Module, ParamId};
use burn::tensor::{DType, Tensor};
use std::collections::HashMap;

impl FlatAdam {
    /// Flat buffers for this rank's pieces of `model`'s trainable parameters: those of
    /// `shards`' plans, grouped as [`FlatAdam::new`] groups.
    pub(crate) fn distributed<M: Module>(
        adam: &FusedAdam,
        model: &M,
        shards: Sharding,
    ) -> Result<Self, CommError> {
        let invalid = |reason: String| CommError::InvalidArgument {
            group: shards.dp().group().to_string(),
            op: "distributed optimizer",
            reason,
        };
        shards.check("distributed optimizer")?;
        check_covers_experts(model, &shards)?;
        let mut params = HashMap::new();
        walk(model, |path, id, dims, flat, trainable| {
            if trainable {
                params.insert(id, (path.to_string(), dims, flat));
            }
        });
        let mut entries = Vec::new();
        for (plan_index, (plan, _)) in shards.plans().enumerate() {
            for piece in plan.pieces() {
                let Some((path, dims, flat)) = params.get(&piece.id) else {
                    return Err(invalid(format!(
                        "the plan names parameter {:?}, which the model does not train",
                        piece.id
                    )));
                };
                let slot = Slot {
                    id: piece.id,
                    rank: *dims,
                    len: piece.len,
                    dtype: flat.dtype(),
                    offset: piece.start,
                    numel: piece.numel,
                    place: Some(Place {
                        plan: plan_index,
                        bucket: piece.bucket,
                        at: piece.at,
                    }),
                };
                let values = slot.of(flat.clone());
                entries.push((slot, adam.options(&piece.id, path, *dims), values));
            }
        }
        Ok(Self::grouped(adam, entries, Some(shards)))
    }

    fn device(&self) -> burn::tensor::Device {
        self.groups[0].state.param.device()
    }

    /// The shards of a distributed optimizer.
    pub(crate) fn shards(&self) -> Option<&Sharding> {
        self.sharding.as_ref()
    }

    /// Elements of master weights this rank holds (each moment holds as many).
    pub(crate) fn state_elements(&self) -> usize {
        self.groups
            .iter()
            .flat_map(|g| &g.slots)
            .map(|s| s.len)
            .sum()
    }

    /// [`FlatAdam::model_from`] for a distributed optimizer: every rank's updated pieces in
    /// the model's dtypes, gathered (in those dtypes) into whole parameters.
    pub(super) fn gather_model<M: Module>(
        &self,
        sharding: &Sharding,
        model: M,
    ) -> Result<M, OptimizerError> {
        let mut pieces = Vec::new();
        for g in &self.groups {
            pieces.extend(g.slots.iter().cloned().zip(g.model_segments()?));
        }
        let values = gather_pieces(sharding, &self.device(), placed(pieces), |d| d)?;
        Ok(model.map(&mut Replace(values)))
    }

    /// [`FlatAdam::state_module`] for a distributed optimizer: `buffer` of every rank's
    /// pieces, gathered in f32. Collective over the data-parallel group.
    pub(super) fn gather_state<M: Module>(
        &self,
        sharding: &Sharding,
        buffer: Buffer,
        model: &M,
    ) -> Result<M, OptimizerError> {
        let mut pieces = Vec::new();
        for g in &self.groups {
            pieces.extend(g.slots.iter().cloned().zip(g.segments(buffer)));
        }
        let values = gather_pieces(sharding, &self.device(), placed(pieces), |_| DType::F32)?;
        Ok(model.clone().map(&mut Replace(values)))
    }
}

fn placed(pieces: Vec<(Slot, Tensor<1>)>) -> Vec<(Place, Tensor<1>)> {
    pieces
        .into_iter()
        .map(|(s, t)| {
            (
                s.place.expect("a distributed optimizer's slots are placed"),
                t,
            )
        })
        .collect()
}

/// Whole parameters from every data-parallel rank's pieces (`pieces`: this rank's, with
/// their places): each bucket all-gathered in `dtype` of its parameters' dtype, onto
/// `device`. Collective over the data-parallel group (the expert data-parallel group for
/// the experts' plans); every rank gathers every bucket.
pub(crate) fn gather_pieces(
    sharding: &Sharding,
    device: &burn::tensor::Device,
    pieces: Vec<(Place, Tensor<1>)>,
    dtype: impl Fn(DType) -> DType,
) -> Result<HashMap<ParamId, Tensor<1>>, OptimizerError> {
    let mut by_bucket: HashMap<(usize, usize), Vec<(usize, Tensor<1>)>> = HashMap::new();
    for (place, values) in pieces {
        by_bucket
            .entry((place.plan, place.bucket))
            .or_default()
            .push((place.at, values));
    }
    let mut out = HashMap::new();
    for (p, (plan, group)) in sharding.plans().enumerate() {
        for (b, bucket) in plan.buckets().iter().enumerate() {
            let d = dtype(bucket.dtype);
            let d = if comm_dtype(d).is_some() {
                d
            } else {
                DType::F32
            };
            // This rank's pieces laid out in its shard of the bucket (zeros between them),
            // on the device; the shards are gathered into the whole bucket.
            let shard = bucket.len / plan.size();
            let mine = by_bucket.remove(&(p, b)).unwrap_or_default();
            let full = tensor::all_gather(&**group, zero_padded(shard, d, device, mine), 0)?;
            for param in bucket.params.iter().filter(|p| p.trainable) {
                let values = full.clone().narrow(0, param.offset, param.numel);
                out.insert(param.id, values);
            }
        }
    }
    Ok(out)
}

/// Refuses shards that leave `model`'s trained expert parameters out: no step would update
/// them.
pub(crate) fn check_covers_experts<M: Module>(
    model: &M,
    shards: &Sharding,
) -> Result<(), CommError> {
    if shards.expert_dp().is_some() {
        return Ok(());
    }
    let mut experts = 0;
    walk(model, |_, id, _, _, trainable| {
        if trainable && crate::tensor_parallel::parallel_attrs(id).expert {
            experts += 1;
        }
    });
    if experts == 0 {
        return Ok(());
    }
    Err(CommError::InvalidArgument {
        group: shards.dp().group().to_string(),
        op: "distributed optimizer",
        reason: format!(
            "the model has {experts} expert parameters and the shards no expert plans: add \
             them with OptimizerShards::with_experts (ShardPlan::experts over the expert \
             data-parallel group)"
        ),
    })
}
