//! [`LayerSplit`] against megatron-core 0.16.1's `get_num_layers_to_build` and
//! `get_transformer_layer_offset`, on the grid that
//! `tests/fixtures/pipeline_split/make_split_fixture.py` ran: the layers of every virtual
//! stage where Megatron accepts the split, an error wherever it refuses, and an error where it
//! accepts first and last stages holding more layers than the model (it then builds a
//! negative number of layers). Where it builds the layers but its offset function divides by
//! zero middle stages (interleaved, first and last stages only), the counts are compared.

use crate::topology::{LayerSplit, ParallelConfig, PipelinePosition, TopologyError};
use serde_json::Value;
use std::collections::HashMap;

type Case = (
    usize,
    usize,
    usize,
    Option<usize>,
    Option<usize>,
    bool,
    bool,
);

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/pipeline_split/split.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn numbers(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap() as usize)
        .collect()
}

fn split_of(first: Option<usize>, last: Option<usize>, emb: bool, loss: bool) -> LayerSplit {
    LayerSplit {
        num_layers_in_first_pipeline_stage: first,
        num_layers_in_last_pipeline_stage: last,
        account_for_embedding_in_pipeline_split: emb,
        account_for_loss_in_pipeline_split: loss,
        pipeline_model_parallel_layout: None,
    }
}

#[test]
fn the_split_is_megatron_cores_on_its_whole_grid() {
    let f = fixture();
    let opt = |v: &Value| v.as_u64().map(|n| n as usize);
    let cases = |list: &str| -> HashMap<Case, Vec<usize>> {
        f[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let n = |i: usize| c[i].as_u64().unwrap() as usize;
                let b = |i: usize| c[i].as_bool().unwrap();
                let case = (n(0), n(1), n(2), opt(&c[3]), opt(&c[4]), b(5), b(6));
                (case, c[7].as_array().map_or(Vec::new(), |_| numbers(&c[7])))
            })
            .collect()
    };
    let (accepted, counts_only) = (cases("accepted"), cases("counts_only"));
    let negative = f["negative"].as_array().unwrap().len();
    let grid = &f["grid"];
    let edge: Vec<Option<usize>> = grid["edge"].as_array().unwrap().iter().map(opt).collect();
    let (mut agreed, mut refused) = (0, 0);
    for layers in numbers(&grid["num_layers"]) {
        for p in numbers(&grid["pipeline_size"]) {
            for v in numbers(&grid["virtual_size"]) {
                for &first in &edge {
                    for &last in &edge {
                        for (emb, loss) in
                            [(false, false), (false, true), (true, false), (true, true)]
                        {
                            let case = (layers, p, v, first, last, emb, loss);
                            let split = split_of(first, last, emb, loss);
                            let ours = split.layers_per_virtual_stage(layers, p, v);
                            match accepted.get(&case) {
                                Some(counts) => {
                                    assert_eq!(ours.as_ref(), Ok(counts), "{case:?}");
                                    for stage in 0..p * v {
                                        let at = PipelinePosition::new(p, stage % p, v, stage / p)
                                            .with_split(split);
                                        let start: usize = counts[..stage].iter().sum();
                                        assert_eq!(
                                            at.layer_range(layers),
                                            Ok(start..start + counts[stage]),
                                            "{case:?} stage {stage}"
                                        );
                                    }
                                    agreed += 1;
                                }
                                None if counts_only.contains_key(&case) => {
                                    assert_eq!(ours.as_ref(), Ok(&counts_only[&case]), "{case:?}");
                                }
                                None => {
                                    assert!(
                                        ours.is_err(),
                                        "{case:?}: Megatron refuses, we give {ours:?}"
                                    );
                                    refused += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(agreed, accepted.len());
    assert!(
        agreed > 500 && negative > 200 && !counts_only.is_empty() && refused > 10_000,
        "{agreed} accepted, {refused} refused ({negative} of those negative in Megatron)"
    );
}

#[test]
fn a_split_that_needs_no_layer_count_is_refused_by_the_layout() {
    let at = |pp: usize, vp: Option<usize>, split: LayerSplit| {
        ParallelConfig::new(4, 1, pp)
            .with_virtual_pipeline(vp)
            .with_layer_split(split)
            .validate()
            .map(|c| c.layer_split())
    };
    let message = |r: Result<LayerSplit, TopologyError>| r.unwrap_err().to_string();
    let first = LayerSplit::default().with_first_stage(1);
    assert!(message(at(1, None, first)).contains("need pipeline parallelism"));
    assert!(
        message(at(2, Some(2), first))
            .contains("1 layers do not split evenly over its 2 model chunks")
    );
    let zero = LayerSplit::default().with_last_stage(0);
    assert!(message(at(2, None, zero)).contains("the last pipeline stage must hold a layer"));
    let both = first.with_loss_counted(true);
    assert!(message(at(2, None, both)).contains("cannot be set together"));
    assert_eq!(at(4, None, first), Ok(first));
    // The layers are checked when a chunk is placed: 9 layers leave 8 for 3 middle stages.
    let state = crate::topology::ParallelState::new(
        &ParallelConfig::new(4, 1, 4)
            .with_layer_split(first)
            .validate()
            .unwrap(),
        1,
    )
    .unwrap();
    let e = PipelinePosition::of(&state, 0)
        .layer_range(9)
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 layers between the first and last pipeline stages do not split evenly over 3 middle stages"), "{e}");
    assert_eq!(PipelinePosition::of(&state, 0).layer_range(10), Ok(1..4));
}
