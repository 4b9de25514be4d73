//! `ParallelState` fields and groups for specific ranks, and `GroupKind`.

use crate::topology::{GroupKind, ParallelConfig, ParallelState, RankCoords, TopologyError};

fn state(world: usize, tp: usize, pp: usize, rank: usize) -> ParallelState {
    let config = ParallelConfig::new(world, tp, pp).validate().unwrap();
    ParallelState::new(&config, rank).unwrap()
}

#[test]
fn world_1_single_rank() {
    let s = state(1, 1, 1, 0);
    assert_eq!((s.global_rank(), s.world_size()), (0, 1));
    for kind in GroupKind::ALL {
        assert_eq!(s.group(kind), &[0], "{kind}");
        assert_eq!(s.index_in_group(kind), Some(0));
        assert_eq!(s.all_groups(kind), vec![vec![0]]);
    }
    assert!(s.is_pipeline_first_stage() && s.is_pipeline_last_stage());
    assert_eq!((s.pipeline_next_rank(), s.pipeline_prev_rank()), (0, 0));
}

#[test]
fn world_8_tp2_pp2_rank_1() {
    let s = state(8, 2, 2, 1);
    assert_eq!(s.tensor_model_parallel_rank(), 1);
    assert_eq!(s.tensor_model_parallel_size(), 2);
    assert_eq!(s.pipeline_model_parallel_rank(), 0);
    assert_eq!(s.pipeline_model_parallel_size(), 2);
    assert_eq!((s.data_parallel_rank(), s.data_parallel_size()), (0, 2));
    assert_eq!(
        (s.context_parallel_rank(), s.context_parallel_size()),
        (0, 1)
    );
    assert_eq!(s.data_parallel_rank_with_cp(), 0);
    assert_eq!(
        s.coords(),
        RankCoords {
            tp: 1,
            ..RankCoords::default()
        }
    );
    assert_eq!(s.tensor_model_parallel_group(), &[0, 1]);
    assert_eq!(s.pipeline_model_parallel_group(), &[1, 5]);
    assert_eq!(s.data_parallel_group(), &[1, 3]);
    assert_eq!(s.data_parallel_group_with_cp(), &[1, 3]);
    assert_eq!(s.model_parallel_group(), &[0, 1, 4, 5]);
    assert_eq!(s.tensor_and_data_parallel_group(), &[0, 1, 2, 3]);
    assert_eq!(s.embedding_group(), &[1, 5]);
    assert_eq!(s.position_embedding_group(), &[1]);
    assert!(s.is_pipeline_first_stage() && !s.is_pipeline_last_stage());
    assert_eq!((s.pipeline_next_rank(), s.pipeline_prev_rank()), (5, 5));
    assert_eq!((s.pipeline_first_rank(), s.pipeline_last_rank()), (1, 5));
    assert!(s.is_rank_in_embedding_group() && s.is_rank_in_position_embedding_group());
    assert_eq!(s.index_in_group(GroupKind::ModelParallel), Some(1));
    assert_eq!(s.index_in_group(GroupKind::TensorAndDataParallel), Some(1));
}

#[test]
fn world_8_tp2_pp2_rank_6() {
    let s = state(8, 2, 2, 6);
    assert_eq!(
        s.coords(),
        RankCoords {
            dp: 1,
            pp: 1,
            ..RankCoords::default()
        }
    );
    assert_eq!(s.tensor_model_parallel_group(), &[6, 7]);
    assert_eq!(s.pipeline_model_parallel_group(), &[2, 6]);
    assert_eq!(s.data_parallel_group(), &[4, 6]);
    assert_eq!(s.model_parallel_group(), &[2, 3, 6, 7]);
    assert_eq!(s.tensor_and_data_parallel_group(), &[4, 5, 6, 7]);
    assert_eq!(s.embedding_group(), &[2, 6]);
    assert_eq!(s.position_embedding_group(), &[2]);
    assert!(!s.is_rank_in_position_embedding_group());
    assert_eq!(s.index_in_group(GroupKind::PositionEmbedding), None);
    assert_eq!(s.index_in_group(GroupKind::Embedding), Some(1));
    assert!(!s.is_pipeline_first_stage() && s.is_pipeline_last_stage());
    assert_eq!((s.pipeline_next_rank(), s.pipeline_prev_rank()), (2, 2));
}

#[test]
fn world_8_embedding_groups_for_all() {
    let config = ParallelConfig::new(8, 2, 2).validate().unwrap();
    assert_eq!(
        config.all_groups(GroupKind::Embedding),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(
        config.all_groups(GroupKind::PositionEmbedding),
        vec![vec![0], vec![1], vec![2], vec![3]]
    );
    assert_eq!(
        config.all_groups(GroupKind::DataParallelWithCp),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
}

#[test]
fn pp4_world4_stages() {
    let first = state(4, 1, 4, 0);
    assert_eq!(first.pipeline_model_parallel_group(), &[0, 1, 2, 3]);
    assert_eq!(first.embedding_group(), &[0, 3]);
    assert_eq!(first.position_embedding_group(), &[0]);
    assert!(first.is_pipeline_first_stage() && !first.is_pipeline_last_stage());
    assert_eq!(
        (first.pipeline_next_rank(), first.pipeline_prev_rank()),
        (1, 3)
    );

    let middle = state(4, 1, 4, 2);
    assert_eq!(middle.embedding_group(), &[0, 3]);
    assert!(!middle.is_rank_in_embedding_group());
    assert!(!middle.is_pipeline_first_stage() && !middle.is_pipeline_last_stage());
    assert_eq!(
        (middle.pipeline_next_rank(), middle.pipeline_prev_rank()),
        (3, 1)
    );

    let last = state(4, 1, 4, 3);
    assert!(last.is_pipeline_last_stage() && last.is_rank_in_embedding_group());
    assert_eq!(last.index_in_group(GroupKind::Embedding), Some(1));
    assert_eq!(
        (last.pipeline_next_rank(), last.pipeline_prev_rank()),
        (0, 2)
    );
    assert_eq!(last.all_groups(GroupKind::Embedding), vec![vec![0, 3]]);
    assert_eq!(last.all_groups(GroupKind::PositionEmbedding), vec![vec![0]]);
}

#[test]
fn world_2_pp2_embedding() {
    let s = state(2, 1, 2, 1);
    assert_eq!(s.embedding_group(), &[0, 1]);
    assert_eq!(s.position_embedding_group(), &[0]);
}

#[test]
fn no_pipeline_embedding_is_the_rank_itself() {
    let s = state(4, 2, 1, 3);
    assert_eq!(s.embedding_group(), &[3]);
    assert_eq!(s.position_embedding_group(), &[3]);
    assert!(s.is_pipeline_first_stage() && s.is_pipeline_last_stage());
    assert_eq!((s.pipeline_next_rank(), s.pipeline_prev_rank()), (3, 3));
    assert_eq!(
        s.all_groups(GroupKind::Embedding),
        vec![vec![0], vec![1], vec![2], vec![3]]
    );
}

#[test]
fn world_16_tp2_pp4() {
    let config = ParallelConfig::new(16, 2, 4).validate().unwrap();
    assert_eq!(
        config.all_groups(GroupKind::Embedding),
        vec![vec![0, 12], vec![1, 13], vec![2, 14], vec![3, 15]]
    );
    let s = ParallelState::new(&config, 9).unwrap();
    assert_eq!(
        s.coords(),
        RankCoords {
            tp: 1,
            dp: 0,
            pp: 2,
            ..RankCoords::default()
        }
    );
    assert_eq!(s.pipeline_model_parallel_group(), &[1, 5, 9, 13]);
    assert_eq!((s.pipeline_next_rank(), s.pipeline_prev_rank()), (13, 5));
    assert_eq!(s.data_parallel_group(), &[9, 11]);
    assert_eq!(s.model_parallel_group(), &[0, 1, 4, 5, 8, 9, 12, 13]);
    assert_eq!(s.tensor_and_data_parallel_group(), &[8, 9, 10, 11]);
    assert_eq!(s.embedding_group(), &[1, 13]);
    assert!(!s.is_rank_in_embedding_group());
}

#[test]
fn world_64_tp4_pp2_rank_45() {
    let s = state(64, 4, 2, 45);
    assert_eq!(
        s.coords(),
        RankCoords {
            tp: 1,
            dp: 3,
            pp: 1,
            ..RankCoords::default()
        }
    );
    assert_eq!(s.data_parallel_size(), 8);
    assert_eq!(s.tensor_model_parallel_group(), &[44, 45, 46, 47]);
    assert_eq!(s.pipeline_model_parallel_group(), &[13, 45]);
    assert_eq!(s.data_parallel_group(), &[33, 37, 41, 45, 49, 53, 57, 61]);
    assert_eq!(s.model_parallel_group(), &[12, 13, 14, 15, 44, 45, 46, 47]);
    assert_eq!(
        s.tensor_and_data_parallel_group(),
        (32..64).collect::<Vec<_>>().as_slice()
    );
    assert_eq!(s.embedding_group(), &[13, 45]);
    assert_eq!(s.position_embedding_group(), &[13]);
    assert!(s.is_pipeline_last_stage());
    assert_eq!((s.pipeline_next_rank(), s.pipeline_prev_rank()), (13, 13));
    assert_eq!(s.index_in_group(GroupKind::DataParallel), Some(3));
    assert_eq!(s.index_in_group(GroupKind::ModelParallel), Some(5));
    assert_eq!(s.index_in_group(GroupKind::TensorAndDataParallel), Some(13));
}

#[test]
fn flags_are_carried() {
    let config = ParallelConfig::new(8, 2, 2).with_virtual_pipeline(Some(4));
    let s = config.state_for_rank(3).unwrap();
    assert_eq!(s.virtual_pipeline_model_parallel_size(), Some(4));
    assert_eq!(s.config().world_size(), 8);
    let s = state(8, 2, 2, 3);
    assert_eq!(s.virtual_pipeline_model_parallel_size(), None);
}

#[test]
fn rank_out_of_range() {
    let config = ParallelConfig::new(8, 2, 2).validate().unwrap();
    let err = ParallelState::new(&config, 8).unwrap_err();
    assert_eq!(
        err,
        TopologyError::RankOutOfRange {
            rank: 8,
            world_size: 8
        }
    );
    assert_eq!(err.to_string(), "rank 8 is out of range for world size 8");
    assert!(config.group_of(GroupKind::Embedding, 100).is_err());
}

#[test]
fn group_kind_names() {
    let names: Vec<&str> = GroupKind::ALL.iter().map(|kind| kind.name()).collect();
    assert_eq!(
        names,
        [
            "tp",
            "pp",
            "dp",
            "dp-cp",
            "mp",
            "tp-dp",
            "embd",
            "pos-embd",
            "cp",
            "ep",
            "etp",
            "etp-ep",
            "etp-ep-pp",
            "edp"
        ]
    );
    assert_eq!(GroupKind::PositionEmbedding.to_string(), "pos-embd");
}
