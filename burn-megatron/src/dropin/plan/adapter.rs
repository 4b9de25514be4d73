//! The plan's part in Burn's LoRA: a factor of the adapter `apply_lora` attached to a weight
//! the plan splits is split with it (see
//! [`split_weight`](crate::tensor_parallel::split_weight)).

use super::{PlanMapper, Split, encoder_split};
use crate::comm::tensor::broadcast;
use crate::dropin::shard::{Placement, is_frozen, shard, trainable_as};
use crate::tensor_parallel::{LayoutOwner, adapter_attrs, shard_param};
use burn::module::Param;
use burn::tensor::Tensor;

impl PlanMapper<'_> {
    /// A factor of the LoRA adapter Burn's `apply_lora` attached to a weight this plan splits
    /// (its path `…layer.weight.lora.{a,b}`): the factor on the side the weight is split
    /// along is split with it, the other kept whole (see
    /// [`split_weight`](crate::tensor_parallel::split_weight)).
    pub(super) fn split_adapter<const D: usize>(
        &mut self,
        param: Param<Tensor<D>>,
        split: Split,
    ) -> Param<Tensor<D>> {
        let n = self.path.len();
        let path = self.path.join(".");
        let at = |i: usize| {
            n.checked_sub(i)
                .map(|k| self.path[k].as_str())
                .unwrap_or("")
        };
        let layer_type = n
            .checked_sub(3)
            .map(|k| self.types[k].as_str())
            .unwrap_or("");
        let sharded_dim = match (layer_type, at(3), split) {
            ("Struct:Linear", "weight", Split::Encoder) => match encoder_split(at(4)) {
                Some(Split::Row) => Some(0),
                Some(_) => Some(1),
                None => None,
            },
            ("Struct:Linear", "weight", Split::Row) => Some(0),
            ("Struct:Linear", "weight", _) => Some(1),
            ("Struct:Embedding", "weight", Split::Vocab) => Some(0),
            _ => None,
        };
        let layer = self.path[..n.saturating_sub(3)].join(".");
        let col = self.facts.get(&layer).is_some_and(|f| f.col);
        let refusal = match (sharded_dim, col, self.vocab) {
            (None, _, _) => Some("a LoRA adapter splits only on a split layer's weight"),
            (_, true, _) => Some(
                "a LoRA adapter on a linear in Burn's column layout does not split; build the \
                 layer in the row layout, or leave it out of the LoRA's parameter group",
            ),
            (_, _, Some(_)) => Some(
                "a LoRA adapter on a padded vocabulary does not split; leave the layer out of \
                 the LoRA's parameter group, or the plan's padding out",
            ),
            _ => None,
        };
        if let Some(reason) = refusal {
            self.fail(format!("{path}: {reason}"));
            return param;
        }
        let sharded_dim = sharded_dim.unwrap_or(0);
        let (a, b) = adapter_attrs(sharded_dim);
        let (dim, attrs) = match at(1) {
            "a" => ((sharded_dim == 0).then_some(0), a),
            _ => ((sharded_dim == 1).then_some(1), b),
        };
        let seed_path = self.plan.global_name(&path);
        let placement = Placement {
            init: None,
            col: false,
            dim,
            padded: None,
            vocab: false,
            layer: "Struct:LoraAdapter",
            path: &path,
            seed_path: &seed_path,
            seed: self.plan.seed,
            fans: (None, None),
        };
        let owner = self.owner.get_or_insert_with(LayoutOwner::default).clone();
        let param = match (dim, self.tp.group().size()) {
            // Burn drew the whole factor on each rank: the ranks must hold one.
            (None, 2..) => match broadcast(&**self.tp, param.val().detach(), 0) {
                Ok(value) => trainable_as(shard_param(value), is_frozen(&param)),
                Err(e) => {
                    self.fail(format!("{path}: the LoRA factor's broadcast failed: {e}"));
                    return param;
                }
            },
            _ => param,
        };
        match shard(param, placement, self.tp) {
            Ok(p) => {
                owner.state(p.id, attrs);
                p
            }
            Err((p, e)) => {
                self.fail(e);
                p
            }
        }
    }
}
