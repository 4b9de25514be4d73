//! A stage that holds the wrong modules, a plan or a record that does not fit, and a plan
//! rule on a stage: refused before any work, naming them.

use super::*;

#[test]
fn a_stage_holding_the_wrong_modules_is_refused() -> Result<(), Error> {
    let dir = super::super::load::scratch("pipeline-errors");
    let record = record(&dir);
    let (device, tp) = (Device::flex(), super::super::solo());
    let plan = plan();
    let at = |rank, chunks, chunk| plan.stage(PipelinePosition::new(2, rank, chunks, chunk));
    let (first, second) = (at(0, 1, 0)?, at(1, 1, 0)?);
    let load = |chunk: Lm, stage: &PpStage| {
        let options = stage.load_options(LoadOptions::default());
        load_sharded(chunk, &RecordSource::from_path(&record), &tp, &options)
    };
    // Stage 1 holds layers 2 and 3, the norm and the head; the rest is another stage's.
    let (_, report) = load(Lm::new(&second, &device), &second)?;
    assert!(report.loaded.iter().all(|p| !p.starts_with("wte")));
    assert!(report.loaded.contains(&"layers.0.norm_1.gamma".to_string()));
    assert!(report.elsewhere.contains(&"wte.weight".to_string()));
    assert!(
        report
            .elsewhere
            .contains(&"layers.1.norm_1.gamma".to_string())
    );
    assert!(!report.elsewhere.iter().any(|k| k.starts_with("layers.2")));
    let refused = |e: String, names: &str| assert!(e.contains(names), "{e}");
    // The first stage's chunk (with the embedding) loaded as the second's.
    let e = load(Lm::new(&first, &device), &second)
        .unwrap_err()
        .to_string();
    refused(
        e,
        "wte.weight: the plan puts this parameter on another pipeline stage",
    );
    let e = second
        .check(&Lm::new(&first, &device))
        .unwrap_err()
        .to_string();
    refused(e, "wte.weight");
    // A chunk of three layers where the stage holds two.
    let mut long = Lm::new(&second, &device);
    long.layers.push(long.layers[0].clone());
    let e = load(long, &second).unwrap_err().to_string();
    refused(
        e,
        "holds `layers.2`, but this pipeline stage holds 2 layers of `layers` (2..4",
    );
    // The last stage without its head.
    let mut headless = Lm::new(&second, &device);
    headless.lm_head = None;
    let e = second.check(&headless).unwrap_err().to_string();
    refused(e, "no parameters under `lm_head`");
    assert!(second.check(&Lm::new(&second, &device)).is_ok());
    // 4 layers do not split over 3 stages; a bad pattern.
    let e = plan
        .stage(PipelinePosition::new(3, 0, 1, 0))
        .unwrap_err()
        .to_string();
    refused(e, "`layers`");
    let whole = PipelinePosition::whole();
    assert!(
        PpPlan::new("layers", 4)
            .first(&["[unclosed"])
            .stage(whole)
            .is_err()
    );
    let e = PpPlan::new("*.layers", 4)
        .stage(whole)
        .unwrap_err()
        .to_string();
    refused(e, "must be a module path");
    // A stack that names nothing in the record, or fewer layers than it holds.
    let elsewhere = PpPlan::new("blocks", LAYERS).stage(PipelinePosition::new(2, 1, 1, 0))?;
    let e = load(Lm::new(&second, &device), &elsewhere)
        .unwrap_err()
        .to_string();
    refused(e, "the record holds no `blocks.N` tensors");
    let short = PpPlan::new("layers", 2)
        .first(&["wte"])
        .last(&["norm", "lm_head"]);
    let short = short.stage(PipelinePosition::new(2, 1, 1, 0))?;
    let e = load(Lm::new(&short, &device), &short)
        .unwrap_err()
        .to_string();
    refused(
        e,
        "the record holds `layers.2`, but the pipeline plan divides 2 layers",
    );
    // A module only the first stage holds, left out of the plan: the error says where it
    // belongs.
    let forgot = PpPlan::new("layers", LAYERS).last(&["norm", "lm_head"]);
    let forgot = forgot.stage(PipelinePosition::new(2, 1, 1, 0))?;
    let e = load(Lm::new(&second, &device), &forgot)
        .unwrap_err()
        .to_string();
    refused(e, "belongs in `PpPlan::first` or `PpPlan::last`");
    // A tensor-parallel rule that names only another stage's module is no error there, but
    // one that names nothing anywhere still is.
    let tp_plan = TpPlan::new().vocab(&["wte"])?;
    second
        .tp_plan(tp_plan)
        .apply(Lm::new(&second, &device), &tp)?;
    let typo = TpPlan::new().vocab(&["wtee"])?;
    let e = second
        .tp_plan(typo)
        .apply(Lm::new(&second, &device), &tp)
        .unwrap_err();
    refused(e.to_string(), "`wtee`");
    // An error inside a stage (a column rule on a norm, Burn's own type, which has no slot)
    // says how the stage's paths map to the whole model's.
    let wrong = TpPlan::new().column(&["layers.2.norm_1"])?;
    let e = second
        .tp_plan(wrong)
        .apply(Lm::new(&second, &device), &tp)
        .unwrap_err();
    refused(
        e.to_string(),
        "its `layers.0` to `layers.1` are the whole model's `layers.2` to `layers.3`",
    );
    // Layer 0 is stage 0's; there is no layer 9.
    let other = TpPlan::new().column(&["layers.0.pwff.linear_inner"])?;
    second
        .tp_plan(other)
        .apply(Lm::new(&second, &device), &tp)?;
    let past = TpPlan::new().column(&["layers.9.pwff.linear_inner"])?;
    let e = second
        .tp_plan(past)
        .apply(Lm::new(&second, &device), &tp)
        .unwrap_err();
    refused(e.to_string(), "`layers.9.pwff.linear_inner`");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
