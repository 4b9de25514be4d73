use super::exp;

#[test]
fn exp_is_expf_rounded_nearly_always_and_keeps_special_values() {
    let (mut same, mut total, mut worst_ulps) = (0usize, 0usize, 0u32);
    let mut x = -104.5f32;
    while x < 89.0 {
        let (got, want) = (exp(x), x.exp());
        worst_ulps = worst_ulps.max(got.to_bits().abs_diff(want.to_bits()));
        same += usize::from(got.to_bits() == want.to_bits());
        total += 1;
        x += 0.000_77;
    }
    assert!(worst_ulps <= 1, "{worst_ulps} ulps from expf");
    assert!(
        same * 1000 >= total * 999,
        "{same} of {total} equal to expf"
    );
    assert!(exp(f32::NAN).is_nan());
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-1e4), 0.0);
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp(100.0), f32::INFINITY);
    assert!(
        exp(-90.0) > 0.0 && exp(-90.0) < f32::MIN_POSITIVE,
        "denormal as expf"
    );
}
