//! A split layer's parameter cut to this rank's part: its values narrowed (and padded with
//! zeros past a padded vocabulary's end), or, when Burn has not drawn it yet, drawn lazily
//! from the layer's default law of the whole tensor, so that every TP size draws the same
//! weights.

use super::master_init;
use crate::comm::Comm;
use crate::tensor_parallel::MasterInit;
use crate::tensor_parallel::{derive_seed, lazy_host_param, shard_param};
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::ops::PadMode;
use burn::tensor::{Tensor, TensorCreationOptions};

/// Where a parameter of a split layer goes, and how it is drawn if it has no values yet.
pub(super) struct Placement<'a> {
    /// The initializer the layer's config named (none: Burn's default for its type).
    pub(super) init: Option<&'a Initializer>,
    /// The split dimension (`None`: every rank holds it whole).
    pub(super) dim: Option<usize>,
    /// The split dimension's extent with padding, when the layer's vocabulary is padded.
    pub(super) padded: Option<usize>,
    /// Whether the layer is split over a vocabulary (which padding would make split).
    pub(super) vocab: bool,
    pub(super) layer: &'a str,
    pub(super) path: &'a str,
    /// The path its draw is seeded by: the whole model's, on a pipeline stage.
    pub(super) seed_path: &'a str,
    pub(super) seed: u64,
    /// A linear weight in Burn's column layout.
    pub(super) col: bool,
    /// The fan-in and fan-out Burn's initializer is given for the parameter.
    pub(super) fans: (Option<usize>, Option<usize>),
}

/// The shape of `param`, as Burn's layer built it (not a plan's shard), as the layer holds
/// it (a linear's weight `[in, out]`), drawn or not: Burn draws a column-layout weight
/// (`col`) `[out, in]` and transposes it when first read.
pub(super) fn held_dims<const D: usize>(param: &Param<Tensor<D>>, col: bool) -> [usize; D] {
    let mut dims: [usize; D] = param.lazy_shape().dims();
    if col && !param.is_initialized() {
        dims.reverse();
    }
    dims
}

/// `param`'s part on this rank: its values cut along the split dimension (zeros past the
/// real extent of a padded one), or, not yet initialised, drawn lazily from the layer's
/// default law seeded by its path (a duplicated one too: Burn's own draw would differ across
/// ranks running as threads).
pub(super) fn shard<const D: usize>(
    param: Param<Tensor<D>>,
    at: Placement<'_>,
    tp: &Comm,
) -> Result<Param<Tensor<D>>, (Param<Tensor<D>>, String)> {
    let frozen = is_frozen(&param);
    let shard = cut(param, at, tp)?;
    Ok(trainable_as(shard, frozen))
}

/// [`shard`], trainable whatever the parameter was.
fn cut<const D: usize>(
    param: Param<Tensor<D>>,
    at: Placement<'_>,
    tp: &Comm,
) -> Result<Param<Tensor<D>>, (Param<Tensor<D>>, String)> {
    let (rank, size) = (tp.group().rank(), tp.group().size());
    let dims = held_dims(&param, at.col);
    let Some(dim) = at.dim else {
        return match param.is_initialized() {
            true => Ok(param),
            false => lazy_draw(param, &at, dims, (0, dims[0])),
        };
    };
    let extent = at.padded.unwrap_or(dims[dim]);
    if !extent.is_multiple_of(size) {
        let hint = match at.vocab {
            true => "; pad the vocabulary with the plan's make_vocab_size_divisible_by",
            false => "",
        };
        let e = format!(
            "{}: {} features along dim {dim} do not split over the tensor-parallel size \
             {size}{hint}",
            at.path, dims[dim]
        );
        return Err((param, e));
    }
    let part = extent / size;
    let start = rank * part;
    if !param.is_initialized() {
        return lazy_draw(param, &at, dims, (start, part));
    }
    // The real entries this rank holds, then zeros up to its part.
    let real = dims[dim].saturating_sub(start).min(part);
    let value = param.val();
    let value = match real {
        0 => {
            let mut local = dims;
            local[dim] = part;
            let options = TensorCreationOptions::new(value.device()).with_dtype(value.dtype());
            Tensor::zeros(local, options)
        }
        _ => {
            let mut pad = [(0, 0); D];
            pad[dim] = (0, part - real);
            value
                .narrow(dim, start, real)
                .pad(pad, PadMode::Constant(0.0))
        }
    };
    Ok(shard_param(value))
}

/// Whether `param` is frozen (Burn's `freeze`, or what a LoRA adapter froze): in training it
/// would not require a gradient, on whatever device it is. Read without drawing a lazy
/// parameter: Burn's loading gives a stand-in the parameter's training state (its own load
/// mapper replaced, so that nothing of the user's runs on the stand-in), and `train` applies
/// it.
pub(super) fn is_frozen<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    let probe = Tensor::<D>::zeros([1; D], &param.lazy_device());
    let stand_in = param
        .clone()
        .load_mapper(|t| t)
        .transform_for_load(probe, param.id);
    !stand_in.train().val().is_require_grad()
}

/// `param` (a shard, trainable where the device trains), frozen when the parameter it was cut
/// from was: a plan must not train what the model froze.
pub(super) fn trainable_as<const D: usize>(
    param: Param<Tensor<D>>,
    frozen: bool,
) -> Param<Tensor<D>> {
    match frozen {
        true => param.set_require_grad(false),
        false => param,
    }
}

/// `param`'s entries `start..start + part` along `at.dim` (zeros past its real extent), drawn
/// when first read from the layer's default law of the whole tensor, seeded by its path.
fn lazy_draw<const D: usize>(
    param: Param<Tensor<D>>,
    at: &Placement<'_>,
    dims: [usize; D],
    (start, part): (usize, usize),
) -> Result<Param<Tensor<D>>, (Param<Tensor<D>>, String)> {
    let law = match law(at) {
        Ok(law) => law,
        Err(e) => return Err((param, e)),
    };
    let dim = at.dim.unwrap_or(0);
    let mut local = dims;
    local[dim] = part;
    let (seed, device) = (derive_seed(at.seed, at.seed_path), param.lazy_device());
    let (total, fan_in) = (dims.iter().product::<usize>(), at.fans.0.unwrap_or(1));
    Ok(lazy_host_param(local, &device, move || {
        let full = law.values(total, fan_in, seed);
        slice_padded(&full, &dims, dim, start, part)
    }))
}

/// Entries `start..start + part` along `dim` of the row-major tensor `full` of shape `dims`,
/// zeros where they pass its end.
fn slice_padded(full: &[f32], dims: &[usize], dim: usize, start: usize, part: usize) -> Vec<f32> {
    let inner: usize = dims[dim + 1..].iter().product();
    let (outer, extent) = (dims[..dim].iter().product::<usize>(), dims[dim]);
    let mut out = Vec::with_capacity(outer * part * inner);
    for o in 0..outer {
        for i in start..start + part {
            match i < extent {
                true => {
                    let at = (o * extent + i) * inner;
                    out.extend_from_slice(&full[at..at + inner]);
                }
                false => out.extend(std::iter::repeat_n(0.0, inner)),
            }
        }
    }
    out
}

/// The law of a layer's parameters: its config's initializer, or Burn's default for a
/// `Linear` or an `Embedding` (a layer converted from Burn's, which does not keep it).
fn law(at: &Placement<'_>) -> Result<MasterInit, String> {
    let init = match (at.init, at.layer) {
        (Some(init), _) => init.clone(),
        (None, "Struct:Linear") => burn::nn::LinearConfig::new(1, 1).initializer,
        (None, "Struct:Embedding") => burn::nn::EmbeddingConfig::new(1, 1).initializer,
        (None, other) => return Err(format!("{}: no default initializer for {other}", at.path)),
    };
    master_init(&init, at.fans.0, at.fans.1).map_err(|e| format!("{}: {e}", at.path))
}
