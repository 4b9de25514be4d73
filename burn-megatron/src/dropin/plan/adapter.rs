//! Burn's LoRA on the layers a plan splits. The factor of an adapter on the side its weight
//! is split along is split with it; the other is whole, and one over the ranks (see
//! [`split_weight`](crate::tensor_parallel::split_weight)). An adapter already on a layer when
//! the plan applies (a model with its LoRA in memory) is cut by the plan; [`apply_lora`]
//! gives a model the plan split its LoRA, each rank drawing only its part.

use super::{PlanMapper, Split, encoder_split};
use crate::comm::Comm;
use crate::comm::tensor::broadcast;
use crate::comm::{CommunicatorExt, ReduceOp};
use crate::dropin::shard::{Placement, is_frozen, shard, trainable_as};
use crate::dropin::slot::{Facts, facts};
use crate::tensor_parallel::{LayoutOwner, ParallelAttrs, TpError, adapter_attrs, shard_param};
use burn::module::{Lora, Module, ModuleMapper, ModuleVisitor, Param, QLora, Quantizer};
use burn::tensor::Tensor;
use std::collections::HashMap;

/// Burn's LoRA ([`Module::apply_lora`]) on a model a [`TpPlan`](super::TpPlan) has split:
/// each rank's adapters drawn in its shards' shapes, then made one adapter over the ranks (the
/// whole factors broadcast from the first rank) and their layout stated, so that
/// [`load_sharded`](crate::dropin::load_sharded), [`save_gathered`](crate::dropin::save_gathered),
/// `ParallelTraining` and its checkpoints read and write the unsplit adapter. No whole weight
/// is drawn (Burn's LoRA draws each weight it adapts; on a split model, a shard), so it is
/// the way for a model that does not fit one device: plan, [`load_sharded`](crate::dropin::load_sharded)
/// the base, then this. Collective over `tp`, the group the plan split the model over: every
/// rank calls it.
///
/// Errors, naming the layer: an adapter on a linear in Burn's column layout or on a padded
/// vocabulary (leave those out of the LoRA's parameter group), or a failed broadcast.
///
/// ```text
/// let model = plan.apply(Model::new(&device), &tp)?;
/// let (model, _) = load_sharded(model, &base, &tp, &LoadOptions::default())?;
/// let model = dropin::apply_lora(model, Lora::new(8, 16.0), &tp)?;
/// ```
pub fn apply_lora<M: Module>(model: M, lora: Lora, tp: &Comm) -> Result<M, TpError> {
    one_adapter(model.apply_lora(lora), tp)
}

/// Burn's QLoRA ([`Module::apply_qlora`] with `QLora::new(lora, quantizer)`) on a model a
/// [`TpPlan`](super::TpPlan) has split: each rank quantizes its shards of the frozen base
/// weights, and the adapters become one adapter over the ranks as [`apply_lora`] makes them.
/// A block-only scheme whose blocks do not straddle the shards (blocks of one row along a row
/// split, a width dividing each rank's columns along a column split) quantizes every shard as
/// the whole weight's quantization would: the split model is then the unsplit QLoRA model. A
/// per-tensor scale is each shard's own, close to but not the whole weight's. Load the float
/// base first ([`load_sharded`](crate::dropin::load_sharded) refuses a quantized parameter).
/// Collective over `tp`.
///
/// Errors, on every rank and before anything is quantized: a shard the quantizer's blocks do
/// not divide (a block would straddle two ranks' shards), naming the parameter, its shard's
/// shape and the block; then as [`apply_lora`].
///
/// ```text
/// let model = plan.apply(Model::new(&device), &tp)?;
/// let (model, _) = load_sharded(model, &base, &tp, &LoadOptions::default())?;
/// let scheme = device.settings().quantization.scheme.with_value(QuantValue::Q4S)
///     .per_block([1, 32], ScaleDtype::F32);
/// let quantizer = Quantizer::new(Calibration::MinMax, scheme);
/// let model = dropin::apply_qlora(model, Lora::new(8, 16.0), quantizer, &tp)?;
/// ```
pub fn apply_qlora<M: Module>(
    model: M,
    lora: Lora,
    quantizer: Quantizer,
    tp: &Comm,
) -> Result<M, TpError> {
    let straddling = straddling_block(&model, &quantizer);
    let mut any = vec![f32::from(straddling.is_some())];
    tp.all_reduce_vec(&mut any, ReduceOp::Max)?;
    if let Some(why) = straddling {
        return Err(TpError::Invalid(why));
    }
    if any[0] > 0.0 {
        return Err(TpError::Invalid(
            "another tensor-parallel rank's shard does not split into the quantization \
             blocks (see its error)"
                .into(),
        ));
    }
    one_adapter(model.apply_qlora(QLora::new(lora, quantizer)), tp)
}

/// The first parameter `quantizer` quantizes whose shard its blocks do not divide, as an error
/// naming it (Burn's quantization panics on it).
fn straddling_block<M: Module>(model: &M, quantizer: &Quantizer) -> Option<String> {
    struct Walk<'q>(Vec<String>, &'q Quantizer, Option<String>);
    impl ModuleVisitor for Walk<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let path = self.0.join(".");
            let Some(block) = self.1.scheme.block_size() else {
                return;
            };
            if self.2.is_some() || !self.1.group.matches(&p.id, Some(&path)) {
                return;
            }
            let shape = p.lazy_shape().to_vec();
            let block = block.to_dim_vec(shape.len());
            let fits = |(d, b): (&usize, &u8)| *b > 0 && d.is_multiple_of(usize::from(*b));
            if !shape.iter().zip(&block).all(fits) {
                self.2 = Some(format!(
                    "{path}: this rank's shard {shape:?} does not split into the quantization \
                     blocks {block:?} (a block would straddle two ranks' shards, or the tensor's \
                     edge): choose blocks that divide every rank's shard, or leave the layer \
                     out of the quantizer's parameter group"
                ));
            }
        }
    }
    let mut walk = Walk(Vec::new(), quantizer, None);
    model.visit(&mut walk);
    walk.2
}

/// `model`'s adapters, drawn on each rank in its shards' shapes, made one adapter over `tp`.
fn one_adapter<M: Module>(model: M, tp: &Comm) -> Result<M, TpError> {
    same_adapters(&model, tp)?;
    let mut mapper = Adapters {
        tp,
        facts: facts(&model),
        path: Vec::new(),
        types: Vec::new(),
        error: None,
    };
    let model = model.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(TpError::Invalid(e)),
        None => Ok(model),
    }
}

/// An error on every rank when the ranks' adapters differ in number (a LoRA parameter group
/// chosen per rank, models that differ): the broadcasts of the walk would pair one rank's
/// factor with another's.
fn same_adapters<M: Module>(model: &M, tp: &Comm) -> Result<(), TpError> {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn enter_module(&mut self, _: &str, container_type: &str) {
            self.0 += usize::from(container_type == "Struct:LoraAdapter");
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    // The same fields of each adapter, on every rank alike.
    let mine = count.0 as f32;
    let mut range = vec![mine, -mine];
    tp.all_reduce_vec(&mut range, ReduceOp::Max)?;
    match (range[0], -range[1]) {
        (most, least) if most == least => Ok(()),
        (most, least) => Err(TpError::Invalid(format!(
            "the tensor-parallel ranks' models carry different numbers of LoRA factors ({least} \
             to {most}; this rank {mine}): give every rank the same model and the same LoRA \
             parameter group"
        ))),
    }
}

/// Where the factor at `path` (`…layer.weight.lora.{a,b}`, entered from `types`) goes on a
/// layer split by `split`: the dimension it is cut along (none: whole), and its layout. Or
/// why it cannot split.
fn factor(
    path: &[String],
    types: &[String],
    split: Split,
    col: bool,
    padded: bool,
) -> Result<(Option<usize>, ParallelAttrs), &'static str> {
    let n = path.len();
    let at = |i: usize| n.checked_sub(i).map_or("", |k| path[k].as_str());
    let layer_type = n.checked_sub(3).map_or("", |k| types[k].as_str());
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
    let sharded_dim = match (sharded_dim, col, padded) {
        (None, _, _) => return Err("a LoRA adapter splits only on a split layer's weight"),
        (_, true, _) => {
            return Err(
                "a LoRA adapter on a linear in Burn's column layout does not split; build the \
                 layer in the row layout, or leave it out of the LoRA's parameter group",
            );
        }
        (_, _, true) => {
            return Err(
                "a LoRA adapter on a padded vocabulary does not split; leave the layer out of \
                 the LoRA's parameter group, or the plan's padding out",
            );
        }
        (Some(d), _, _) => d,
    };
    let (a, b) = adapter_attrs(sharded_dim);
    Ok(match at(1) {
        "a" => ((sharded_dim == 0).then_some(0), a),
        _ => ((sharded_dim == 1).then_some(1), b),
    })
}

/// `param`, a whole factor, the same on every rank of `tp`: the first rank's (Burn drew it on
/// each), its training state kept.
fn whole_over_ranks<const D: usize>(
    param: Param<Tensor<D>>,
    at: &str,
    tp: &Comm,
) -> Result<Param<Tensor<D>>, (Param<Tensor<D>>, String)> {
    if tp.group().size() == 1 {
        return Ok(param);
    }
    match broadcast(&**tp, param.val().detach(), 0) {
        Ok(value) => Ok(trainable_as(shard_param(value), is_frozen(&param))),
        Err(e) => Err((
            param,
            format!("{at}: the LoRA factor's broadcast failed: {e}"),
        )),
    }
}

/// A factor, the dimension to cut it along (none: whole) and its layout.
type Placed<const D: usize> = (Param<Tensor<D>>, Option<usize>, ParallelAttrs);

/// The factor `param` on a layer split by `split`, where [`factor`] places it (`walked`: the
/// path and container types the walk entered it by): a whole one made the same on every rank
/// of `tp` (the first rank's: Burn drew it on each; its training state kept). With the
/// dimension to cut it along (none: whole) and its layout; or why it cannot split.
fn placed<const D: usize>(
    param: Param<Tensor<D>>,
    (path, types): (&[String], &[String]),
    (split, col, padded): (Split, bool, bool),
    tp: &Comm,
) -> Result<Placed<D>, (Param<Tensor<D>>, String)> {
    let at = path.join(".");
    let (dim, attrs) = match factor(path, types, split, col, padded) {
        Ok(placed) => placed,
        Err(reason) => return Err((param, format!("{at}: {reason}"))),
    };
    if dim.is_some() {
        return Ok((param, dim, attrs));
    }
    Ok((whole_over_ranks(param, &at, tp)?, dim, attrs))
}

impl PlanMapper<'_> {
    /// `param` as it is, or, a factor of an adapter on a layer no rule names (whole, like
    /// the layer), the same on every rank.
    pub(super) fn whole_adapter<const D: usize>(
        &mut self,
        param: Param<Tensor<D>>,
    ) -> Param<Tensor<D>> {
        if self.types.last().map(String::as_str) != Some("Struct:LoraAdapter") {
            return param;
        }
        match whole_over_ranks(param, &self.path.join("."), self.tp) {
            Ok(p) => p,
            Err((p, e)) => {
                self.fail(e);
                p
            }
        }
    }

    /// A factor of an adapter on a weight this plan splits: cut with it, or made one over
    /// the ranks.
    pub(super) fn split_adapter<const D: usize>(
        &mut self,
        param: Param<Tensor<D>>,
        split: Split,
    ) -> Param<Tensor<D>> {
        let n = self.path.len();
        let path = self.path.join(".");
        let layer = self.path[..n.saturating_sub(3)].join(".");
        let col = self.facts.get(&layer).is_some_and(|f| f.col);
        let walked = (&self.path[..], &self.types[..]);
        let (param, dim, attrs) =
            match placed(param, walked, (split, col, self.vocab.is_some()), self.tp) {
                Ok(placed) => placed,
                Err((p, e)) => {
                    self.fail(e);
                    return p;
                }
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

/// [`apply_lora`]'s walk: each factor of an adapter on a split layer's weight, drawn by Burn
/// in the shard's shape, made one over the ranks if whole, its layout stated.
struct Adapters<'a> {
    tp: &'a Comm,
    facts: HashMap<String, Facts>,
    path: Vec<String>,
    types: Vec<String>,
    error: Option<String>,
}

impl ModuleMapper for Adapters<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        self.types.push(container_type.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
        self.types.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.types.last().map(String::as_str) != Some("Struct:LoraAdapter") {
            return param;
        }
        let n = self.path.len();
        let layer = self.path[..n.saturating_sub(3)].join(".");
        // An adapter on a layer no plan split is whole, like the layer, and one over the ranks.
        let Some(Facts {
            col,
            assigned: Some((split, layout, padded)),
            ..
        }) = self.facts.get(&layer).cloned()
        else {
            return match whole_over_ranks(param, &self.path.join("."), self.tp) {
                Ok(p) => p,
                Err((p, e)) => {
                    self.error.get_or_insert(e);
                    p
                }
            };
        };
        // Burn drew the factor in the shard's shape: nothing to cut.
        let walked = (&self.path[..], &self.types[..]);
        match placed(param, walked, (split, col, padded), self.tp) {
            Ok((param, _, attrs)) => {
                layout.state(param.id, attrs);
                param
            }
            Err((param, e)) => {
                self.error.get_or_insert(e);
                param
            }
        }
    }
}
