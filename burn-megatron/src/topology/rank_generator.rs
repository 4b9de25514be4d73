//! Mixed-radix layout of global ranks over the five parallel dimensions.

use super::dim::parse_tokens;
use super::{ParallelDim, RankCoords, TopologyError};

/// The default dimension order: tensor parallelism varies fastest, pipeline slowest.
pub const DEFAULT_ORDER: &str = "tp-cp-ep-dp-pp";

/// Order in which dimensions missing from an order string are appended (only size-1
/// dimensions may be missing, so this affects display only, never rank arithmetic).
const APPEND_ORDER: [ParallelDim; 5] = [
    ParallelDim::Tensor,
    ParallelDim::Pipeline,
    ParallelDim::Data,
    ParallelDim::Expert,
    ParallelDim::Context,
];

/// Lays global ranks out on a grid of tensor, context, expert, data and pipeline axes,
/// following Megatron-Core's conventions.
///
/// The first token of the order varies fastest: with the default order
/// `"tp-cp-ep-dp-pp"`, `rank = tp + TP·(cp + CP·(ep + EP·(dp + DP·pp)))`.
///
/// ```
/// use burn_megatron::topology::RankGenerator;
///
/// // world 8: tp 2, ep 1, dp 2, pp 2, cp 1
/// let generator = RankGenerator::new(2, 1, 2, 2, 1, "tp-cp-ep-dp-pp").unwrap();
/// assert_eq!(generator.world_size(), 8);
/// assert_eq!(generator.get_ranks("tp").unwrap(), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
/// assert_eq!(generator.get_ranks("dp").unwrap(), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
/// assert_eq!(generator.get_ranks("tp-pp").unwrap(), vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGenerator {
    /// Size of each dimension, indexed by [`ParallelDim::index`].
    sizes: [usize; 5],
    /// Stride of each dimension in the global rank, indexed by [`ParallelDim::index`].
    strides: [usize; 5],
    /// All five dimensions, fastest-varying first.
    order: Vec<ParallelDim>,
    world_size: usize,
}

impl RankGenerator {
    /// Builds the layout for the given sizes and `-`-joined order string.
    ///
    /// Dimensions missing from `order` are appended when their size is 1.
    ///
    /// # Errors
    ///
    /// A size of 0, an unknown or repeated token in `order`, a dimension of size > 1
    /// missing from `order`, or sizes whose product overflows `usize`.
    pub fn new(
        tp: usize,
        ep: usize,
        dp: usize,
        pp: usize,
        cp: usize,
        order: &str,
    ) -> Result<RankGenerator, TopologyError> {
        let named = [
            (tp, "tensor model parallel (tp)"),
            (ep, "expert model parallel (ep)"),
            (dp, "data parallel (dp)"),
            (pp, "pipeline model parallel (pp)"),
            (cp, "context parallel (cp)"),
        ];
        if let Some((_, what)) = named.iter().find(|(size, _)| *size == 0) {
            return Err(TopologyError::ZeroSize { what });
        }
        let mut sizes = [0; 5];
        for (dim, size) in [
            (ParallelDim::Tensor, tp),
            (ParallelDim::Context, cp),
            (ParallelDim::Expert, ep),
            (ParallelDim::Data, dp),
            (ParallelDim::Pipeline, pp),
        ] {
            sizes[dim.index()] = size;
        }

        let mut full_order = parse_tokens(order)?;
        for dim in APPEND_ORDER {
            if full_order.contains(&dim) {
                continue;
            }
            let size = sizes[dim.index()];
            if size != 1 {
                return Err(TopologyError::MissingFromOrder {
                    token: dim.token(),
                    size,
                    order: order.to_string(),
                });
            }
            full_order.push(dim);
        }

        let mut strides = [0; 5];
        let mut world_size: usize = 1;
        for &dim in &full_order {
            strides[dim.index()] = world_size;
            world_size = world_size.checked_mul(sizes[dim.index()]).ok_or_else(|| {
                TopologyError::SizeOverflow {
                    sizes: format!("tp = {tp}, cp = {cp}, ep = {ep}, dp = {dp}, pp = {pp}"),
                }
            })?;
        }

        Ok(RankGenerator {
            sizes,
            strides,
            order: full_order,
            world_size,
        })
    }

    /// Total number of ranks: the product of all five sizes.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Size of one dimension.
    pub fn size(&self, dim: ParallelDim) -> usize {
        self.sizes[dim.index()]
    }

    /// Distance in global ranks between neighbours along `dim`: the product of the sizes
    /// of every dimension before it in the order.
    pub fn stride(&self, dim: ParallelDim) -> usize {
        self.strides[dim.index()]
    }

    /// All five dimensions, fastest-varying first (missing ones appended).
    pub fn order(&self) -> &[ParallelDim] {
        &self.order
    }

    /// The full order as a `-`-joined string, e.g. `"tp-cp-ep-dp-pp"`.
    pub fn order_string(&self) -> String {
        let tokens: Vec<&str> = self.order.iter().map(|dim| dim.token()).collect();
        tokens.join("-")
    }

    /// Where `rank` sits on each axis.
    ///
    /// ```
    /// use burn_megatron::topology::{RankCoords, RankGenerator};
    ///
    /// let generator = RankGenerator::new(2, 1, 2, 2, 1, "tp-cp-ep-dp-pp").unwrap();
    /// let coords = generator.coords(5).unwrap();
    /// assert_eq!(coords, RankCoords { tp: 1, dp: 0, pp: 1, ..RankCoords::default() });
    /// assert_eq!(generator.rank_of(&coords).unwrap(), 5);
    /// ```
    ///
    /// # Errors
    ///
    /// [`TopologyError::RankOutOfRange`] when `rank >= world_size()`.
    pub fn coords(&self, rank: usize) -> Result<RankCoords, TopologyError> {
        self.check_rank(rank)?;
        let mut coords = RankCoords::default();
        for dim in ParallelDim::ALL {
            coords.set(dim, (rank / self.stride(dim)) % self.size(dim));
        }
        Ok(coords)
    }

    /// The global rank at `coords`; the inverse of [`RankGenerator::coords`].
    ///
    /// # Errors
    ///
    /// [`TopologyError::CoordinateOutOfRange`] when a coordinate is not below its size.
    pub fn rank_of(&self, coords: &RankCoords) -> Result<usize, TopologyError> {
        let mut rank = 0;
        for dim in ParallelDim::ALL {
            let (index, size) = (coords.get(dim), self.size(dim));
            if index >= size {
                return Err(TopologyError::CoordinateOutOfRange {
                    token: dim.token(),
                    index,
                    size,
                });
            }
            rank += index * self.stride(dim);
        }
        Ok(rank)
    }

    /// Every group for a `-`-joined subset of tokens, e.g. `"tp"`, `"dp-cp"` or `"tp-pp"`.
    ///
    /// Ranks that differ only along the requested dimensions share a group. Members are
    /// ascending; groups are enumerated with the first non-requested dimension of the
    /// order varying fastest, as Megatron-Core does.
    ///
    /// # Errors
    ///
    /// An unknown, empty or repeated token in `token`.
    pub fn get_ranks(&self, token: &str) -> Result<Vec<Vec<usize>>, TopologyError> {
        let (masked, unmasked) = self.split_order(token)?;
        let members = self.offsets(&masked);
        Ok(self
            .offsets(&unmasked)
            .into_iter()
            .map(|base| members.iter().map(|offset| base + offset).collect())
            .collect())
    }

    /// The one group of [`RankGenerator::get_ranks`]`(token)` that contains `rank`.
    ///
    /// ```
    /// use burn_megatron::topology::RankGenerator;
    ///
    /// let generator = RankGenerator::new(2, 1, 2, 2, 1, "tp-cp-ep-dp-pp").unwrap();
    /// assert_eq!(generator.group_of("pp", 3).unwrap(), vec![3, 7]);
    /// ```
    ///
    /// # Errors
    ///
    /// An invalid `token`, or `rank >= world_size()`.
    pub fn group_of(&self, token: &str, rank: usize) -> Result<Vec<usize>, TopologyError> {
        let (masked, _) = self.split_order(token)?;
        let coords = self.coords(rank)?;
        let base = rank
            - masked
                .iter()
                .map(|&dim| coords.get(dim) * self.stride(dim))
                .sum::<usize>();
        Ok(self
            .offsets(&masked)
            .into_iter()
            .map(|offset| base + offset)
            .collect())
    }

    fn check_rank(&self, rank: usize) -> Result<(), TopologyError> {
        if rank >= self.world_size {
            return Err(TopologyError::RankOutOfRange {
                rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// Splits the full order into (requested, other) dimensions, each in order.
    fn split_order(
        &self,
        token: &str,
    ) -> Result<(Vec<ParallelDim>, Vec<ParallelDim>), TopologyError> {
        let requested = parse_tokens(token)?;
        Ok(self
            .order
            .iter()
            .copied()
            .partition(|dim| requested.contains(dim)))
    }

    /// Rank offsets of every index combination over `dims`, the first dimension fastest.
    fn offsets(&self, dims: &[ParallelDim]) -> Vec<usize> {
        let mut offsets = vec![0];
        for &dim in dims {
            let stride = self.stride(dim);
            offsets = (0..self.size(dim))
                .flat_map(|index| offsets.iter().map(move |offset| offset + index * stride))
                .collect();
        }
        offsets
    }
}
