use super::super::index::{RankIndex, SavedLayout, TrainingState};
use super::ranks;
use std::path::PathBuf;

/// The index of `(tp, pp, ep)` at TP 1 × PP 1 × EP 2 × DP 2, in its directory.
fn rank(tp: usize, ep: usize) -> (PathBuf, RankIndex) {
    let index = RankIndex {
        format: super::super::FORMAT.into(),
        layout: SavedLayout {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: 1,
            data_parallel_size: 2,
            distributed_optimizer: false,
            expert_model_parallel_size: 2,
        },
        tensor_model_parallel_rank: tp,
        pipeline_model_parallel_rank: 0,
        expert_model_parallel_rank: ep,
        state: TrainingState {
            iteration: 1,
            grad_scaler: None,
            fused_adam_steps: None,
            extra: serde_json::Value::Null,
        },
        tensors: Vec::new(),
        files: Default::default(),
        ids: Default::default(),
        optimizer_scalars: Default::default(),
    };
    let dir = PathBuf::from(format!("iter/mp_rank_{tp:02}_000_{ep:03}"));
    (dir, index)
}

/// With experts, the dense writers (one per TP × PP rank) and the experts' (one per
/// EP × PP rank) must both be complete; a rank outside the layout is named.
#[test]
fn expert_writers_must_all_be_there() {
    let dir = PathBuf::from("iter");
    ranks(&dir, &[rank(0, 0), rank(0, 1)]).unwrap();
    let e = ranks(&dir, &[rank(0, 0)]).unwrap_err().to_string();
    assert!(
        e.contains("the experts of 1 of the 2 (EP rank, PP rank) pairs"),
        "{e}"
    );
    let e = ranks(&dir, &[rank(0, 0), rank(0, 2)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("EP rank 2, outside its layout"), "{e}");
    let (wrong, index) = rank(0, 1);
    let misnamed = (wrong.with_file_name("mp_rank_00_000"), index);
    let e = ranks(&dir, &[rank(0, 0), misnamed])
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds the index of mp_rank_00_000_001"), "{e}");
}
