use super::*;
use burn::tensor::Device;

/// The 0/1 keep pattern of a dropout of ones drawn from `t`'s `region`.
fn pattern(t: &RngTracker, n: usize, prob: f64, region: RngRegion) -> Vec<bool> {
    let x = Tensor::<1>::ones([n], &Device::flex().autodiff());
    let y = t.dropout(x, prob, region).unwrap();
    y.into_data().iter::<f32>().map(|v| v != 0.0).collect()
}

#[test]
fn default_stream_agrees_across_tp_ranks_and_model_parallel_differs() {
    let a = RngTracker::new(7, 0);
    let b = RngTracker::new(7, 1);
    assert_eq!(
        pattern(&a, 64, 0.5, RngRegion::Default),
        pattern(&b, 64, 0.5, RngRegion::Default)
    );
    assert_ne!(
        pattern(&a, 64, 0.5, RngRegion::TensorModelParallel),
        pattern(&b, 64, 0.5, RngRegion::TensorModelParallel)
    );
    // Each call draws a fresh seed: two dropouts in a row differ.
    assert_ne!(
        pattern(&a, 64, 0.5, RngRegion::Default),
        pattern(&a, 64, 0.5, RngRegion::Default)
    );
    assert_eq!(RngTracker::model_parallel_seed(7, 1), 7 + 2718 + 1);
    // Any u64 is a seed: the offset wraps.
    assert_eq!(RngTracker::model_parallel_seed(u64::MAX, 1), 2718);
    let _ = pattern(
        &RngTracker::new(u64::MAX, 3),
        8,
        0.5,
        RngRegion::TensorModelParallel,
    );
}

#[test]
fn streams_are_reproducible_from_the_seed() {
    let draw = || {
        let t = RngTracker::new(3, 2);
        (
            pattern(&t, 32, 0.3, RngRegion::TensorModelParallel),
            pattern(&t, 32, 0.3, RngRegion::Default),
        )
    };
    assert_eq!(draw(), draw());
    let m = pattern(&RngTracker::new(3, 0), 10_000, 0.3, RngRegion::Default);
    let dropped = m.iter().filter(|&&k| !k).count() as f64 / 1e4;
    assert!((dropped - 0.3).abs() < 0.02, "{dropped}");
}

#[test]
fn dropout_scales_kept_values_and_is_off_without_autodiff() {
    let t = RngTracker::new(1, 0);
    let x = Tensor::<1>::ones([1000], &Device::flex().autodiff());
    let y: Vec<f32> = t
        .dropout(x, 0.5, RngRegion::Default)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect();
    assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
    let plain = Tensor::<1>::ones([4], &Device::flex());
    let z: Vec<f32> = t
        .dropout(plain, 0.5, RngRegion::Default)
        .unwrap()
        .into_data()
        .iter::<f32>()
        .collect();
    assert_eq!(z, vec![1.0; 4]);
    let bad = Tensor::<1>::ones([4], &Device::flex().autodiff());
    assert!(t.dropout(bad, 1.0, RngRegion::Default).is_err());
}
