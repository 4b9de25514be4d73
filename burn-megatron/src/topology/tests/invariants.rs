//! Structural invariants checked over every rank of several layouts.

use std::collections::BTreeSet;

use crate::topology::{
    GroupKind, ParallelConfig, ParallelDim, ParallelState, RankGenerator, TopologyError,
};

const TOKENS: [&str; 12] = [
    "tp",
    "cp",
    "ep",
    "dp",
    "pp",
    "tp-pp",
    "tp-dp",
    "dp-cp",
    "tp-dp-cp",
    "tp-cp",
    "cp-pp",
    "tp-cp-ep-dp-pp",
];

/// Every token's groups partition the world into equal, ascending groups whose members
/// differ only along the requested dimensions, and `group_of` agrees with `get_ranks`.
fn check_generator(g: &RankGenerator) -> Result<(), TopologyError> {
    let world = g.world_size();
    for rank in 0..world {
        assert_eq!(g.rank_of(&g.coords(rank)?)?, rank);
    }
    for token in TOKENS {
        let requested: Vec<ParallelDim> = token
            .split('-')
            .map(|t| ParallelDim::from_token(t).unwrap())
            .collect();
        let group_size: usize = requested.iter().map(|&dim| g.size(dim)).product();
        let groups = g.get_ranks(token)?;
        assert_eq!(groups.len(), world / group_size, "{token}");
        let mut seen = BTreeSet::new();
        for group in &groups {
            assert_eq!(group.len(), group_size, "{token}");
            assert!(group.windows(2).all(|w| w[0] < w[1]), "{token}: {group:?}");
            let first = g.coords(group[0])?;
            for &member in group {
                assert!(seen.insert(member), "{token}: rank {member} twice");
                assert_eq!(&g.group_of(token, member)?, group);
                let coords = g.coords(member)?;
                for dim in ParallelDim::ALL
                    .into_iter()
                    .filter(|d| !requested.contains(d))
                {
                    assert_eq!(coords.get(dim), first.get(dim), "{token}: {group:?}");
                }
            }
        }
        assert_eq!(seen, (0..world).collect::<BTreeSet<_>>(), "{token}");
        // Groups come in Megatron's order: first members strictly increase.
        assert!(groups.windows(2).all(|w| w[0][0] < w[1][0]), "{token}");
    }
    Ok(())
}

#[test]
fn generator_invariants() -> Result<(), TopologyError> {
    for (tp, ep, dp, pp, cp, order) in [
        (1, 1, 1, 1, 1, "tp-cp-ep-dp-pp"),
        (2, 1, 2, 2, 1, "tp-cp-ep-dp-pp"),
        (2, 1, 2, 2, 1, "tp-pp-dp"),
        (2, 1, 2, 1, 2, "tp-cp-ep-dp-pp"),
        (2, 2, 3, 2, 2, "tp-cp-ep-dp-pp"),
        (4, 1, 8, 2, 1, "tp-cp-ep-dp-pp"),
        (2, 1, 2, 2, 2, "pp-dp-cp-tp"),
        (3, 1, 1, 2, 4, "cp-tp-pp"),
    ] {
        check_generator(&RankGenerator::new(tp, ep, dp, pp, cp, order)?)?;
    }
    Ok(())
}

#[test]
fn state_agrees_with_all_groups() -> Result<(), TopologyError> {
    for (world, tp, pp) in [
        (1, 1, 1),
        (2, 2, 1),
        (4, 1, 4),
        (8, 2, 2),
        (16, 2, 4),
        (64, 4, 2),
    ] {
        let config = ParallelConfig::new(world, tp, pp).validate()?;
        let all: Vec<Vec<Vec<usize>>> = GroupKind::ALL
            .iter()
            .map(|&kind| config.all_groups(kind))
            .collect();
        let mut embedding_members = BTreeSet::new();
        for rank in 0..world {
            let s = ParallelState::new(&config, rank)?;
            let c = s.coords();
            assert_eq!(s.index_in_group(GroupKind::TensorModelParallel), Some(c.tp));
            assert_eq!(
                s.index_in_group(GroupKind::PipelineModelParallel),
                Some(c.pp)
            );
            assert_eq!(s.index_in_group(GroupKind::DataParallel), Some(c.dp));
            assert_eq!(s.tensor_model_parallel_group().len(), tp);
            assert_eq!(s.pipeline_model_parallel_group().len(), pp);
            assert_eq!(s.data_parallel_group().len(), world / (tp * pp));
            assert_eq!(s.model_parallel_group().len(), tp * pp);
            for (kind, groups) in GroupKind::ALL.iter().zip(&all) {
                assert!(
                    groups.iter().any(|g| g == s.group(*kind)),
                    "{kind} rank {rank}"
                );
            }
            if s.is_rank_in_embedding_group() {
                embedding_members.insert(rank);
            }
            assert_eq!(
                s.is_rank_in_embedding_group(),
                s.is_pipeline_first_stage() || s.is_pipeline_last_stage()
            );
            let next = ParallelState::new(&config, s.pipeline_next_rank())?;
            assert_eq!(next.pipeline_prev_rank(), rank);
        }
        let flat: BTreeSet<usize> = config
            .all_groups(GroupKind::Embedding)
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(flat, embedding_members);
    }
    Ok(())
}
