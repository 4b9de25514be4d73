use crate::checkpoint::advanced::{begin_checkpoint, save_checkpoint};
use crate::checkpoint::{CheckpointRank, SavedLayout};
use crate::launch::{LaunchOptions, threads};
use crate::optimizer::MegatronOptimizer;
use crate::tensor_parallel::{
    ColumnParallelLinear, ColumnParallelLinearConfig, ParallelAttrs, set_layout_attrs,
};
use crate::topology::ParallelConfig;
use burn::module::{Module, Param};
use burn::optim::SgdConfig;
use burn::tensor::{Tensor, TensorData};

/// A parallel layer beside a custom one that shards its weight by hand (each TP rank
/// holds its own rows) and says so only when `stated`.
#[derive(Module, Debug)]
struct Custom {
    column: ColumnParallelLinear,
    rows: Param<Tensor<2>>,
}

/// Saves at TP 2; each rank's result.
fn save_at_tp2(name: &str, stated: impl Fn(usize) -> bool + Sync) -> Vec<Result<(), String>> {
    let root = std::env::temp_dir().join(format!("bm-layout-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let out = threads(
        &ParallelConfig::new(2, 2, 1),
        LaunchOptions::default(),
        |ctx| {
            let tp_rank = ctx.state.tensor_model_parallel_rank();
            let column = ColumnParallelLinearConfig::new(4, 4)
                .init(&ctx.groups.tp, &ctx.device)
                .map_err(|e| e.to_string())?;
            let values = (0..6)
                .map(|i| (i + 10 * tp_rank) as f32)
                .collect::<Vec<_>>();
            let rows = Param::from_tensor(Tensor::<2>::from_data(
                TensorData::new(values, [2, 3]),
                &ctx.device,
            ));
            if stated(tp_rank) {
                set_layout_attrs(rows.id, ParallelAttrs::sharded(0));
            }
            let model = Custom { column, rows };
            let optim = MegatronOptimizer::new(
                SgdConfig::new().init(),
                &model,
                ctx.groups.mp.clone(),
                tp_rank,
            );
            let rank = CheckpointRank {
                layout: SavedLayout {
                    tensor_model_parallel_size: 2,
                    pipeline_model_parallel_size: 1,
                    virtual_pipeline_model_parallel_size: 1,
                    data_parallel_size: 1,
                    distributed_optimizer: false,
                    expert_model_parallel_size: 1,
                },
                tensor_model_parallel_rank: tp_rank,
                pipeline_model_parallel_rank: 0,
                expert_model_parallel_rank: 0,
                share: super::super::SaveShare::ALL,
                names: &|p: &str| p.to_string(),
            };
            if tp_rank == 0 {
                begin_checkpoint(&root, 1).unwrap();
            }
            ctx.groups.world.barrier().map_err(|e| e.to_string())?;
            Ok::<_, String>(
                save_checkpoint(&root, 1, &rank, &model, &optim, serde_json::Value::Null)
                    .map_err(|e| e.to_string()),
            )
        },
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(&root);
    out
}

#[test]
fn stated_shards_save() {
    for r in save_at_tp2("stated", |_| true) {
        r.unwrap();
    }
}

/// Unstated, every rank took its rows for a whole copy, and only TP rank 0 would have
/// written them.
#[test]
fn shards_taken_for_copies_are_an_error_naming_the_parameter() {
    for r in save_at_tp2("unstated", |_| false) {
        let e = r.unwrap_err();
        assert!(
            e.contains("disagree on rows") && e.contains("a copy of [2, 3]"),
            "{e}"
        );
    }
}

/// Stated on one rank only (stale on the other): the global shapes differ.
#[test]
fn attributes_stated_on_one_rank_only_are_an_error() {
    for r in save_at_tp2("stale", |tp_rank| tp_rank == 0) {
        let e = r.unwrap_err();
        assert!(
            e.contains("disagree on rows") && e.contains("a shard along dim 0 of [4, 3]"),
            "{e}"
        );
    }
}
