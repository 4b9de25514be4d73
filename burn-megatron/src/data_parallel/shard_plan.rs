//! How the distributed optimizer (ZeRO-1) splits a module over the data-parallel group:
//! Megatron's `ParamAndGradBuffer` with its buckets cut into one contiguous shard per rank.
//!
//! The parameters are bucketed as the gradient reduction buckets them (reverse module
//! order, [`bucket_layout`], one dtype per bucket); each bucket is padded to a multiple of
//! the group size and rank `r` owns elements `[r·len/dp, (r+1)·len/dp)`. The reduction
//! reduce-scatters each bucket, so a rank's reduced gradients are exactly the elements it
//! owns; the optimizer keeps master weights and moments for those elements only and
//! all-gathers the updated weights bucket by bucket.
//!
//! Parameters tied across pipeline stages (the word embedding of the first and last stage)
//! are summed over the embedding group after the data-parallel reduction, and the two stages
//! lay out their buckets differently: those parameters get buckets of their own, which are
//! all-reduced, so every element is reduced wherever the other stage has it.

use super::DataParallelConfig;
use super::finalize::bucket_layout;
use crate::comm::{Comm, CommError, ProcessGroup};
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor};
use std::ops::Range;

/// One parameter's place in a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedParam {
    /// The parameter.
    pub id: ParamId,
    /// Its tensor rank (`D`).
    pub rank: usize,
    /// Its first element's position in the bucket.
    pub offset: usize,
    /// Its element count.
    pub numel: usize,
    /// Its dims.
    pub dims: Vec<usize>,
    /// Whether it is trained (has a gradient and optimizer state).
    pub trainable: bool,
}

/// One bucket: parameters of one dtype, contiguous, padded to a multiple of the group size.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedBucket {
    /// The parameters, in bucket order.
    pub params: Vec<PlannedParam>,
    /// The parameters' dtype.
    pub dtype: DType,
    /// Elements including the padding (a multiple of the group size).
    pub len: usize,
    /// All-reduced rather than reduce-scattered (parameters tied across stages).
    pub all_reduced: bool,
}

impl PlannedBucket {
    /// Elements without the padding.
    pub fn used(&self) -> usize {
        self.params.last().map_or(0, |p| p.offset + p.numel)
    }
}

/// The part of one parameter a rank owns: elements `[start, start + len)` of its flattened
/// value, at `at` in the rank's shard of `bucket`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The bucket.
    pub bucket: usize,
    /// The parameter.
    pub id: ParamId,
    /// Its tensor rank.
    pub rank: usize,
    /// First element, in the flattened parameter.
    pub start: usize,
    /// Elements.
    pub len: usize,
    /// Where they sit in this rank's shard of the bucket.
    pub at: usize,
    /// The parameter's element count.
    pub numel: usize,
}

/// A module's buckets and this rank's shard of each. See the module docs.
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_megatron::data_parallel::{advanced::{ShardPlan}, DataParallelConfig};
/// let model = LinearConfig::new(3, 2).init(&Device::flex().autodiff()); // 6 + 2 elements
/// let plan = ShardPlan::new(&model, 3, 1, &DataParallelConfig::default(), false);
/// assert_eq!(plan.buckets()[0].len, 9); // padded to a multiple of 3
/// assert_eq!(plan.shard_range(0), 3..6); // rank 1 of 3
/// let owned: usize = plan.pieces().iter().map(|p| p.len).sum();
/// assert_eq!(owned, 3);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ShardPlan {
    size: usize,
    rank: usize,
    buckets: Vec<PlannedBucket>,
}

impl ShardPlan {
    /// The plan of `module` for rank `rank` of a data-parallel group of `size`, with the
    /// bucket size of `config`. `tied_across_stages` (the embedding group has more than one
    /// rank) gives shared-embedding parameters all-reduced buckets of their own.
    pub fn new<M: Module>(
        module: &M,
        size: usize,
        rank: usize,
        config: &DataParallelConfig,
        tied_across_stages: bool,
    ) -> Self {
        Self::of(
            param_info(module, false),
            size,
            rank,
            config,
            tied_across_stages,
        )
    }

    /// The plan of `module`'s expert parameters for rank `rank` of an expert data-parallel
    /// group of `size` (Megatron's `expt_dp_group`): the distributed optimizer shards the
    /// experts over their own replicas, as [`ShardPlan::new`] shards the dense parameters
    /// (which it leaves out) over the data-parallel group.
    pub fn experts<M: Module>(
        module: &M,
        size: usize,
        rank: usize,
        config: &DataParallelConfig,
    ) -> Self {
        Self::of(param_info(module, true), size, rank, config, false)
    }

    fn of(
        info: Vec<ParamInfo>,
        size: usize,
        rank: usize,
        config: &DataParallelConfig,
        tied_across_stages: bool,
    ) -> Self {
        let size = size.max(1);
        let bucket_size = config.bucket_elements(size);
        let (tied, rest): (Vec<_>, Vec<_>) = info
            .into_iter()
            .partition(|p| tied_across_stages && parallel_attrs(p.0).shared_embedding);
        let mut buckets = Vec::new();
        for (params, all_reduced) in [(rest, false), (tied, true)] {
            let numels: Vec<usize> = params
                .iter()
                .map(|p| p.2.iter().product::<usize>())
                .collect();
            for members in bucket_layout(&numels, bucket_size) {
                // One dtype per bucket, as the reduction splits them.
                let mut by_dtype: Vec<(DType, Vec<usize>)> = Vec::new();
                for i in members {
                    let d = params[i].3;
                    match by_dtype.iter_mut().find(|(bd, _)| *bd == d) {
                        Some((_, v)) => v.push(i),
                        None => by_dtype.push((d, vec![i])),
                    }
                }
                for (dtype, members) in by_dtype {
                    let mut offset = 0;
                    let planned = members
                        .iter()
                        .map(|&i| {
                            let (id, rank, ref dims, _, trainable) = params[i];
                            let numel = dims.iter().product::<usize>();
                            offset += numel;
                            PlannedParam {
                                id,
                                rank,
                                offset: offset - numel,
                                numel,
                                dims: dims.clone(),
                                trainable,
                            }
                        })
                        .collect();
                    buckets.push(PlannedBucket {
                        params: planned,
                        dtype,
                        len: offset.div_ceil(size) * size,
                        all_reduced,
                    });
                }
            }
        }
        Self {
            size,
            rank,
            buckets,
        }
    }

    /// The data-parallel group size.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The buckets, in reduction order.
    pub fn buckets(&self) -> &[PlannedBucket] {
        &self.buckets
    }

    /// Refuses a group this plan was not made for (another size, or this rank elsewhere).
    pub fn check_group(&self, group: &ProcessGroup, op: &'static str) -> Result<(), CommError> {
        if (group.size(), group.rank()) == (self.size, self.rank) {
            return Ok(());
        }
        Err(CommError::InvalidArgument {
            group: group.to_string(),
            op,
            reason: format!(
                "the plan is for rank {} of {}, the group has this rank at {} of {}",
                self.rank,
                self.size,
                group.rank(),
                group.size()
            ),
        })
    }

    /// The same plan seen from rank `rank` of the group.
    pub fn for_rank(&self, rank: usize) -> Self {
        Self {
            rank,
            ..self.clone()
        }
    }

    /// This rank's elements of bucket `b`.
    pub fn shard_range(&self, b: usize) -> Range<usize> {
        let part = self.buckets[b].len / self.size;
        self.rank * part..(self.rank + 1) * part
    }

    /// The trainable parameters' elements this rank owns, bucket by bucket.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        for (b, bucket) in self.buckets.iter().enumerate() {
            let shard = self.shard_range(b);
            for p in bucket.params.iter().filter(|p| p.trainable) {
                let start = shard.start.max(p.offset);
                let end = shard.end.min(p.offset + p.numel);
                if start < end {
                    out.push(Piece {
                        bucket: b,
                        id: p.id,
                        rank: p.rank,
                        start: start - p.offset,
                        len: end - start,
                        at: start - shard.start,
                        numel: p.numel,
                    });
                }
            }
        }
        out
    }
}

/// (id, rank, dims, dtype, trainable) of a float parameter.
type ParamInfo = (ParamId, usize, Vec<usize>, DType, bool);

/// The expert (`experts`) or dense float parameters, in module order.
fn param_info<M: Module>(module: &M, experts: bool) -> Vec<ParamInfo> {
    struct Info(Vec<ParamInfo>, bool);
    impl ModuleVisitor for Info {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if parallel_attrs(p.id).expert == self.1 {
                let v = p.val();
                let (dims, dtype) = (v.dims().to_vec(), v.dtype());
                self.0.push((p.id, D, dims, dtype, v.is_require_grad()));
            }
        }
    }
    let mut info = Info(Vec::new(), experts);
    module.visit(&mut info);
    info.0
}

/// What the distributed optimizer shards its state over: the dense parameters' plans (one
/// per model chunk, [`ShardPlan::new`]) over the data-parallel group, and with experts their
/// plans ([`ShardPlan::experts`]) over the expert data-parallel group.
///
/// ```
/// use burn::nn::LinearConfig;
/// use burn::tensor::Device;
/// use burn_megatron::comm::LocalWorld;
/// use burn_megatron::data_parallel::{advanced::{OptimizerShards, ShardPlan}, DataParallelConfig};
/// use std::sync::Arc;
/// let model = LinearConfig::new(3, 2).init(&Device::flex().autodiff());
/// let dp = Arc::new(LocalWorld::new(1).communicator("dp", vec![0], 0).unwrap());
/// let plan = ShardPlan::new(&model, 1, 0, &DataParallelConfig::default(), false);
/// let shards = OptimizerShards::new(vec![plan], dp);
/// assert_eq!(shards.plans().count(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct OptimizerShards {
    dense: Vec<ShardPlan>,
    dp: Comm,
    experts: Option<(Vec<ShardPlan>, Comm)>,
}

impl OptimizerShards {
    /// The dense parameters' `plans` (one per model chunk), made for `dp`.
    pub fn new(plans: Vec<ShardPlan>, dp: Comm) -> Self {
        Self {
            dense: plans,
            dp,
            experts: None,
        }
    }

    /// With the expert parameters' `plans` (one per model chunk), made for `expert_dp`.
    pub fn with_experts(mut self, plans: Vec<ShardPlan>, expert_dp: Comm) -> Self {
        self.experts = Some((plans, expert_dp));
        self
    }

    /// The dense parameters' plans.
    pub fn dense(&self) -> &[ShardPlan] {
        &self.dense
    }

    /// The data-parallel group.
    pub fn dp(&self) -> &Comm {
        &self.dp
    }

    /// The expert data-parallel group, when the experts are sharded.
    pub fn expert_dp(&self) -> Option<&Comm> {
        self.experts.as_ref().map(|(_, c)| c)
    }

    /// Every plan with the group it shards over: the dense ones, then the experts'. A
    /// piece's plan index counts in this order.
    pub fn plans(&self) -> impl Iterator<Item = (&ShardPlan, &Comm)> {
        let dense = self.dense.iter().map(|p| (p, &self.dp));
        let experts = self
            .experts
            .iter()
            .flat_map(|(plans, c)| plans.iter().map(move |p| (p, c)));
        dense.chain(experts)
    }

    /// Refuses a plan made for another group than the one it is paired with.
    pub fn check(&self, op: &'static str) -> Result<(), CommError> {
        self.plans()
            .try_for_each(|(p, c)| p.check_group(c.group(), op))
    }
}
