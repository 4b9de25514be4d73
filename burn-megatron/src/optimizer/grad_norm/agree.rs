//! How the ranks agree on a step's overflow and gradient norm: each rank's parts summed over
//! the groups that hold them (the distributed optimizer's data-parallel groups, the dense
//! model-parallel group, the experts' own).

use super::NormType;
use crate::comm::{Comm, CommError, CommunicatorExt};
use crate::optimizer::grad_scaler::GradScaler;

/// The groups a step's norm is summed over.
#[derive(Clone, Copy)]
pub(crate) struct NormGroups<'a> {
    /// The dense tp × pp group.
    pub(crate) model_parallel: &'a Comm,
    /// The experts' model-parallel group, when the experts count apart.
    pub(crate) experts: Option<&'a Comm>,
    /// A distributed optimizer's data-parallel group (each rank measured its pieces only).
    pub(crate) dp: Option<&'a Comm>,
    /// The same for the experts' pieces: the expert data-parallel group.
    pub(crate) expert_dp: Option<&'a Comm>,
    pub(crate) norm_type: NormType,
}

/// What one rank measured: its overflow flag (over every gradient it read) and its parts of
/// the norm over the dense and the expert parameters it counts.
#[derive(Clone, Copy)]
pub(crate) struct LocalParts {
    pub(crate) non_finite: bool,
    pub(crate) dense: f64,
    pub(crate) experts: f64,
}

/// Overflow and the gradient norm agreed by every rank holding a part of them, the scaler
/// updated with the verdict; the norm, or `None` when some rank saw inf or NaN.
///
/// 1. A distributed optimizer's parts are first combined over its data-parallel groups (the
///    dense parts over `dp`, the experts' over `expert_dp`), in f64 and in rank order, so the
///    norm is rounded to f32 once, as it is without one.
/// 2. With experts counted apart, their part is summed over the expert model-parallel group:
///    every rank then holds the experts' whole share, which enters the dense part divided by
///    the model-parallel size, so that step 3 adds it once.
/// 3. Overflow and norm go over the model-parallel group in one collective: a flag sums (or
///    maxes) to non-zero iff any rank saw one, and the norm reduces by the same operation.
pub(crate) fn agree_norm(
    parts: LocalParts,
    groups: NormGroups<'_>,
    scaler: Option<&mut Box<dyn GradScaler>>,
) -> Result<Option<f64>, CommError> {
    let norm_type = groups.norm_type;
    let LocalParts {
        mut non_finite,
        mut dense,
        mut experts,
    } = parts;
    if let Some(dp) = groups.dp {
        (non_finite, dense) = over_ranks(dp, non_finite, dense, norm_type)?;
    }
    if let Some(expert_dp) = groups.expert_dp {
        (non_finite, experts) = over_ranks(expert_dp, non_finite, experts, norm_type)?;
    }
    let part = match groups.experts {
        Some(expert_mp) => {
            let mut v = vec![f32::from(u8::from(non_finite)), experts as f32];
            expert_mp.all_reduce_vec(&mut v, norm_type.reduce_op())?;
            non_finite = non_finite || v[0] > 0.0 || !v[1].is_finite();
            let share = match norm_type {
                NormType::L2 => f64::from(v[1]) / groups.model_parallel.group().size() as f64,
                NormType::Inf => f64::from(v[1]),
            };
            norm_type.combine(dense, share)
        }
        None => norm_type.combine(dense, experts),
    };
    let mut v = vec![f32::from(u8::from(non_finite)), part as f32];
    groups
        .model_parallel
        .all_reduce_vec(&mut v, norm_type.reduce_op())?;
    let found_inf = v[0] > 0.0 || !v[1].is_finite();
    if let Some(s) = scaler {
        s.update(found_inf);
    }
    Ok((!found_inf).then(|| norm_type.finish(f64::from(v[1]))))
}

/// A flag and a norm part combined over `group`: gathered exactly (f64 bits) and reduced in
/// rank order, so every member gets the same bits.
fn over_ranks(
    group: &Comm,
    flag: bool,
    part: f64,
    norm_type: NormType,
) -> Result<(bool, f64), CommError> {
    let all = group.all_gather_vec(vec![i64::from(flag), part.to_bits() as i64])?;
    let flag = all.chunks(2).any(|c| c[0] != 0);
    let parts = all.chunks(2).map(|c| f64::from_bits(c[1] as u64));
    let part = match norm_type {
        NormType::L2 => parts.sum(),
        NormType::Inf => parts.fold(0.0, f64::max),
    };
    Ok((flag, part))
}
