use super::*;

#[test]
fn llama3_scaling_keeps_short_divides_long_and_blends_between() {
    // head dim 16, base 10⁴: wavelengths 6.3, 19.9, 62.8, …; original context 32 puts
    // the cut-offs at 8 and 32.
    let plain = RotaryEmbeddingConfig::new(16).init().unwrap();
    let scaled = RotaryEmbeddingConfig::new(16)
        .with_scaling(Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        }))
        .init()
        .unwrap();
    let (p, s) = (plain.inv_freq(), scaled.inv_freq());
    assert_eq!(s[0], p[0]);
    assert!(s[1] < p[1] && s[1] > p[1] / 8.0, "{} vs {}", s[1], p[1]);
    for i in 2..8 {
        assert_eq!(s[i], p[i] / 8.0);
    }
}

#[test]
fn rotation_keeps_norms_and_rotates_by_the_position() {
    let device = Device::flex();
    let rope = RotaryEmbeddingConfig::new(4).init().unwrap();
    let x = Tensor::<4>::from_floats([[[[1.0, 2.0, 3.0, 4.0]]]], &device);
    let y: Vec<f32> = rope
        .tables(1, 1, &device)
        .apply(x)
        .into_data()
        .try_to_vec()
        .unwrap();
    // Position 1: channel pairs (0, 2) at angle 1, (1, 3) at angle 0.01.
    let (c, s) = (1f32.cos(), 1f32.sin());
    let (c2, s2) = (0.01f32.cos(), 0.01f32.sin());
    let want = [
        1.0 * c - 3.0 * s,
        2.0 * c2 - 4.0 * s2,
        3.0 * c + 1.0 * s,
        4.0 * c2 + 2.0 * s2,
    ];
    for (a, b) in y.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{y:?} vs {want:?}");
    }
}

#[test]
fn bad_shapes_are_refused() {
    assert!(
        RotaryEmbeddingConfig::new(6)
            .with_rotary_percent(0.5)
            .init()
            .is_err()
    );
    assert!(
        RotaryEmbeddingConfig::new(8)
            .with_rotary_base(0.5)
            .init()
            .is_err()
    );
    assert!(
        RotaryEmbeddingConfig::new(8)
            .with_rotary_percent(0.0)
            .init()
            .is_err()
    );
    let bad = RotaryEmbeddingConfig::new(8).with_scaling(Some(RopeScaling::Linear { factor: 0.5 }));
    assert!(bad.init().is_err());
}
