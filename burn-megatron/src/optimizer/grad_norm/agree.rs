//! How the ranks agree on a step's overflow and gradient norm: each rank's part summed over
//! the groups that hold the parts (the dense model-parallel group, the experts' own).

use super::NormType;
use crate::comm::{Comm, CommError, CommunicatorExt};
use crate::optimizer::grad_scaler::GradScaler;

/// The groups a step's norm is summed over.
#[derive(Clone, Copy)]
pub(crate) struct NormGroups<'a> {
    pub(crate) model_parallel: &'a Comm,
    pub(crate) experts: Option<&'a Comm>,
    pub(crate) norm_type: NormType,
}

/// This rank's dense overflow flag and norm part joined by the experts' (`expert_flag`,
/// `expert_part`, this rank's), summed over the expert model-parallel group: every rank then
/// holds the experts' whole share (expert data-parallel replicas agree after finalize), which
/// enters the dense part so that the model-parallel reduction adds it once. Collective over
/// that group.
pub(crate) fn with_experts(
    groups: NormGroups<'_>,
    flag: bool,
    part: f64,
    expert_flag: bool,
    expert_part: f64,
) -> Result<(bool, f64), CommError> {
    let Some(expert_mp) = groups.experts else {
        return Ok((flag, part));
    };
    let norm_type = groups.norm_type;
    let mut v = vec![f32::from(u8::from(expert_flag)), expert_part as f32];
    expert_mp.all_reduce_vec(&mut v, norm_type.reduce_op())?;
    let experts = f64::from(v[1]);
    let flag = flag || v[0] > 0.0 || !v[1].is_finite();
    let share = match norm_type {
        NormType::L2 => experts / groups.model_parallel.group().size() as f64,
        NormType::Inf => experts,
    };
    Ok((flag, norm_type.combine(part, share)))
}

/// Overflow and the gradient norm agreed by every rank holding a part of them, the scaler
/// updated with the verdict; the norm, or `None` when some rank saw inf or NaN.
///
/// A distributed optimizer's parts are first combined over its data-parallel group `dp`, in
/// f64 and in rank order, so that the norm is rounded to f32 once, as it is without one. Then
/// overflow and norm go over the model-parallel group in one collective: a flag sums (or
/// maxes) to non-zero iff any rank saw one, and the norm reduces by the same operation.
pub(crate) fn agree_norm(
    mut non_finite: bool,
    mut norm_part: f64,
    dp: Option<&Comm>,
    model_parallel: &Comm,
    norm_type: NormType,
    scaler: Option<&mut Box<dyn GradScaler>>,
) -> Result<Option<f64>, CommError> {
    if let Some(dp) = dp {
        let all = dp.all_gather_vec(vec![i64::from(non_finite), norm_part.to_bits() as i64])?;
        non_finite = all.chunks(2).any(|c| c[0] != 0);
        let parts = all.chunks(2).map(|c| f64::from_bits(c[1] as u64));
        norm_part = match norm_type {
            NormType::L2 => parts.sum(),
            NormType::Inf => parts.fold(0.0, f64::max),
        };
    }
    let mut v = vec![f32::from(u8::from(non_finite)), norm_part as f32];
    model_parallel.all_reduce_vec(&mut v, norm_type.reduce_op())?;
    let found_inf = v[0] > 0.0 || !v[1].is_finite();
    if let Some(s) = scaler {
        s.update(found_inf);
    }
    Ok((!found_inf).then(|| norm_type.finish(f64::from(v[1]))))
}
