use super::*;

#[test]
fn exp_is_within_2_ulp_of_libm_and_keeps_nan() {
    let mut worst = 0.0f64;
    let mut x = -87.0f32;
    while x < 88.0 {
        let (got, want) = (exp(x) as f64, (x as f64).exp());
        worst = worst.max(((got - want) / want).abs());
        x += 0.001_7;
    }
    assert!(worst < 2.5e-7, "max relative error {worst}");
    assert!(exp(f32::NAN).is_nan());
    assert!(exp(-1e4) < 1.3e-38 && exp(-1e4) >= 0.0);
    assert_eq!(exp(0.0), 1.0);
}

#[test]
fn lane_sum_adds_every_element() {
    let xs: Vec<f32> = (0..37).map(|i| i as f32).collect();
    assert_eq!(lane_sum(&xs, |x| x), 666.0);
    assert_eq!(lane_sum::<f32>(&[], |x| x), 0.0);
    assert_eq!(lane_fold(&xs, f32::NEG_INFINITY, f32::max, f32::max), 36.0);
    assert_eq!(lane_sum(&xs, |x| x * x), 16206.0);
}
