//! [`PipelineLayout`] against megatron-core 0.16.1, on the cases
//! `tests/fixtures/pipeline_split/make_layout_fixture.py` ran: the layers of every virtual
//! stage and the virtual pipeline size where Megatron accepts the layout, an error wherever it
//! refuses it; then what Megatron's parser leaves undefined or this library does not build.

use crate::topology::{LayerSplit, ParallelConfig, PipelineLayout, TopologyError};
use serde_json::Value;

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/pipeline_split/layout.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The layers of each virtual stage, and the model chunks per stage, that `layout` gives a
/// model of `layers` over `p` stages; validated as a `ParallelConfig` too.
fn ours(layout: &str, p: usize, layers: usize) -> Result<(Vec<usize>, usize), TopologyError> {
    let layout = PipelineLayout::parse(layout)?;
    let v = (layout.num_stages() / p).max(1);
    let split = LayerSplit::default().with_layout(layout);
    ParallelConfig::new(p, 1, p)
        .with_virtual_pipeline((v > 1).then_some(v))
        .with_layer_split(split)
        .validate()?;
    Ok((split.layers_per_virtual_stage(layers, p, v)?, v))
}

#[test]
fn the_layout_is_megatron_cores_on_every_case() {
    let f = fixture();
    let n = |v: &Value| v.as_u64().unwrap() as usize;
    for case in f["accepted"].as_array().unwrap() {
        let (layout, p, layers) = (case[0].as_str().unwrap(), n(&case[1]), n(&case[2]));
        let counts: Vec<usize> = case[4].as_array().unwrap().iter().map(n).collect();
        assert_eq!(
            ours(layout, p, layers),
            Ok((counts, n(&case[3]))),
            "{layout:?} over {p} stages"
        );
    }
    let refused = f["refused"].as_array().unwrap();
    for case in refused {
        let (layout, p, layers) = (case[0].as_str().unwrap(), n(&case[1]), n(&case[2]));
        let message = match ours(layout, p, layers) {
            Err(e) => e.to_string(),
            Ok(counts) => panic!(
                "{layout:?} over {p} stages: Megatron refuses it ({case}), we place {counts:?}"
            ),
        };
        assert!(message.contains(layout), "{message}");
    }
    assert!(f["accepted"].as_array().unwrap().len() >= 10 && refused.len() >= 8);
}

#[test]
fn what_megatron_leaves_undefined_or_this_library_does_not_build_is_refused() {
    let refused = |layout: &str, why: &str| {
        let message = PipelineLayout::parse(layout).unwrap_err().to_string();
        assert!(message.contains(why), "{layout:?}: {message}");
    };
    refused(
        "Ett|tt|m|L",
        "multi-token prediction layers (`m`) are not built",
    );
    refused("E((t|)*2)*2,L", "do not nest");
    refused("E(t|*2,L", "a `(` is not closed");
    refused("Et)|tL", "a `)` closes no group");
    refused("E(t|t),L", "needs `*n` after it");
    refused("*2Et|tL", "`*` repeats nothing");
    refused("E|()*2|tL", "an empty group");
    refused("Et*99999999|L", "more than a million layers");
    refused(
        "Et*99999999999999999999999|L",
        "the repetition `*99999999999999999999999` is too large",
    );
    refused("E(t*4096|)*4096,L", "more than a million layers");
    // Set with the other split settings, as Megatron-Core refuses it.
    let layout = PipelineLayout::parse("Et|tL").unwrap();
    for split in [
        LayerSplit::default().with_first_stage(1),
        LayerSplit::default().with_loss_counted(true),
    ] {
        let message = split
            .with_layout(layout)
            .layers_per_virtual_stage(2, 2, 1)
            .unwrap_err()
            .to_string();
        assert!(message.contains("cannot be set with it"), "{message}");
    }
    // Its stages and the pipeline's disagree: the error says what fits.
    let message = LayerSplit::default()
        .with_layout(PipelineLayout::parse("Et|t|t|tL").unwrap())
        .layers_per_virtual_stage(4, 2, 1)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("a virtual pipeline of 2 chunks per stage fits it"),
        "{message}"
    );
    let message = LayerSplit::default()
        .with_layout(PipelineLayout::parse("Et|tL").unwrap())
        .layers_per_virtual_stage(2, 1, 1)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("its stages need pipeline parallelism"),
        "{message}"
    );
    // Parsed twice, one layout.
    assert_eq!(PipelineLayout::parse("Et|tL"), Ok(layout));
    assert_eq!(layout.to_string(), "Et|tL");
}
