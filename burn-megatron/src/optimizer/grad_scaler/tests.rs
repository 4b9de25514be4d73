use super::*;

/// (found_inf, expected scale, growth tracker, hysteresis tracker) after each update.
fn walk(s: &mut DynamicGradScaler, steps: &[(bool, f64, usize, i64)]) {
    for (i, &(inf, scale, growth, hyst)) in steps.iter().enumerate() {
        s.update(inf);
        assert_eq!(
            (s.scale(), s.growth_tracker(), s.hysteresis_tracker()),
            (scale, growth, hyst),
            "after update {i} (inf = {inf})"
        );
    }
}

#[test]
fn megatron_rule_over_a_sequence_of_steps() {
    // initial 1024, min 64, ×2 every 3 clean steps, ×0.5, hysteresis 2.
    let mut s = DynamicGradScaler::new(1024.0, 64.0, 2.0, 0.5, 3, 2).unwrap();
    walk(
        &mut s,
        &[
            (false, 1024.0, 1, 2),
            (true, 1024.0, 0, 1),  // first overflow: tolerated
            (false, 1024.0, 1, 1), // a clean step does not restore hysteresis
            (true, 512.0, 0, 0),   // second overflow: back off
            (true, 256.0, 0, -1),  // and again on every further one
            (false, 256.0, 1, -1),
            (false, 256.0, 2, -1),
            (false, 512.0, 0, 2), // growth interval: both trackers reset, scale doubles
            (true, 512.0, 0, 1),
            (true, 256.0, 0, 0),
            (true, 128.0, 0, -1),
            (true, 64.0, 0, -2),
            (true, 64.0, 0, -3), // floored at min_scale
        ],
    );
}

#[test]
fn defaults_state_round_trip_and_constant() {
    let mut s = DynamicGradScaler::default();
    assert_eq!((s.scale(), s.hysteresis_tracker()), (4294967296.0, 2));
    for _ in 0..999 {
        s.update(false);
    }
    assert_eq!(s.scale(), 4294967296.0);
    s.update(false);
    assert_eq!(s.scale(), 8589934592.0);
    s.update(true);
    let saved = s.state();
    let mut r = DynamicGradScaler::default();
    r.load_state(saved);
    assert_eq!(r, s);
    let mut c = ConstantGradScaler::new(128.0);
    c.update(true);
    assert_eq!((c.scale(), c.inv_scale()), (128.0, 1.0 / 128.0));
    assert!(
        DynamicGradScaler::new(1.0, 2.0, 2.0, 0.5, 1, 1)
            .unwrap_err()
            .contains("min_scale (2)")
    );
    assert!(
        DynamicGradScaler::new(4.0, 1.0, 2.0, 0.5, 0, 1)
            .unwrap_err()
            .contains("growth_interval (0)")
    );
}
