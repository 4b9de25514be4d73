//! `ParallelConfig` validation: every error, with the numbers in its message.

use crate::topology::{GroupKind, ParallelConfig, TopologyError, ValidatedConfig};

#[test]
fn defaults_and_derived_sizes() {
    let config = ParallelConfig::new(64, 4, 2);
    assert_eq!(config.context_parallel_size, 1);
    assert_eq!(config.expert_model_parallel_size, 1);
    assert_eq!(config.virtual_pipeline_model_parallel_size, None);
    assert_eq!(config.order, "tp-cp-ep-dp-pp");
    assert_eq!(config.data_parallel_size(), 8);

    let validated = config.clone().validate().unwrap();
    assert_eq!(validated.world_size(), 64);
    assert_eq!(validated.tensor_model_parallel_size(), 4);
    assert_eq!(validated.pipeline_model_parallel_size(), 2);
    assert_eq!(validated.data_parallel_size(), 8);
    assert_eq!(validated.context_parallel_size(), 1);
    assert_eq!(validated.expert_model_parallel_size(), 1);
    assert_eq!(validated.config(), &config);
    assert_eq!(validated.rank_generator().world_size(), 64);
    assert_eq!(ValidatedConfig::try_from(config).unwrap(), validated);

    assert_eq!(ParallelConfig::default(), ParallelConfig::new(1, 1, 1));
    assert_eq!(ParallelConfig::new(0, 0, 1).data_parallel_size(), 0);
}

#[test]
fn builder_methods_set_fields() {
    let config = ParallelConfig::new(16, 2, 4)
        .with_virtual_pipeline(Some(3))
        .with_order("tp-dp-pp")
        .with_context_parallel(1)
        .with_expert_parallel(1);
    let validated = config.validate().unwrap();
    assert_eq!(validated.virtual_pipeline_model_parallel_size(), Some(3));
    assert_eq!(validated.data_parallel_size(), 2);
    assert_eq!(validated.config().order, "tp-dp-pp");
}

#[test]
fn world_not_divisible() {
    let err = ParallelConfig::new(6, 4, 1).validate().unwrap_err();
    assert_eq!(
        err,
        TopologyError::WorldSizeNotDivisible {
            world_size: 6,
            tp: 4,
            pp: 1,
            cp: 1,
            product: 4
        }
    );
    assert_eq!(
        err.to_string(),
        "world size 6 is not divisible by tensor (4) × pipeline (1) × context (1) = 4"
    );
    let err = ParallelConfig::new(2, 2, 2).validate().unwrap_err();
    assert_eq!(
        err.to_string(),
        "world size 2 is not divisible by tensor (2) × pipeline (2) × context (1) = 4"
    );
}

#[test]
fn zero_sizes() {
    let message = |config: ParallelConfig| config.validate().unwrap_err().to_string();
    assert_eq!(
        message(ParallelConfig::new(0, 1, 1)),
        "world size must be at least 1, got 0"
    );
    assert_eq!(
        message(ParallelConfig::new(4, 0, 1)),
        "tensor model parallel (tp) size must be at least 1, got 0"
    );
    assert_eq!(
        message(ParallelConfig::new(4, 1, 0)),
        "pipeline model parallel (pp) size must be at least 1, got 0"
    );
    assert!(message(ParallelConfig::new(4, 1, 1).with_context_parallel(0)).contains("(cp)"));
    assert!(message(ParallelConfig::new(4, 1, 1).with_expert_parallel(0)).contains("(ep)"));
    assert_eq!(
        message(ParallelConfig::new(4, 1, 2).with_virtual_pipeline(Some(0))),
        "virtual pipeline model parallel size must be at least 1, got 0"
    );
}

#[test]
fn order_token_errors() {
    let err = ParallelConfig::new(8, 2, 2)
        .with_order("tp-xp-dp-pp")
        .validate()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown parallelism token \"xp\" in \"tp-xp-dp-pp\" (expected tp, cp, ep, dp or pp)"
    );
    let err = ParallelConfig::new(8, 2, 2)
        .with_order("tp-dp-dp-pp")
        .validate()
        .unwrap_err();
    assert!(matches!(&err, TopologyError::DuplicateToken { token, .. } if token == "dp"));
    assert!(err.to_string().contains("\"tp-dp-dp-pp\""), "{err}");

    // pp > 1 but missing from the order.
    let err = ParallelConfig::new(8, 2, 2)
        .with_order("tp-dp")
        .validate()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "\"pp\" has size 2 but is missing from the order \"tp-dp\""
    );
}

#[test]
fn pipeline_must_be_last() {
    let err = ParallelConfig::new(8, 2, 2)
        .with_order("tp-pp-dp")
        .validate()
        .unwrap_err();
    assert_eq!(
        err,
        TopologyError::PipelineNotLast {
            pp: 2,
            order: "tp-pp-dp".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "pipeline parallelism (pp = 2) requires \"pp\" to be the last token of the order, got \"tp-pp-dp\""
    );
    let err = ParallelConfig::new(8, 1, 4)
        .with_order("pp-tp-dp")
        .validate()
        .unwrap_err();
    assert!(err.to_string().contains("pp = 4"), "{err}");

    // Without pipeline parallelism the position of pp does not matter.
    let validated = ParallelConfig::new(8, 2, 1)
        .with_order("tp-pp-dp")
        .validate()
        .unwrap();
    assert_eq!(validated.data_parallel_size(), 4);
    // A custom order that ends in pp is fine.
    assert!(
        ParallelConfig::new(8, 2, 2)
            .with_order("dp-tp-pp")
            .validate()
            .is_ok()
    );
}

#[test]
fn virtual_pipeline_requires_pipeline() {
    let err = ParallelConfig::new(4, 2, 1)
        .with_virtual_pipeline(Some(2))
        .validate()
        .unwrap_err();
    assert_eq!(
        err,
        TopologyError::VirtualPipelineWithoutPipeline {
            virtual_size: 2,
            pp: 1
        }
    );
    assert_eq!(
        err.to_string(),
        "virtual pipeline size 2 requires pipeline parallelism (pp > 1), got pp = 1"
    );
}

#[test]
fn context_parallel_groups_follow_megatron() {
    // Context parallelism is laid out as Megatron does (tp-cp-ep-dp-pp): the CP groups
    // pair ranks two apart at TP 2.
    let config = ParallelConfig::new(8, 2, 1)
        .with_context_parallel(2)
        .validate()
        .unwrap();
    assert_eq!(
        config.all_groups(GroupKind::ContextParallel),
        [vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        config.all_groups(GroupKind::DataParallelWithCp),
        [vec![0, 2, 4, 6], vec![1, 3, 5, 7]]
    );
}

/// The expert groups of megatron-core 0.16.1's second `RankGenerator` (printed by
/// `RankGenerator(tp=etp, ep=ep, dp=world // (etp·ep·pp), pp=pp, cp=1,
/// order="tp-cp-ep-dp-pp").get_ranks(token)`), and the dense groups unchanged by EP.
#[test]
fn expert_groups_follow_megatron_core() {
    let groups = |world, tp, pp, ep| {
        let config = ParallelConfig::new(world, tp, pp)
            .with_expert_parallel(ep)
            .validate()
            .unwrap();
        let dense = ParallelConfig::new(world, tp, pp).validate().unwrap();
        assert_eq!(
            config.all_groups(GroupKind::DataParallel),
            dense.all_groups(GroupKind::DataParallel)
        );
        [
            GroupKind::ExpertModelParallel,
            GroupKind::ExpertTensorModelPipelineParallel,
            GroupKind::ExpertDataParallel,
        ]
        .map(|k| config.all_groups(k))
    };
    let [ep, emp, edp] = groups(8, 2, 2, 2);
    assert_eq!(ep, [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
    assert_eq!(emp, [vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
    assert_eq!(edp, [vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
    let [ep, emp, edp] = groups(8, 1, 1, 4);
    assert_eq!(ep, [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(emp, ep);
    assert_eq!(edp, [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
    let [ep, emp, edp] = groups(16, 2, 2, 4);
    assert_eq!(ep[2], [8, 9, 10, 11]);
    assert_eq!(
        emp,
        [
            vec![0, 1, 2, 3, 8, 9, 10, 11],
            vec![4, 5, 6, 7, 12, 13, 14, 15]
        ]
    );
    assert_eq!(edp[4], [8, 12]);
    let config = ParallelConfig::new(8, 2, 1)
        .with_expert_parallel(2)
        .validate()
        .unwrap();
    assert_eq!(config.expert_data_parallel_size(), 4);
    assert_eq!(
        config.all_groups(GroupKind::ExpertTensorParallel),
        (0..8).map(|r| vec![r]).collect::<Vec<_>>()
    );
}

#[test]
fn expert_layouts_that_do_not_fit_are_refused() {
    let err = ParallelConfig::new(6, 1, 1)
        .with_expert_parallel(4)
        .validate()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "world size 6 is not divisible by expert tensor (1) × expert (4) × pipeline (1) = 4"
    );
    for (tp, etp, order) in [(1, 2, None), (2, 4, None), (2, 2, Some("cp-tp-ep-dp"))] {
        let mut config = ParallelConfig::new(8, tp, 1)
            .with_expert_tensor_parallel(etp)
            .with_context_parallel(if order.is_some() { 2 } else { 1 });
        if let Some(order) = order {
            config = config.with_order(order);
        }
        let err = config.validate().unwrap_err();
        assert_eq!(
            err,
            TopologyError::ExpertTensorParallelNotTp {
                etp,
                tp,
                order: order.map(String::from)
            }
        );
        assert!(err.to_string().contains(&format!("size {etp}")), "{err}");
    }
}

/// Expert tensor parallelism at the dense TP size: each expert is split over the dense TP
/// groups; the groups of megatron-core's second generator (tp = etp = 2, ep = 2, dp = 2 at
/// world 8, order tp-cp-ep-dp-pp: rank = etp + 2·ep + 4·edp), worked by hand.
#[test]
fn expert_tensor_parallel_splits_experts_over_the_tp_groups() {
    let config = ParallelConfig::new(8, 2, 1)
        .with_expert_parallel(2)
        .with_expert_tensor_parallel(2)
        .validate()
        .unwrap();
    assert_eq!(
        config.all_groups(GroupKind::ExpertTensorParallel),
        config.all_groups(GroupKind::TensorModelParallel)
    );
    assert_eq!(
        config.all_groups(GroupKind::ExpertTensorParallel),
        [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        config.all_groups(GroupKind::ExpertModelParallel),
        [vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        config.all_groups(GroupKind::ExpertDataParallel),
        [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(
        config.all_groups(GroupKind::ExpertTensorModelPipelineParallel),
        [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
    );
    assert_eq!(config.expert_data_parallel_size(), 2);
}

#[test]
fn size_overflow() {
    let err = ParallelConfig::new(4, usize::MAX, 2)
        .validate()
        .unwrap_err();
    assert!(matches!(err, TopologyError::SizeOverflow { .. }));
    assert!(err.to_string().contains("pp = 2"), "{err}");
}
