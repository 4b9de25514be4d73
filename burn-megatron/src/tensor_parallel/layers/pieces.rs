//! The pieces of a parallel linear layer's forward around its product, for a region that
//! forms the product and its gradients itself (`recompute::recompute_linear_input`).

use super::{ColumnParallelLinear, RowParallelLinear};
use crate::grad_hooks::hook_param;
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region,
};
use burn::module::{Module, Param};
use burn::tensor::Tensor;

/// A layer's forward split around its product: [`parallel_input`](Self::parallel_input),
/// this rank's product `x·W (+ added bias)`, then [`finish`](Self::finish) compute what
/// `forward_with_bias` computes. `forward_with_bias` does not call them: under sequence
/// parallelism it fuses the all-gather into the product (`gather_sequence_matmul`, which
/// gathers again in backward instead of keeping the gathered input), while
/// `parallel_input` gathers with `gather_from_sequence_parallel_region`, whose gathered
/// input lives as long as the region's graph.
pub(crate) trait LinearShard: Module + Clone + Send + 'static {
    /// This rank's weight, `[d_input, d_output]` of its shard.
    fn weight(&self) -> &Param<Tensor<2>>;
    /// The input as this rank's product sees it: all-gathered from the sequence-parallel
    /// region or entering the tensor-parallel one (column), split (a row layer whose input
    /// is not parallel), or as it is.
    fn parallel_input(&self, input: Tensor<3>) -> Tensor<3>;
    /// The bias the product adds (a column layer's, unless `skip_bias_add`; a row layer
    /// adds its own after the reduction).
    fn added_bias(&self) -> Option<&Param<Tensor<1>>>;
    /// The product finished as `forward_with_bias` finishes it: gathered (`gather_output`)
    /// or reduced (a row layer), and the bias added or returned (`skip_bias_add`; hooked at
    /// `anchor`).
    fn finish(&self, product: Tensor<3>, anchor: &Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>);
    /// Whether the weight gradient is accumulated in f32 (`gradient_accumulation_fusion`).
    fn accumulates_in_f32(&self) -> bool;
    /// The layer's own `forward_with_bias`.
    fn forward_plain(&self, input: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>);
    /// Whether [`finish`](Self::finish) returns the product as it is (and no bias), so a
    /// caller may skip it after [`state_layout`](Self::state_layout).
    fn finishes_as_is(&self) -> bool;
    /// States the parameters' layout, as every forward does.
    fn state_layout(&self);
}

impl LinearShard for ColumnParallelLinear {
    fn forward_plain(&self, input: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        self.forward_with_bias(input)
    }

    fn weight(&self) -> &Param<Tensor<2>> {
        &self.weight
    }

    fn parallel_input(&self, input: Tensor<3>) -> Tensor<3> {
        if self.sequence_parallel {
            gather_from_sequence_parallel_region(input, &self.tp, true)
        } else {
            copy_to_tensor_model_parallel_region(input, &self.tp)
        }
    }

    fn added_bias(&self) -> Option<&Param<Tensor<1>>> {
        self.bias.as_ref().filter(|_| !self.skip_bias_add)
    }

    fn finish(&self, product: Tensor<3>, anchor: &Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        self.state_attrs();
        let skipped = match &self.bias {
            Some(b) if self.skip_bias_add => Some(hook_param(b, anchor)),
            _ => None,
        };
        let out = if self.gather_output {
            gather_from_tensor_model_parallel_region(product, &self.tp)
        } else {
            product
        };
        (out, skipped)
    }

    fn accumulates_in_f32(&self) -> bool {
        self.gradient_accumulation_fusion
    }

    fn finishes_as_is(&self) -> bool {
        !(self.gather_output || self.skip_bias_add && self.bias.is_some())
    }

    fn state_layout(&self) {
        self.state_attrs();
    }
}

impl LinearShard for RowParallelLinear {
    fn forward_plain(&self, input: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        self.forward_with_bias(input)
    }

    fn weight(&self) -> &Param<Tensor<2>> {
        &self.weight
    }

    fn parallel_input(&self, input: Tensor<3>) -> Tensor<3> {
        if self.input_is_parallel {
            input
        } else {
            scatter_to_tensor_model_parallel_region(input, &self.tp)
        }
    }

    fn added_bias(&self) -> Option<&Param<Tensor<1>>> {
        None
    }

    fn finish(&self, product: Tensor<3>, anchor: &Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        self.state_attrs();
        let bias = self.bias.as_ref().map(|b| hook_param(b, anchor));
        self.reduce(product, bias)
    }

    fn accumulates_in_f32(&self) -> bool {
        self.gradient_accumulation_fusion
    }

    fn finishes_as_is(&self) -> bool {
        false
    }

    fn state_layout(&self) {
        self.state_attrs();
    }
}
