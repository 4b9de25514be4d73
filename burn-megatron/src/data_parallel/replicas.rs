//! The data-parallel replicas of a model must hold the same weights: each averages its
//! gradient with the others', so replicas drawn apart train a mix of models and no error
//! shows it. A model the library builds draws alike on every replica (`MasterInit`, the
//! plans' seeds); a Burn model built on each rank does not (Burn's initializers draw from
//! one process-wide generator, which ranks as threads share and processes seed apart).
//! [`broadcast_params`] gives every replica the first one's weights, as Megatron's
//! `DistributedDataParallel.broadcast_params` and PyTorch's DDP at construction do, and
//! [`check_replicas`] finds a parameter whose replicas differ.

use crate::comm::{Comm, CommError, CommunicatorExt};
use crate::module_path::{PathMapper, PathVisitor, map_paths, visit_paths};
use crate::tensor_parallel::parallel_attrs;
use burn::module::{Module, Param};
use burn::tensor::Tensor;

/// `model` with every float parameter and buffer (a `RunningState`, such as `BatchNorm`'s
/// running statistics) replaced by the first member's value over its data-parallel group:
/// `dp` for the dense parameters, `expert_dp` for the experts' (Megatron's
/// `broadcast_params`); a dense parameter every tensor-parallel rank holds whole (a layer no
/// plan split) then also takes `tp`'s first member's. Ids and `require_grad` are kept. A
/// collective over the three groups: every rank calls it, with the same model structure.
///
/// Call it once the replicas are built, before the optimizer is: an optimizer copies the
/// weights it is built with (its FP32 master weights, or its shards of them) and its first
/// step writes them back.
pub fn broadcast_params<M: Module>(
    model: M,
    dp: &Comm,
    expert_dp: &Comm,
    tp: &Comm,
) -> Result<M, CommError> {
    struct Broadcast<'a> {
        groups: [&'a Comm; 3],
        error: Option<CommError>,
    }
    impl PathMapper for Broadcast<'_> {
        fn map<const D: usize>(&mut self, _: &str, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let [dp, expert_dp, tp] = self.groups;
            let groups = match replicated_over(p.id) {
                Replicas::Experts => vec![expert_dp],
                Replicas::DataParallel => vec![dp],
                Replicas::DataAndTensorParallel => vec![dp, tp],
            };
            let (id, mut value, mapper) = p.consume();
            let require_grad = value.is_require_grad();
            for group in groups {
                if self.error.is_some() || group.group().size() == 1 {
                    continue;
                }
                match crate::comm::tensor::broadcast(&**group, value.clone().detach(), 0) {
                    Ok(first) => value = first.set_require_grad(require_grad),
                    Err(e) => self.error = Some(e),
                }
            }
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let mut broadcast = Broadcast {
        groups: [dp, expert_dp, tp],
        error: None,
    };
    let model = map_paths(model, &mut broadcast);
    match broadcast.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// An error naming the first trained parameter whose values differ between the members of
/// its data-parallel group (`dp`, or `expert_dp` for an expert's; and `tp` for a dense
/// parameter every tensor-parallel rank holds whole), and the fix. Each member
/// hashes its values (CRC-32 of their bytes) and the members compare the hashes: one small
/// all-gather per group, but a read of every parameter to the host, so a loop runs it once.
/// Frozen parameters (`require_grad` off) and buffers are not compared: no gradient of
/// theirs is averaged, and each rank's `BatchNorm` statistics differ by design. The ranks
/// then agree over `world`, so that every rank returns an error when any group's replicas
/// differ, and none waits on a peer that stopped.
pub fn check_replicas<M: Module>(
    model: &M,
    dp: &Comm,
    expert_dp: &Comm,
    tp: &Comm,
    world: &Comm,
) -> Result<(), CommError> {
    #[derive(Default)]
    struct Hashes {
        /// (path, hash) of the dense parameters, the experts', and the dense ones every
        /// tensor-parallel rank holds whole.
        dense: Vec<(String, i64)>,
        experts: Vec<(String, i64)>,
        whole: Vec<(String, i64)>,
    }
    impl PathVisitor for Hashes {
        fn visit<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            let value = p.val();
            if !value.is_require_grad() {
                return;
            }
            let entry = (
                path.to_string(),
                i64::from(crc32fast::hash(value.into_data().as_bytes())),
            );
            match replicated_over(p.id) {
                Replicas::Experts => self.experts.push(entry),
                Replicas::DataParallel => self.dense.push(entry),
                Replicas::DataAndTensorParallel => {
                    self.whole.push(entry.clone());
                    self.dense.push(entry);
                }
            }
        }
    }
    let mut hashes = Hashes::default();
    visit_paths(model, &mut hashes);
    // Every group gathers whatever the first finds, so that every member of each takes part.
    let dense = compare(&hashes.dense, dp, "data-parallel replicas");
    let experts = compare(&hashes.experts, expert_dp, "data-parallel replicas");
    let whole = compare(&hashes.whole, tp, "tensor-parallel ranks");
    let local = dense.and(experts).and(whole);
    let failed = world.any_rank(local.is_err())?;
    match (local, failed) {
        (Err(e), _) => Err(e),
        (Ok(()), false) => Ok(()),
        (Ok(()), true) => Err(CommError::InvalidArgument {
            group: world.group().name().to_string(),
            op: "check_replicas",
            reason: "the replicas of another data-parallel group differ (its ranks name the \
                     parameter)"
                .to_string(),
        }),
    }
}

/// Which groups hold a parameter alike.
enum Replicas {
    /// An expert's: its expert data-parallel group.
    Experts,
    /// A tensor-parallel shard: its data-parallel group.
    DataParallel,
    /// A dense parameter every tensor-parallel rank holds whole: both groups.
    DataAndTensorParallel,
}

fn replicated_over(id: burn::module::ParamId) -> Replicas {
    let attrs = parallel_attrs(id);
    match (attrs.expert, attrs.tensor_model_parallel) {
        (true, _) => Replicas::Experts,
        (false, true) => Replicas::DataParallel,
        (false, false) => Replicas::DataAndTensorParallel,
    }
}

/// The members' `hashes` compared: the first parameter whose hashes differ, as an error
/// naming `who` holds them.
fn compare(hashes: &[(String, i64)], group: &Comm, who: &str) -> Result<(), CommError> {
    let size = group.group().size();
    if size == 1 {
        return Ok(());
    }
    let n = hashes.len();
    let mine: Vec<i64> = std::iter::once(n as i64)
        .chain(hashes.iter().map(|(_, h)| *h))
        .collect();
    // The count first: replicas with different parameter lists gather unequal lengths,
    // which the collective reports as a mismatch.
    let all = group.all_gather_vec(mine)?;
    let members: Vec<&[i64]> = all.chunks(n + 1).map(|m| &m[1..]).collect();
    let differs = (0..n).find(|&i| members.iter().any(|m| m[i] != members[0][i]));
    let Some(i) = differs else {
        return Ok(());
    };
    let ranks = group.group().ranks();
    let apart: Vec<usize> = (0..size)
        .filter(|&m| members[m][i] != members[0][i])
        .map(|m| ranks[m])
        .collect();
    Err(CommError::InvalidArgument {
        group: group.group().name().to_string(),
        op: "check_replicas",
        reason: format!(
            "the {who} hold different values of `{}` (global ranks \
             {apart:?} differ from rank {}), so the ranks would train a mix of models. Build every replica from one seed or record, or pass the model \
             through `ParallelTraining::broadcast_params` after init, before building the \
             optimizer",
            hashes[i].0, ranks[0]
        ),
    })
}
