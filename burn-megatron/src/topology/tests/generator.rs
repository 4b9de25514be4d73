//! Exact group lists from `RankGenerator` for many layouts.

use super::{generator, ranks};
use crate::topology::{ParallelDim, RankCoords, RankGenerator, TopologyError};

#[test]
fn world_1_every_token_is_one_group() {
    let g = generator(1, 1, 1, 1, 1);
    assert_eq!(g.world_size(), 1);
    for token in [
        "tp", "cp", "ep", "dp", "pp", "tp-pp", "tp-dp", "dp-cp", "tp-dp-cp",
    ] {
        assert_eq!(ranks(&g, token), vec![vec![0]], "token {token}");
    }
    assert_eq!(g.order_string(), "tp-cp-ep-dp-pp");
}

#[test]
fn world_2_layouts() {
    let g = generator(2, 1, 1, 1, 1);
    assert_eq!(ranks(&g, "tp"), vec![vec![0, 1]]);
    assert_eq!(ranks(&g, "dp"), vec![vec![0], vec![1]]);
    assert_eq!(ranks(&g, "pp"), vec![vec![0], vec![1]]);

    let g = generator(1, 1, 2, 1, 1);
    assert_eq!(ranks(&g, "dp"), vec![vec![0, 1]]);
    assert_eq!(ranks(&g, "tp"), vec![vec![0], vec![1]]);

    let g = generator(1, 1, 1, 2, 1);
    assert_eq!(ranks(&g, "pp"), vec![vec![0, 1]]);
    assert_eq!(ranks(&g, "tp-dp"), vec![vec![0], vec![1]]);
}

#[test]
fn world_4_layouts() {
    let g = generator(2, 1, 2, 1, 1);
    assert_eq!(ranks(&g, "tp"), vec![vec![0, 1], vec![2, 3]]);
    assert_eq!(ranks(&g, "dp"), vec![vec![0, 2], vec![1, 3]]);
    assert_eq!(ranks(&g, "tp-dp"), vec![vec![0, 1, 2, 3]]);
    assert_eq!(ranks(&g, "pp"), vec![vec![0], vec![1], vec![2], vec![3]]);

    let g = generator(1, 1, 1, 4, 1);
    assert_eq!(ranks(&g, "pp"), vec![vec![0, 1, 2, 3]]);
    assert_eq!(ranks(&g, "tp"), vec![vec![0], vec![1], vec![2], vec![3]]);
}

#[test]
fn world_8_default_order() {
    let g = generator(2, 1, 2, 2, 1);
    assert_eq!(g.world_size(), 8);
    assert_eq!(
        ranks(&g, "tp"),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        ranks(&g, "dp"),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        ranks(&g, "pp"),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(ranks(&g, "tp-pp"), vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
    assert_eq!(ranks(&g, "tp-dp"), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(ranks(&g, "dp-pp"), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
    // The written order of the requested tokens does not matter.
    assert_eq!(ranks(&g, "pp-tp"), ranks(&g, "tp-pp"));
    assert_eq!(ranks(&g, "tp-dp-pp"), vec![(0..8).collect::<Vec<_>>()]);
}

#[test]
fn world_8_order_tp_pp_dp() {
    let g = RankGenerator::new(2, 1, 2, 2, 1, "tp-pp-dp").unwrap();
    assert_eq!(g.order_string(), "tp-pp-dp-ep-cp");
    assert_eq!(
        ranks(&g, "tp"),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        ranks(&g, "pp"),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        ranks(&g, "dp"),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(ranks(&g, "tp-pp"), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(ranks(&g, "tp-dp"), vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
}

#[test]
fn context_parallel_tp2_cp2_dp2() {
    let g = generator(2, 1, 2, 1, 2);
    assert_eq!(g.world_size(), 8);
    assert_eq!(
        ranks(&g, "tp"),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        ranks(&g, "cp"),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        ranks(&g, "dp"),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(ranks(&g, "dp-cp"), vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
    assert_eq!(ranks(&g, "tp-cp"), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(ranks(&g, "tp-dp"), vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
    assert_eq!(ranks(&g, "tp-dp-cp"), vec![(0..8).collect::<Vec<_>>()]);
    assert_eq!(
        g.coords(6).unwrap(),
        RankCoords {
            tp: 0,
            cp: 1,
            ep: 0,
            dp: 1,
            pp: 0
        }
    );
}

#[test]
fn context_parallel_with_pipeline() {
    // tp 1, cp 2, dp 2, pp 2: strides cp 1, dp 2, pp 4.
    let g = generator(1, 1, 2, 2, 2);
    assert_eq!(
        ranks(&g, "cp"),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        ranks(&g, "dp"),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        ranks(&g, "pp"),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(ranks(&g, "dp-cp"), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(
        ranks(&g, "tp-pp"),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
}

#[test]
fn expert_parallel_in_generator() {
    let g = generator(2, 2, 1, 1, 1);
    assert_eq!(ranks(&g, "ep"), vec![vec![0, 2], vec![1, 3]]);
    assert_eq!(ranks(&g, "tp-ep"), vec![vec![0, 1, 2, 3]]);
}

#[test]
fn world_16_tp2_dp2_pp4() {
    let g = generator(2, 1, 2, 4, 1);
    let tp: Vec<Vec<usize>> = (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect();
    assert_eq!(ranks(&g, "tp"), tp);
    assert_eq!(
        ranks(&g, "dp"),
        vec![
            vec![0, 2],
            vec![1, 3],
            vec![4, 6],
            vec![5, 7],
            vec![8, 10],
            vec![9, 11],
            vec![12, 14],
            vec![13, 15]
        ]
    );
    assert_eq!(
        ranks(&g, "pp"),
        vec![
            vec![0, 4, 8, 12],
            vec![1, 5, 9, 13],
            vec![2, 6, 10, 14],
            vec![3, 7, 11, 15]
        ]
    );
    assert_eq!(
        ranks(&g, "tp-pp"),
        vec![
            vec![0, 1, 4, 5, 8, 9, 12, 13],
            vec![2, 3, 6, 7, 10, 11, 14, 15]
        ]
    );
    assert_eq!(
        ranks(&g, "tp-dp"),
        vec![
            vec![0, 1, 2, 3],
            vec![4, 5, 6, 7],
            vec![8, 9, 10, 11],
            vec![12, 13, 14, 15]
        ]
    );
}

#[test]
fn world_64_tp4_dp8_pp2() {
    let g = generator(4, 1, 8, 2, 1);
    assert_eq!(g.world_size(), 64);
    let tp = ranks(&g, "tp");
    assert_eq!(tp.len(), 16);
    assert_eq!(tp[0], vec![0, 1, 2, 3]);
    assert_eq!(tp[11], vec![44, 45, 46, 47]);
    let pp = ranks(&g, "pp");
    assert_eq!(pp, (0..32).map(|i| vec![i, i + 32]).collect::<Vec<_>>());
    let dp = ranks(&g, "dp");
    assert_eq!(dp.len(), 8);
    assert_eq!(dp[0], vec![0, 4, 8, 12, 16, 20, 24, 28]);
    assert_eq!(dp[3], vec![3, 7, 11, 15, 19, 23, 27, 31]);
    assert_eq!(dp[5], vec![33, 37, 41, 45, 49, 53, 57, 61]);
    let mp = ranks(&g, "tp-pp");
    assert_eq!(mp.len(), 8);
    assert_eq!(mp[0], vec![0, 1, 2, 3, 32, 33, 34, 35]);
    assert_eq!(mp[3], vec![12, 13, 14, 15, 44, 45, 46, 47]);
    assert_eq!(
        ranks(&g, "tp-dp"),
        vec![(0..32).collect::<Vec<_>>(), (32..64).collect::<Vec<_>>()]
    );
    assert_eq!(
        g.coords(45).unwrap(),
        RankCoords {
            tp: 1,
            cp: 0,
            ep: 0,
            dp: 3,
            pp: 1
        }
    );
    assert_eq!(g.group_of("dp", 45).unwrap(), dp[5]);
}

#[test]
fn coords_follow_megatron_formula() {
    // rank = tp + TP·(cp + CP·(ep + EP·(dp + DP·pp)))
    let (tp, cp, ep, dp, pp) = (2, 3, 2, 2, 2);
    let g = generator(tp, ep, dp, pp, cp);
    for rank in 0..g.world_size() {
        let c = g.coords(rank).unwrap();
        assert_eq!(
            rank,
            c.tp + tp * (c.cp + cp * (c.ep + ep * (c.dp + dp * c.pp)))
        );
        assert_eq!(g.rank_of(&c).unwrap(), rank);
    }
    assert_eq!(g.stride(ParallelDim::Pipeline), 24);
    assert_eq!(g.size(ParallelDim::Context), 3);
}

#[test]
fn missing_size_one_tokens_are_appended() {
    let g = RankGenerator::new(2, 1, 2, 1, 1, "dp-tp").unwrap();
    assert_eq!(g.order_string(), "dp-tp-pp-ep-cp");
    assert_eq!(ranks(&g, "dp"), vec![vec![0, 1], vec![2, 3]]);
    assert_eq!(ranks(&g, "tp"), vec![vec![0, 2], vec![1, 3]]);
    // A size-1 token that was appended can still be requested.
    assert_eq!(ranks(&g, "cp"), vec![vec![0], vec![1], vec![2], vec![3]]);
    // Tokens are case-insensitive.
    assert_eq!(RankGenerator::new(2, 1, 2, 1, 1, "DP-TP").unwrap(), g);
}

#[test]
fn generator_errors() {
    let err = RankGenerator::new(0, 1, 1, 1, 1, "tp-dp").unwrap_err();
    assert_eq!(
        err,
        TopologyError::ZeroSize {
            what: "tensor model parallel (tp)"
        }
    );
    assert_eq!(
        err.to_string(),
        "tensor model parallel (tp) size must be at least 1, got 0"
    );
    let err = RankGenerator::new(1, 1, 1, 1, 0, "tp").unwrap_err();
    assert!(err.to_string().contains("context parallel (cp)"), "{err}");

    let err = RankGenerator::new(2, 1, 2, 1, 1, "tp-xx-dp").unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown parallelism token \"xx\" in \"tp-xx-dp\" (expected tp, cp, ep, dp or pp)"
    );
    let err = RankGenerator::new(2, 1, 2, 1, 1, "tp-dp-tp").unwrap_err();
    assert_eq!(
        err.to_string(),
        "parallelism token \"tp\" appears more than once in \"tp-dp-tp\""
    );

    let err = RankGenerator::new(2, 1, 2, 1, 1, "tp").unwrap_err();
    assert_eq!(
        err.to_string(),
        "\"dp\" has size 2 but is missing from the order \"tp\""
    );
    assert!(matches!(
        err,
        TopologyError::MissingFromOrder {
            token: "dp",
            size: 2,
            ..
        }
    ));

    let err = RankGenerator::new(usize::MAX, 1, 2, 1, 1, "tp-dp").unwrap_err();
    assert!(matches!(err, TopologyError::SizeOverflow { .. }));
    assert!(err.to_string().contains("dp = 2"), "{err}");
}

#[test]
fn get_ranks_and_coords_errors() {
    let g = generator(2, 1, 2, 2, 1);
    let err = g.get_ranks("foo").unwrap_err();
    assert!(matches!(&err, TopologyError::UnknownToken { token, .. } if token == "foo"));
    let err = g.get_ranks("").unwrap_err();
    assert!(matches!(&err, TopologyError::UnknownToken { token, .. } if token.is_empty()));
    let err = g.get_ranks("tp-").unwrap_err();
    assert!(err.to_string().contains("in \"tp-\""), "{err}");
    let err = g.get_ranks("tp-pp-tp").unwrap_err();
    assert_eq!(
        err.to_string(),
        "parallelism token \"tp\" appears more than once in \"tp-pp-tp\""
    );

    let err = g.coords(8).unwrap_err();
    assert_eq!(err.to_string(), "rank 8 is out of range for world size 8");
    assert!(g.group_of("tp", 9).is_err());

    let bad = RankCoords {
        tp: 2,
        ..RankCoords::default()
    };
    let err = g.rank_of(&bad).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tp coordinate 2 is out of range for tp size 2"
    );
}
