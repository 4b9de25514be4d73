//! The forward of a parallel linear layer, written once. [`ColumnParallelLinear`],
//! [`RowParallelLinear`] and a plan's split drop-in `Linear` each describe their shard as a
//! [`ParallelLinear`] and run [`ParallelLinear::forward`]. Two callers form the product
//! themselves and take the rest from here: a region that forms the product and its
//! gradients itself (`recompute::recompute_linear_input`) runs the steps apart
//! ([`parallel_input`](ParallelLinear::parallel_input), this rank's product, then
//! [`finish`](ParallelLinear::finish)), and a drop-in sequence-parallel block forms its
//! column layers' products under one gather ([`gathered_product`] of their weights side by
//! side).
//!
//! | partition | the input | this rank's product | the output |
//! | --- | --- | --- | --- |
//! | column | copied into the region (SP: gathered) | `x·W_i + b_i` | as it is, or all-gathered |
//! | row | this rank's features (or split here) | `x_i·W_i` | summed (SP: reduce-scattered), `+ b` |
//!
//! Under sequence parallelism the forward gathers inside the product
//! ([`gathered_product`]), which gathers again in backward rather than keep the gathered
//! input; [`parallel_input`](ParallelLinear::parallel_input) gathers on its own, and what it
//! returns lives as long as the region's graph that keeps it.
//!
//! [`ColumnParallelLinear`]: super::ColumnParallelLinear
//! [`RowParallelLinear`]: super::RowParallelLinear

use crate::comm::Comm;
use crate::grad_hooks::hook_param;
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, gather_sequence_matmul,
    reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
};
use crate::tensor_parallel::{refuse_adapter, split_weight};
use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn_megatron_kernels::linear_with_grad_accumulation;

/// Which dimension of the weight the ranks split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Partition {
    /// The output features (weight dim 1, bias dim 0).
    Column {
        /// All-gather the output, so that every rank has every feature.
        gather_output: bool,
    },
    /// The input features (weight dim 0); the whole bias is added once, after the sum.
    Row {
        /// The input is already this rank's features (a column layer's output); otherwise it
        /// is split here.
        input_is_parallel: bool,
        /// Under sequence parallelism the bias is added to this rank's positions only, so
        /// its gradient is a partial sum. `true`: summed inside the graph, for a drop-in
        /// model whose plain Burn loop has no `finalize_model_grads`; `false`: left to
        /// `finalize_model_grads` (Megatron's `_allreduce_layernorm_grads`), which finds it
        /// by its `sequence_parallel` attribute.
        sum_bias_grad_in_graph: bool,
    },
}

/// A parallel linear layer's shard and settings, as its forward needs them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ParallelLinear<'a> {
    /// The layer's name in a width mismatch's panic.
    pub(crate) name: &'static str,
    /// This rank's weight, `[d_input, d_output]` of its shard.
    pub(crate) weight: &'a Param<Tensor<2>>,
    /// This rank's bias slice (column) or the whole bias (row).
    pub(crate) bias: Option<&'a Param<Tensor<1>>>,
    /// The tensor-parallel group.
    pub(crate) tp: &'a Comm,
    /// Which features are split.
    pub(crate) partition: Partition,
    /// Sequence parallelism: the activations outside the layer are split along this dim, so
    /// a column layer gathers its input and a row layer reduce-scatters its output.
    pub(crate) sequence_dim: Option<usize>,
    /// Return the bias rather than add it (Megatron's `skip_bias_add`).
    pub(crate) skip_bias_add: bool,
    /// The weight gradient summed in f32 (`gradient_accumulation_fusion`).
    pub(crate) fusion: bool,
    /// A LoRA adapter on the weight is composed, split with it (the drop-in layers); else
    /// one is refused.
    pub(crate) adapters: bool,
}

impl ParallelLinear<'_> {
    /// `[..., d_input]` (a row layer's: `[..., d_input / tp]` when its input is parallel) to
    /// this layer's output, and the bias when `skip_bias_add` (Megatron's
    /// `(output, output_bias)`).
    ///
    /// # Panics
    ///
    /// On an input of another width than the weight takes, naming the layer and both widths
    /// (as Burn's `Linear` panics; its forward has no room for an error).
    pub(crate) fn forward<const D: usize>(
        &self,
        input: Tensor<D>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        let input = match self.partition {
            // Under SP the product gathers this rank's positions itself.
            Partition::Column { .. } if self.sequence_dim.is_some() => self.checked(input),
            _ => self.parallel_input(input),
        };
        // Gradient-ready hooks when an OverlapReducer is active (else the plain values).
        let bias = self.bias.map(|b| hook_param(b, &input));
        let sharded_dim = match self.partition {
            Partition::Column { .. } => 1,
            Partition::Row { .. } => 0,
        };
        if !self.adapters {
            refuse_adapter(self.weight, self.name);
        }
        let weight = split_weight(self.weight, sharded_dim, self.tp, |p| hook_param(p, &input));
        match self.partition {
            Partition::Column { .. } => {
                let (add, skipped) = match self.skip_bias_add {
                    true => (None, bias),
                    false => (bias, None),
                };
                let out = match self.sequence_dim {
                    Some(dim) => gathered_product(input, weight, dim, self.fusion, self.tp),
                    None => matmul_bias(input, weight, None, self.fusion),
                };
                let out = match add {
                    Some(b) => out + b.unsqueeze(),
                    None => out,
                };
                (self.gathered(out), skipped)
            }
            Partition::Row { .. } => {
                let partial = matmul_bias(input, weight, None, self.fusion);
                self.reduce(partial, bias)
            }
        }
    }

    /// The input as this rank's product sees it: entering the tensor-parallel region (a
    /// column layer's, all-gathered from the sequence-parallel region under SP, kept for
    /// backward), split (a row layer whose input is not parallel), or as it is.
    pub(crate) fn parallel_input<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        match (self.partition, self.sequence_dim) {
            (Partition::Column { .. }, Some(dim)) => along(dim, self.checked(input), |x| {
                gather_from_sequence_parallel_region(x, self.tp, true)
            }),
            (Partition::Column { .. }, None) => {
                copy_to_tensor_model_parallel_region(self.checked(input), self.tp)
            }
            (
                Partition::Row {
                    input_is_parallel, ..
                },
                _,
            ) => match input_is_parallel {
                true => self.checked(input),
                false => scatter_to_tensor_model_parallel_region(input, self.tp),
            },
        }
    }

    /// The bias this rank's product adds: a column layer's, unless `skip_bias_add` (a row
    /// layer adds its own after the sum).
    pub(crate) fn added_bias(&self) -> Option<&Param<Tensor<1>>> {
        match self.partition {
            Partition::Column { .. } if !self.skip_bias_add => self.bias,
            _ => None,
        }
    }

    /// This rank's product `x·W (+ added bias)` finished as [`forward`](Self::forward)
    /// finishes it: gathered (`gather_output`) or summed (a row layer), and the bias added or
    /// returned (`skip_bias_add`; hooked at `anchor`).
    pub(crate) fn finish<const D: usize>(
        &self,
        product: Tensor<D>,
        anchor: &Tensor<D>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        match self.partition {
            Partition::Column { .. } => {
                let skipped = match self.bias {
                    Some(b) if self.skip_bias_add => Some(hook_param(b, anchor)),
                    _ => None,
                };
                (self.gathered(product), skipped)
            }
            Partition::Row { .. } => {
                let bias = self.bias.map(|b| hook_param(b, anchor));
                self.reduce(product, bias)
            }
        }
    }

    /// Whether [`finish`](Self::finish) returns the product as it is (and no bias).
    pub(crate) fn finishes_as_is(&self) -> bool {
        let returns_bias = self.skip_bias_add && self.bias.is_some();
        matches!(
            self.partition,
            Partition::Column {
                gather_output: false
            }
        ) && !returns_bias
    }

    /// `input`, once its width is checked against the weight's.
    fn checked<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        check_width(self.name, &input, self.weight, self.tp);
        input
    }

    /// A column layer's output, all-gathered when `gather_output`.
    fn gathered<const D: usize>(&self, out: Tensor<D>) -> Tensor<D> {
        match self.partition {
            Partition::Column {
                gather_output: true,
            } => gather_from_tensor_model_parallel_region(out, self.tp),
            _ => out,
        }
    }

    /// A row layer's partial product summed over the group (reduce-scattered along the
    /// sequence under SP), and `bias` (hooked) added, or returned with `skip_bias_add`.
    fn reduce<const D: usize>(
        &self,
        partial: Tensor<D>,
        bias: Option<Tensor<1>>,
    ) -> (Tensor<D>, Option<Tensor<1>>) {
        let (out, bias) = match self.sequence_dim {
            None => (
                reduce_from_tensor_model_parallel_region(partial, self.tp),
                bias,
            ),
            Some(dim) => {
                let out = along(dim, partial, |x| {
                    reduce_scatter_to_sequence_parallel_region(x, self.tp)
                });
                let sum_in_graph = matches!(
                    self.partition,
                    Partition::Row {
                        sum_bias_grad_in_graph: true,
                        ..
                    }
                );
                let bias = match sum_in_graph {
                    true => bias.map(|b| copy_to_tensor_model_parallel_region(b, self.tp)),
                    false => bias,
                };
                (out, bias)
            }
        };
        match (bias, self.skip_bias_add) {
            (Some(b), false) => (out + b.unsqueeze(), None),
            (b, _) => (out, b),
        }
    }
}

/// The layers whose forward is a [`ParallelLinear`]'s, for the regions that take it apart
/// (`recompute::recompute_linear_input`), which keep their own copies of the layers.
pub(crate) trait LinearShard: Module + Clone + Send + 'static {
    /// The layer's forward, its parameters' layout stated (as each forward states it: a
    /// record load gives them other ids).
    fn parallel(&self) -> ParallelLinear<'_>;
}

/// `f` of `x` with dim `dim` brought to the front, where Megatron's mappings split and
/// gather (a strided view, for Burn's `[b, s, d]` layers' sequence at dim 1), and put back.
fn along<const D: usize>(
    dim: usize,
    x: Tensor<D>,
    f: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    match dim {
        0 => f(x),
        _ => f(x.swap_dims(0, dim)).swap_dims(0, dim),
    }
}

/// The product of this rank's positions `input` (split along `dim`) gathered over the
/// sequence with `weight`, gathered again in backward rather than kept
/// ([`gather_sequence_matmul`]), so a sequence-parallel column layer keeps only its `1 / tp`
/// of the sequence, as Megatron's does (the weight gradient in f32 with `fusion`).
pub(crate) fn gathered_product<const D: usize>(
    input: Tensor<D>,
    weight: Tensor<2>,
    dim: usize,
    fusion: bool,
    tp: &Comm,
) -> Tensor<D> {
    along(dim, input, |x| {
        let dims = x.dims();
        let rows: usize = dims[1..D - 1].iter().product();
        let out =
            gather_sequence_matmul(rank_3(x, [dims[0], rows, dims[D - 1]]), weight, fusion, tp);
        let mut shape = dims;
        (shape[0], shape[D - 1]) = (out.dims()[0], out.dims()[2]);
        rank_d(out, shape)
    })
}

/// `x` as the 3-d `shape`: as it is when it has 3 dims, since a reshape of a strided view (a
/// sequence brought to the front) would copy it.
fn rank_3<const D: usize>(x: Tensor<D>, shape: [usize; 3]) -> Tensor<3> {
    match D {
        3 => Tensor::from_dispatch(x.into_dispatch()),
        _ => x.reshape(shape),
    }
}

/// The inverse of [`rank_3`].
fn rank_d<const D: usize>(x: Tensor<3>, shape: [usize; D]) -> Tensor<D> {
    match D {
        3 => Tensor::from_dispatch(x.into_dispatch()),
        _ => x.reshape(shape),
    }
}

/// `input·weight + bias`: [`product`], or with `fusion` the product whose weight gradient
/// is accumulated in f32.
pub(crate) fn matmul_bias<const D: usize>(
    input: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    fusion: bool,
) -> Tensor<D> {
    let out = if fusion {
        linear_with_grad_accumulation(input, weight)
            .unwrap_or_else(|e| panic!("parallel linear layer: {e}"))
    } else {
        product(input, weight)
    };
    match bias {
        Some(b) => out + b.unsqueeze(),
        None => out,
    }
}

/// `a·b` (`a` `[..., k]`, `b` `[k, n]`, a weight or a view of one) through the kernels'
/// `linear`, whose forward and backward products are written once on Flex. Input that does
/// not fit goes to Burn's `linear`, which panics naming both shapes.
pub(crate) fn product<const D: usize>(a: Tensor<D>, b: Tensor<2>) -> Tensor<D> {
    burn_megatron_kernels::linear(a.clone(), b.clone())
        .unwrap_or_else(|_| burn::tensor::module::linear(a, b, None))
}

/// Panics, naming the layer and the numbers, when `input`'s last dimension is not the
/// width `weight` takes (dim 0 of this rank's `[in, out]` shard): a model written for one
/// device often reshapes an attention output to the input's full width, which at TP > 1 is
/// `tp` times what a row-parallel layer's shard takes. Burn's own `Linear` panics on a
/// mismatch as well; its forward has no room for an error.
fn check_width<const D: usize>(
    layer: &str,
    input: &Tensor<D>,
    weight: &Param<Tensor<2>>,
    tp: &Comm,
) {
    check_input_width(layer, input, weight.lazy_shape().to_vec()[0], Some(tp));
}

/// As [`check_width`], against a weight that takes `want` input features.
pub(crate) fn check_input_width<const D: usize>(
    layer: &str,
    input: &Tensor<D>,
    want: usize,
    tp: Option<&Comm>,
) {
    let got = input.dims()[D - 1];
    if got != want {
        let size = tp.map_or(1, |tp| tp.group().size());
        let hint = match got == want * size && size > 1 {
            true => format!(
                " ({got} is the full width: this rank takes 1/{size} of it; size reshapes from \
                 this rank's heads, dropin::attention_split, not from the \
                 input's width)"
            ),
            false => String::new(),
        };
        panic!("{layer}: the input has {got} features, this rank's weight takes {want}{hint}");
    }
}
