//! `VocabParallelEmbedding`: the embedding table split by vocabulary rows.

use super::attrs::{ParallelAttrs, real_part};
use super::init::{MasterInit, slice_rows};
use super::layers::{partition, unpadded};
use super::mappings::{
    reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use super::{TpError, lazy_host_param, no_adapter, refuse_adapter, split_weight};
use crate::comm::Comm;
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::module::embedding;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_kernels::device::ReadBack;

/// Configuration of a [`VocabParallelEmbedding`].
#[derive(Config, Debug)]
pub struct VocabParallelEmbeddingConfig {
    /// Vocabulary size, divisible by the tensor-parallel size (see
    /// [`padded_vocab_size`](super::padded_vocab_size)).
    pub num_embeddings: usize,
    /// Embedding width.
    pub embedding_dim: usize,
    /// Reduce-scatter the output into the sequence-parallel region (`[s / tp, b, d]`).
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Initialisation of the full table (Burn's `Embedding` uses N(0, 1)).
    #[config(default = "MasterInit::Normal { mean: 0.0, std: 1.0 }")]
    pub initializer: MasterInit,
    /// Seed of the full table.
    #[config(default = 0)]
    pub seed: u64,
    /// The real vocabulary when `num_embeddings` is padded (`None`: no padding). The rows
    /// from there on are padding: drawn as zeros and left out of checkpoints, so that
    /// layouts which pad the vocabulary differently load each other's (Megatron-Core's `allow_shape_mismatch` on
    /// the embedding).
    #[config(default = "None")]
    pub unpadded_size: Option<usize>,
}

/// What a [`VocabParallelEmbedding`] (and a model's token-type table) does with ids
/// outside `[0, vocab)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IdCheck {
    /// Refuse them with an error naming the id. Reads the ids' extremes back to the host:
    /// on a GPU, a synchronisation in every forward.
    #[default]
    Refuse,
    /// The ids were checked where they were made (a data loader checks its tokens on the
    /// host, where that is free): clamp them into range on the device and read nothing
    /// back, so that an id that slipped through still cannot index outside the table.
    /// Megatron checks nothing here.
    Clamp,
}

/// An embedding whose rows (vocabulary ids) are split across tensor-parallel ranks.
///
/// Each rank looks up the ids in its range `[start, end)`, zeroes the rows of the others,
/// and the partial results are summed over the group.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// This rank's rows, `[num_embeddings / tp, embedding_dim]`.
    pub weight: Param<Tensor<2>>,
    #[module(skip)]
    tp: Comm,
    #[module(skip)]
    layout: super::LayoutOwner,
    #[module(skip)]
    sequence_parallel: bool,
    #[module(skip)]
    id_check: IdCheck,
    #[module(skip)]
    unpadded_size: Option<usize>,
}

impl VocabParallelEmbeddingConfig {
    /// Initialises this rank's rows on `device` (independent of the TP size). Fails when
    /// the vocabulary does not split evenly over the group.
    pub fn init(&self, tp: &Comm, device: &Device) -> Result<VocabParallelEmbedding, TpError> {
        let part = partition(self.num_embeddings, tp.group().size(), "vocabulary entries")?;
        let unpadded_size = unpadded(self.unpadded_size, self.num_embeddings, "vocabulary")?;
        self.initializer.check()?;
        let (init, rank, seed) = (self.initializer, tp.group().rank(), self.seed);
        let (n, dim) = (self.num_embeddings, self.embedding_dim);
        // The padding rows are zeros, as a checkpoint's load makes them.
        let real = real_part(unpadded_size, rank * part, part);
        let weight = lazy_host_param([part, dim], device, move || {
            let full = init.values(n * dim, dim, seed);
            let mut rows = slice_rows(&full, dim, rank * part, part);
            rows[real * dim..].fill(0.0);
            rows
        });
        let layer = VocabParallelEmbedding {
            weight,
            tp: tp.clone(),
            layout: super::LayoutOwner::default(),
            sequence_parallel: self.sequence_parallel,
            id_check: IdCheck::default(),
            unpadded_size,
        };
        layer.state_attrs();
        Ok(layer)
    }
}

impl VocabParallelEmbedding {
    /// This rank's rows of a plain Burn `Embedding` (the same table on every rank), its
    /// output scattered over the sequence when `sequence_parallel`. Fails when the vocabulary
    /// does not split over the group.
    ///
    /// ```
    /// use burn::nn::{EmbeddingConfig, Initializer};
    /// use burn_megatron::launch::{self, LaunchOptions};
    /// use burn_megatron::tensor_parallel::{TpError, VocabParallelEmbedding};
    /// use burn_megatron::topology::ParallelConfig;
    ///
    /// let ranges = launch::threads(&ParallelConfig::new(2, 2, 1), LaunchOptions::default(), |ctx| {
    ///     let plain = EmbeddingConfig::new(8, 4)
    ///         .with_initializer(Initializer::Constant { value: 0.5 })
    ///         .init(&ctx.device);
    ///     let layer = VocabParallelEmbedding::from_embedding(&plain, false, &ctx.groups.tp)?;
    ///     Ok::<_, TpError>(layer.vocab_range())
    /// })
    /// .unwrap();
    /// assert_eq!(ranges, vec![(0, 4), (4, 8)]);
    /// ```
    pub fn from_embedding(
        embedding: &Embedding,
        sequence_parallel: bool,
        tp: &Comm,
    ) -> Result<Self, TpError> {
        no_adapter(&embedding.weight, "VocabParallelEmbedding::from_embedding")?;
        let [vocab, _] = embedding.weight.dims();
        let part = partition(vocab, tp.group().size(), "vocabulary entries")?;
        let rows = embedding
            .weight
            .val()
            .narrow(0, tp.group().rank() * part, part);
        let layer = Self {
            weight: super::shard_param(rows),
            tp: tp.clone(),
            layout: super::LayoutOwner::default(),
            sequence_parallel,
            id_check: IdCheck::default(),
            unpadded_size: None,
        };
        layer.state_attrs();
        Ok(layer)
    }

    /// States the layout of the table (split along dim 0), keeping a tie a model set on it:
    /// at init and at every lookup, and by a model that reads the table directly (a tied
    /// output layer).
    pub(crate) fn state_attrs(&self) {
        let rows = ParallelAttrs::sharded(0).padded_from(self.unpadded_size);
        self.layout.state(self.weight.id, rows);
    }

    /// The vocabulary ids `[start, end)` this rank holds.
    pub fn vocab_range(&self) -> (usize, usize) {
        let part = self.weight.dims()[0];
        let start = self.tp.group().rank() * part;
        (start, start + part)
    }

    /// The full vocabulary size (rows over all tensor-parallel ranks).
    pub fn num_embeddings(&self) -> usize {
        self.weight.dims()[0] * self.tp.group().size()
    }

    /// The ids a lookup takes: the real vocabulary when the table is padded.
    fn id_limit(&self) -> usize {
        self.unpadded_size.unwrap_or_else(|| self.num_embeddings())
    }

    /// Refuses ids outside `[0, vocab)` (the real vocabulary of a padded table: a padding row
    /// is no token), naming the offending id: [`forward`](Self::forward) would panic on one
    /// at TP 1 and silently embed it as zeros at TP > 1. Reads the ids' extremes back to the
    /// host.
    pub fn check_ids(&self, ids: &Tensor<2, Int>) -> Result<(), TpError> {
        check_index_range(ids, self.id_limit(), "token id", "the vocabulary size")
    }

    /// The same layer, treating ids outside the vocabulary as `check` says (by default
    /// [`IdCheck::Refuse`]).
    pub fn with_id_check(mut self, check: IdCheck) -> Self {
        self.id_check = check;
        self
    }

    /// How this layer treats ids outside the vocabulary.
    pub fn id_check(&self) -> IdCheck {
        self.id_check
    }

    /// `ids` made safe to look up, as [`id_check`](Self::id_check) says: refused with an
    /// error when one lies outside `[0, vocab)`, or clamped into it.
    ///
    /// ```
    /// use burn::tensor::{Device, Int, Tensor};
    /// use burn_megatron::comm::LocalWorld;
    /// use burn_megatron::tensor_parallel::{IdCheck, VocabParallelEmbeddingConfig};
    ///
    /// let tp: burn_megatron::comm::Comm =
    ///     std::sync::Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
    /// let device = Device::flex();
    /// let layer = VocabParallelEmbeddingConfig::new(8, 4).init(&tp, &device).unwrap();
    /// let ids = Tensor::<2, Int>::from_ints([[1, 9]], &device);
    /// assert!(layer.checked_ids(ids.clone()).unwrap_err().to_string().contains("token id 9"));
    /// let clamped = layer.with_id_check(IdCheck::Clamp).checked_ids(ids).unwrap();
    /// let clamped: Vec<i64> = clamped.into_data().iter::<i64>().collect();
    /// assert_eq!(clamped, vec![1, 7]);
    /// ```
    pub fn checked_ids(&self, ids: Tensor<2, Int>) -> Result<Tensor<2, Int>, TpError> {
        checked_index(
            ids,
            self.id_limit(),
            self.id_check,
            "token id",
            "the vocabulary size",
        )
    }

    /// `[b, s]` ids → `[b, s, d]` embeddings; under sequence parallelism `[s / tp, b, d]`
    /// (sequence first, split over the group). Ids must lie in `[0, vocab)`; see
    /// [`check_ids`](Self::check_ids).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.state_attrs();
        vocab_lookup(&self.weight, ids, &self.tp, self.sequence_parallel, false)
    }

    /// Gathers every rank's rows back into the full plain Burn `Embedding` (a collective).
    pub fn to_embedding(&self) -> Result<Embedding, TpError> {
        no_adapter(&self.weight, "VocabParallelEmbedding::to_embedding")?;
        let w = crate::comm::tensor::all_gather(&*self.tp, self.weight.val().detach(), 0)?;
        Ok(Embedding {
            weight: Param::from_tensor(w),
        })
    }
}

/// Refuses values of `index` outside `[0, limit)`: `what` names the values, `limit_name` the
/// bound, both in the message.
pub(crate) fn check_index_range(
    index: &Tensor<2, Int>,
    limit: usize,
    what: &str,
    limit_name: &str,
) -> Result<(), TpError> {
    if index.dims().iter().product::<usize>() == 0 {
        return Ok(());
    }
    // Both extremes in one read-back (a device sync on GPUs).
    let extremes = Tensor::cat(vec![index.clone().min(), index.clone().max()], 0);
    let extremes: Vec<i64> = extremes.read_back().iter::<i64>().collect();
    let (lo, hi) = (extremes[0], extremes[1]);
    let bad = if lo < 0 { lo } else { hi };
    if lo < 0 || hi >= limit as i64 {
        return Err(TpError::Invalid(format!(
            "{what} {bad} is outside [0, {limit}) ({limit_name} {limit})"
        )));
    }
    Ok(())
}

/// `index` made safe to look up in a table of `limit` rows, as `check` says (see
/// [`check_index_range`] for `what` and `limit_name`).
pub(crate) fn checked_index(
    index: Tensor<2, Int>,
    limit: usize,
    check: IdCheck,
    what: &str,
    limit_name: &str,
) -> Result<Tensor<2, Int>, TpError> {
    match check {
        IdCheck::Clamp if limit > 0 => Ok(index.clamp(0, limit as i64 - 1)),
        // An empty table has no row to clamp into: refusing is the only safe answer.
        IdCheck::Refuse | IdCheck::Clamp => {
            check_index_range(&index, limit, what, limit_name)?;
            Ok(index)
        }
    }
}

/// `[b, s]` ids → `[b, s, d]` rows of a table whose rows `weight` holds this rank's share of
/// (rank `r` of `tp` holds the `r`-th block): ids outside it give zeros, and the ranks' rows
/// are summed (reduce-scattered along the sequence, `[s / tp, b, d]`, under sequence
/// parallelism). With `adapters`, a LoRA adapter on the table is composed split with it (the
/// drop-in table); without, one is refused (a panic naming the layer).
pub(crate) fn vocab_lookup(
    weight: &Param<Tensor<2>>,
    ids: Tensor<2, Int>,
    tp: &Comm,
    sequence_parallel: bool,
    adapters: bool,
) -> Tensor<3> {
    if !adapters {
        refuse_adapter(weight, "VocabParallelEmbedding");
    }
    // The table with its LoRA adapter's product, the adapter's whole factor summing its
    // gradient over the ranks.
    let table = split_weight(weight, 0, tp, |p| p.val());
    let out = if tp.group().size() == 1 {
        embedding(table, ids)
    } else {
        let part = weight.dims()[0];
        let start = tp.group().rank() * part;
        let end = start + part;
        let outside = ids
            .clone()
            .lower_elem(start as i64)
            .bool_or(ids.clone().greater_equal_elem(end as i64));
        let local = (ids - start as i64).mask_fill(outside.clone(), 0);
        let keep = outside
            .bool_not()
            .float()
            .cast(table.dtype())
            .unsqueeze_dim::<3>(2);
        embedding(table, local) * keep
    };
    if sequence_parallel {
        reduce_scatter_to_sequence_parallel_region(out.swap_dims(0, 1), tp)
    } else {
        reduce_from_tensor_model_parallel_region(out, tp)
    }
}
