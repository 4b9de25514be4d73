//! `Linear`, `Embedding`, `SwiGlu`, (in [`attention`]) `MultiHeadAttention` and `CrossAttention`, and (in
//! [`transformer`]) `TransformerEncoder` and `TransformerDecoder` with Burn's names, fields,
//! configs and record paths, each with a [`TpSlot`] that a [`TpPlan`](super::TpPlan) fills: a
//! model written with `burn::nn` becomes tensor-parallel by importing these instead and
//! applying a plan, with no constructor changed. Until a plan assigns a split, each layer
//! computes exactly what Burn's does. Burn's autoregressive decoding (`forward_cache`,
//! `forward_autoregressive_inference`) comes with its caches ([`cache`],
//! [`attention::MhaCache`]); a layer Burn built converts with `From`. [`BatchNorm`] is
//! Burn's too, its statistics able to span the data-parallel batch once synchronised, and
//! so is [`norm::Normalization`], whose `Batch` variant holds it. The
//! rest of Burn's `nn` is re-exported as it is, so this module stands in for all of it.

use super::plan::Split;
use super::slot::TpSlot;

pub mod attention;
pub mod cache;
pub mod norm;
mod sequence;
mod swiglu;
pub mod transformer;

/// Burn's `BatchNorm`, whose statistics can span the data-parallel batch
/// ([`ParallelTraining::sync_batch_norm`](crate::training::ParallelTraining::sync_batch_norm)).
pub use crate::data_parallel::batch_norm::{BatchNorm, BatchNormConfig, SyncGroup};
/// The rest of Burn's `nn`, as Burn has it (norms, dropout, activations, rotary encoding,
/// losses, convolutions, initializers, ...): none of it is split, so `use burn::nn::…` swaps
/// whole for `use dropin::nn::…`. The items defined here (and the `attention`, `cache`, `norm`
/// and `transformer` modules, which do the same with Burn's) take the place of Burn's. Burn's
/// own paths to its layers stay Burn's: `activation::SwiGlu` (whose `SwiGluConfig` Burn's
/// `ActivationConfig::SwiGlu` holds) and `modules::Linear` are Burn's layers, which a plan
/// refuses to split, naming them; import `SwiGlu` and `Linear` from here.
pub use burn::nn::*;
pub use swiglu::{SwiGlu, SwiGluConfig};

use crate::comm::Comm;
use crate::tensor_parallel::{ParallelLinear, Partition, check_input_width, vocab_lookup};
use crate::tensor_parallel::{mask_vocab_padding, matmul_bias, state_adapter};
use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};
use sequence::Region;

/// Burn's `LinearConfig`.
#[derive(Config, Debug)]
pub struct LinearConfig {
    /// The size of the input features.
    pub d_input: usize,
    /// The size of the output features.
    pub d_output: usize,
    /// If a bias should be applied during the linear transformation.
    #[config(default = true)]
    pub bias: bool,
    /// The type of function used to initialize neural network parameters (Burn's default).
    #[config(default = "burn::nn::LinearConfig::new(1, 1).initializer")]
    pub initializer: Initializer,
    /// How Burn stores the weight: `Row`, `[in, out]`, or `Col`, `[out, in]` (as PyTorch and
    /// ONNX imports do). Either way the layer holds it as `[in, out]`, and the record keeps
    /// the layout Burn's layer writes.
    #[config(default = "LinearLayout::Row")]
    pub layout: LinearLayout,
}

impl LinearConfig {
    /// The layer on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> Linear {
        let burn::nn::Linear { weight, bias } =
            burn::nn::LinearConfig::new(self.d_input, self.d_output)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .with_layout(self.layout)
                .init(device);
        let col = matches!(self.layout, LinearLayout::Col);
        Linear {
            weight,
            bias,
            tp: TpSlot::linear(self.initializer.clone(), col),
        }
    }
}

/// Burn's `Linear` (`[in, out]` weight), column- or row-parallel once a plan says so.
#[derive(Module, Debug)]
pub struct Linear {
    /// `[d_input, d_output]`, or this rank's shard of it.
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`, or this rank's shard of it (column-parallel).
    pub bias: Option<Param<Tensor<1>>>,
    tp: TpSlot,
}

impl Linear {
    /// `[..., d_input]` → `[..., d_output]`; column-parallel: `[..., d_output / tp]` (the
    /// input copied into the region; gathered column: the whole output again); row-parallel:
    /// from `[..., d_input / tp]`, summed over the ranks; split over a vocabulary: this rank's
    /// logits of the padded vocabulary, padding masked (gathered: the real vocabulary's).
    ///
    /// # Panics
    ///
    /// On an input of another width than the weight takes, naming both (as Burn's).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        self.run(input, Region::Tensor)
    }

    /// The forward, a row-parallel layer's output going to `region` (a column-parallel layer
    /// in a sequence-parallel block is one of [`sequence::column_products`]).
    pub(super) fn run<const D: usize>(&self, input: Tensor<D>, region: Region) -> Tensor<D> {
        let Some(a) = &self.tp.assigned else {
            // Drawn first: Burn's column layout gives the width only once drawn.
            let (weight, bias) = (self.weight.val(), self.bias.as_ref().map(|b| b.val()));
            check_input_width("Linear", &input, weight.dims()[0], None);
            return matmul_bias(input, weight, bias, false);
        };
        self.restate(a);
        let row = a.split == Split::Row;
        let partition = match a.split {
            Split::Row => Partition::Row {
                input_is_parallel: true,
                sum_bias_grad_in_graph: true,
            },
            split => Partition::Column {
                gather_output: matches!(split, Split::GatheredColumn | Split::GatheredVocab),
            },
        };
        let layer = ParallelLinear {
            name: match row {
                true => "Linear (row-parallel)",
                false => "Linear (column-parallel)",
            },
            weight: &self.weight,
            bias: self.bias.as_ref(),
            tp: &a.tp,
            partition,
            sequence_dim: (row && region == Region::Sequence).then_some(1),
            skip_bias_add: false,
            fusion: false,
            adapters: true,
        };
        let (out, _) = layer.forward(input);
        match (a.split, a.vocab) {
            (Split::GatheredVocab, Some(vocab)) => out.narrow(D - 1, 0, vocab),
            (Split::Vocab, Some(vocab)) => mask_vocab_padding(out, vocab, a.tp.group().rank()),
            _ => out,
        }
    }

    /// The split a plan assigned, if any.
    pub fn split(&self) -> Option<Split> {
        self.tp.split()
    }

    /// The tensor-parallel group the layer is split over (a group of one until a plan
    /// splits it): what a vocabulary-parallel loss or sampler over its output takes.
    pub fn group(&self) -> Comm {
        self.tp.group()
    }

    /// The ranks the layer is split over (1 until a plan splits it): the divisor of a head
    /// count that becomes per rank.
    pub fn tp_size(&self) -> usize {
        self.tp.assigned.as_ref().map_or(1, |a| a.tp.group().size())
    }

    /// The output width of the whole layer (over every rank), padding not counted: a
    /// vocabulary-split output layer's real vocabulary, what
    /// [`vocab_parallel_cross_entropy_padded`](crate::tensor_parallel::vocab_parallel_cross_entropy_padded)
    /// spreads label smoothing over.
    pub fn d_output(&self) -> usize {
        let Some(a) = &self.tp.assigned else {
            return super::shard::held_dims(&self.weight, self.tp.col())[1];
        };
        // A plan's shard is held in the layer's layout, drawn or not.
        let local = self.weight.lazy_shape().dims::<2>()[1];
        match a.split {
            Split::Row => local,
            _ => a.vocab.unwrap_or(local * a.tp.group().size()),
        }
    }

    /// The parameters' attributes again: a record load gives them other ids.
    fn restate(&self, a: &super::slot::Assigned) {
        use crate::tensor_parallel::ParallelAttrs;
        let (w, b) = match a.split {
            Split::Row => (ParallelAttrs::sharded(0), ParallelAttrs::default()),
            _ => (a.sharded(1), a.sharded(0)),
        };
        a.layout.state(self.weight.id, w);
        if let Some(bias) = &self.bias {
            a.layout.state(bias.id, b);
        }
        let sharded_dim = match a.split {
            Split::Row => 0,
            _ => 1,
        };
        state_adapter(&a.layout, &self.weight, sharded_dim);
    }
}

/// Burn's `EmbeddingConfig`.
#[derive(Config, Debug)]
pub struct EmbeddingConfig {
    /// The number of embedding vectors.
    pub n_embedding: usize,
    /// The size of each vector.
    pub d_model: usize,
    /// The type of function used to initialize neural network parameters (Burn's default).
    #[config(default = "burn::nn::EmbeddingConfig::new(1, 1).initializer")]
    pub initializer: Initializer,
}

impl EmbeddingConfig {
    /// The table on `device`, drawn lazily as Burn draws it.
    pub fn init(&self, device: &Device) -> Embedding {
        let burn::nn::Embedding { weight } =
            burn::nn::EmbeddingConfig::new(self.n_embedding, self.d_model)
                .with_initializer(self.initializer.clone())
                .init(device);
        Embedding {
            weight,
            tp: TpSlot::drawn_with(self.initializer.clone()),
        }
    }
}

/// Burn's `Embedding`, vocabulary-parallel once a plan says so.
#[derive(Module, Debug)]
pub struct Embedding {
    /// `[n_embedding, d_model]`, or this rank's rows of it.
    pub weight: Param<Tensor<2>>,
    tp: TpSlot,
}

impl Embedding {
    /// `[b, s]` ids → `[b, s, d_model]`; vocabulary-parallel: each rank looks up the ids it
    /// holds, and the ranks' rows are summed.
    pub fn forward(&self, input: Tensor<2, Int>) -> Tensor<3> {
        match &self.tp.assigned {
            None => burn::tensor::module::embedding(self.weight.val(), input),
            Some(a) => {
                a.layout.state(self.weight.id, a.sharded(0));
                state_adapter(&a.layout, &self.weight, 0);
                vocab_lookup(&self.weight, input, &a.tp, false, true)
            }
        }
    }

    /// The split a plan assigned, if any.
    pub fn split(&self) -> Option<Split> {
        self.tp.split()
    }

    /// The tensor-parallel group the table is split over (a group of one until a plan
    /// splits it): what an output layer tied to it (logits from its rows) computes over.
    pub fn group(&self) -> Comm {
        self.tp.group()
    }

    /// The rows of the whole table (over every rank), padding not counted.
    pub fn num_embeddings(&self) -> usize {
        match &self.tp.assigned {
            Some(a) => a
                .vocab
                .unwrap_or(self.weight.lazy_shape().to_vec()[0] * a.tp.group().size()),
            None => self.weight.lazy_shape().to_vec()[0],
        }
    }
}

impl From<burn::nn::Linear> for Linear {
    /// Burn's built layer, its parameters kept (lazy ones stay lazy: a plan draws them from
    /// Burn's default initializer, as the layer no longer says which built it). The layer
    /// must be in Burn's row layout, which it does not say either: build a column-layout
    /// one from [`LinearConfig`] with its `layout`.
    fn from(linear: burn::nn::Linear) -> Self {
        let burn::nn::Linear { weight, bias } = linear;
        Self {
            weight,
            bias,
            tp: TpSlot::default(),
        }
    }
}

impl From<burn::nn::Embedding> for Embedding {
    /// Burn's built table, its parameter kept.
    fn from(embedding: burn::nn::Embedding) -> Self {
        Self {
            weight: embedding.weight,
            tp: TpSlot::default(),
        }
    }
}
