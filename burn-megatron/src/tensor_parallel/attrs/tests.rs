use super::*;

/// Layers built and dropped over and over (a sweep, a test suite) leave the table no
/// bigger than twice what is alive.
#[test]
fn entries_of_dropped_layers_are_freed() {
    let kept = LayoutOwner::default();
    let kept_id = ParamId::new();
    kept.state(kept_id, ParallelAttrs::sharded(1));
    for _ in 0..20_000 {
        let owner = LayoutOwner::default();
        for _ in 0..3 {
            owner.state(ParamId::new(), ParallelAttrs::sharded(0));
        }
    }
    let n = parallel_attrs_entries();
    // Other tests of this process state theirs meanwhile; far fewer than 60,000.
    assert!(n < 20_000, "{n} entries for one live layer");
    assert_eq!(parallel_attrs(kept_id), ParallelAttrs::sharded(1));
    let clone = kept.clone();
    drop(kept);
    assert_eq!(
        parallel_attrs(kept_id),
        ParallelAttrs::sharded(1),
        "a clone holds it"
    );
    drop(clone);
    assert_eq!(parallel_attrs(kept_id), ParallelAttrs::default());
}
