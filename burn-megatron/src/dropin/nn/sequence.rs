//! Sequence parallelism inside a split encoder or decoder (`TpPlan::sequence_parallel`,
//! Megatron's `--sequence-parallel`): between the tensor-parallel blocks, each rank holds
//! `s / tp` positions of the residual stream, so the norms, the residual dropout and the
//! residual adds store a `tp`-th of their activations. A block gathers the sequence for its
//! column-parallel layers (reduce-scattering their input gradient) and reduce-scatters its
//! row-parallel output instead of all-reducing it: forward, the bytes of tensor parallelism
//! alone. Backward gathers the sequence again for the weight gradients rather than keep it,
//! as Megatron does: one more all-gather a block, the price of the memory.
//!
//! Burn's layers take `[b, s, d]`; Megatron's mappings split dim 0, so the sequence is
//! brought to the front around each mapping (a strided view here, a copy on a GPU).

use super::Linear;
use crate::comm::Comm;
use crate::grad_hooks::hook_param;
use crate::tensor_parallel::mappings::{
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
};
use crate::tensor_parallel::{check_input_width, gathered_product, split_weight};
use burn::module::Param;
use burn::nn::LayerNorm;
use burn::tensor::{Bool, Device, Tensor, TensorData};

/// `norm` whose parameters' gradients are summed over the group in backward: under sequence
/// parallelism each rank normalises its own positions, so its gradients are partial sums.
/// Summed inside the graph (Megatron sums them once, in `finalize_model_grads`, as the
/// built-in layers do through `allreduce_sequence_parallel_grads`), so that a plain Burn
/// training loop steps on whole gradients.
pub(super) fn norm_over_sequence(norm: &LayerNorm, tp: &Comm) -> LayerNorm {
    let summed = |p: &Param<Tensor<1>>| {
        Param::initialized(p.id, copy_to_tensor_model_parallel_region(p.val(), tp))
    };
    let mut norm = norm.clone();
    norm.gamma = summed(&norm.gamma);
    norm.beta = norm.beta.as_ref().map(summed);
    norm
}

/// The column-parallel `linears`' outputs (`[b, s, o_i / tp]`, biases added) over the whole
/// sequence from this rank's positions `x` (`[b, s / tp, d]`): one all-gather for all of them
/// (their weights side by side), and backward gathers again rather than keeping the gathered
/// copy, so the block keeps only this rank's positions.
pub(super) fn column_products<const N: usize>(
    x: Tensor<3>,
    tp: &Comm,
    linears: [&Linear; N],
) -> [Tensor<3>; N] {
    let weights: Vec<Tensor<2>> = linears
        .iter()
        .map(|l| {
            let want = l.weight.lazy_shape().dims::<2>()[0];
            check_input_width("Linear (column-parallel)", &x, want, Some(tp));
            if let Some(a) = &l.tp.assigned {
                l.restate(a);
            }
            // With a LoRA adapter, its whole factor's gradient summed over the ranks.
            split_weight(&l.weight, 1, tp, |p| hook_param(p, &x))
        })
        .collect();
    let widths: Vec<usize> = weights.iter().map(|w| w.dims()[1]).collect();
    let weight = match <[Tensor<2>; 1]>::try_from(weights) {
        Ok([weight]) => weight,
        Err(weights) => Tensor::cat(weights, 1),
    };
    let y = gathered_product(x.clone(), weight, 1, false, tp);
    std::array::from_fn(|i| {
        let start: usize = widths[..i].iter().sum();
        let out = match N {
            1 => y.clone(),
            _ => y.clone().narrow(2, start, widths[i]),
        };
        match &linears[i].bias {
            Some(b) => out + hook_param(b, &x).unsqueeze(),
            None => out,
        }
    })
}

/// Where a row-parallel layer's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::dropin) enum Region {
    /// Whole on every rank: the partial products are all-reduced.
    Tensor,
    /// Split by sequence around the block: the partial products are reduce-scattered over
    /// the sequence (dim 1), and the bias is added to this rank's positions (its gradient
    /// summed backward). The block's column-parallel layers are [`column_products`].
    Sequence,
}

/// This rank's positions of `x` `[b, s, d]` (the gradient all-gathered backward).
///
/// # Panics
///
/// When `s` does not split over the group, naming `what` and the numbers: the layers pad the
/// sequence first ([`missing_positions`]), so only a stack whose layers were split over
/// groups of different sizes gets here.
fn scatter(x: Tensor<3>, tp: &Comm, what: &str) -> Tensor<3> {
    let (s, n) = (x.dims()[1], tp.group().size());
    assert!(
        s.is_multiple_of(n),
        "{what} with sequence parallelism: a sequence of {s} positions does not split over \
         {n} tensor-parallel ranks"
    );
    scatter_to_sequence_parallel_region(x.swap_dims(0, 1), tp).swap_dims(0, 1)
}

/// The whole sequence from every rank's positions, for what every rank computes alike (its
/// gradient, whole and the same on every rank, cut to this rank's positions backward).
fn gather(x: Tensor<3>, tp: &Comm) -> Tensor<3> {
    gather_from_sequence_parallel_region(x.swap_dims(0, 1), tp, false).swap_dims(0, 1)
}

/// How many positions a sequence of `s` needs at its end to split over `sp`'s group (none
/// without sequence parallelism). Megatron requires the length to divide; a Burn model's
/// batches need not, so the split layers pad: the added positions are zeros, masked as
/// padding for every query ([`pad_mask`]), and cut off the output, so that the real positions
/// compute what they would unpadded.
pub(super) fn missing_positions(s: usize, sp: Option<&Comm>) -> usize {
    sp.map_or(0, |tp| s.next_multiple_of(tp.group().size()) - s)
}

/// The first `s` positions of `x` `[b, s', d]`: a padded sequence's own.
pub(super) fn cut(x: Tensor<3>, s: usize) -> Tensor<3> {
    match x.dims()[1] == s {
        true => x,
        false => x.narrow(1, 0, s),
    }
}

/// `x` `[b, s, d]` with `extra` positions of zeros after its own.
pub(super) fn pad_positions(x: Tensor<3>, extra: usize) -> Tensor<3> {
    if extra == 0 {
        return x;
    }
    let [b, _, d] = x.dims();
    let zeros = Tensor::zeros([b, extra, d], (&x.device(), x.dtype()));
    Tensor::cat(vec![x, zeros], 1)
}

/// The padding mask `[b, s + extra]` of a sequence `[b, s]` with `extra` positions added:
/// those masked, the others as `mask` says (none given: none masked).
pub(super) fn pad_mask(
    mask: Option<Tensor<2, Bool>>,
    [b, s]: [usize; 2],
    extra: usize,
    device: &Device,
) -> Option<Tensor<2, Bool>> {
    if extra == 0 {
        return mask;
    }
    let fill = |value: bool, n: usize| {
        Tensor::<2, Bool>::from_data(TensorData::new(vec![value; b * n], [b, n]), device)
    };
    let mask = mask.unwrap_or_else(|| fill(false, s));
    Some(Tensor::cat(vec![mask, fill(true, extra)], 1))
}

/// An attention mask `[b, q, k]` with `rows` more queries and `cols` more keys, none of them
/// masked here: the padding mask keeps every query from the added keys, and the added
/// queries' outputs are cut off.
pub(super) fn pad_attn(
    mask: Option<Tensor<3, Bool>>,
    rows: usize,
    cols: usize,
) -> Option<Tensor<3, Bool>> {
    let grow = |m: Tensor<3, Bool>, dim: usize, n: usize| {
        if n == 0 {
            return m;
        }
        let mut dims = m.dims();
        dims[dim] = n;
        let none = vec![false; dims.iter().product()];
        let added = Tensor::<3, Bool>::from_data(TensorData::new(none, dims), &m.device());
        Tensor::cat(vec![m, added], dim)
    };
    mask.map(|m| grow(grow(m, 2, cols), 1, rows))
}

/// The residual stream between transformer layers: whole on every rank, or split by
/// sequence over a group. Each layer takes it as its slot says; the stack gathers it at the
/// end, so a split encoder's output is whole as Burn's is.
pub(super) struct Stream {
    x: Tensor<3>,
    split: Option<Comm>,
}

impl Stream {
    /// A stream every rank holds whole.
    pub(super) fn whole(x: Tensor<3>) -> Self {
        Self { x, split: None }
    }

    /// The stream split over `sp`'s group if given, else whole, moving it as needed; `what`
    /// names the layer in a sequence that does not split.
    pub(super) fn to(self, sp: Option<&Comm>, what: &str) -> Self {
        match (self.split, sp) {
            (None, Some(tp)) => Self {
                x: scatter(self.x, tp, what),
                split: Some(tp.clone()),
            },
            (Some(tp), None) => Self::whole(gather(self.x, &tp)),
            (split, _) => Self { x: self.x, split },
        }
    }

    /// `f` of the tensor, the split unchanged.
    pub(super) fn map(self, f: impl FnOnce(Tensor<3>) -> Tensor<3>) -> Self {
        Self {
            x: f(self.x),
            split: self.split,
        }
    }

    /// The whole stream.
    pub(super) fn into_whole(self) -> Tensor<3> {
        self.to(None, "").x
    }
}
