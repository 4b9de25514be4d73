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

/// Data-parallel replicas of a model loaded from one checkpoint share parameter ids: the
/// entry lives while any of the layers holding it does. It once kept only the first layer
/// that stated it, so the replica that finished first took the other's attributes with it
/// (a resumed run's last gradient norm then counted its shards as duplicates).
#[test]
fn an_id_two_layers_hold_lives_until_both_are_dropped() {
    let (first, second, id) = (
        LayoutOwner::default(),
        LayoutOwner::default(),
        ParamId::new(),
    );
    first.state(id, ParallelAttrs::sharded(1));
    second.state(id, ParallelAttrs::sharded(1));
    drop(first);
    assert_eq!(
        parallel_attrs(id),
        ParallelAttrs::sharded(1),
        "the second layer holds it"
    );
    drop(second);
    assert_eq!(parallel_attrs(id), ParallelAttrs::default());
    // A restored id: both replicas copy their fresh parameter's attributes onto the saved id.
    let (a, b, saved) = (
        LayoutOwner::default(),
        LayoutOwner::default(),
        ParamId::new(),
    );
    let (fresh_a, fresh_b) = (ParamId::new(), ParamId::new());
    a.state(fresh_a, ParallelAttrs::sharded(0));
    b.state(fresh_b, ParallelAttrs::sharded(0));
    copy_parallel_attrs(fresh_a, saved);
    copy_parallel_attrs(fresh_b, saved);
    drop(a);
    assert_eq!(
        parallel_attrs(saved),
        ParallelAttrs::sharded(0),
        "b's copy holds it"
    );
    drop(b);
    assert_eq!(parallel_attrs(saved), ParallelAttrs::default());
}
