use super::*;

#[test]
fn greedy_takes_the_first_of_equal_maxima() {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    assert_eq!(
        choose(&[0.0, 3.0, 3.0, 1.0], &Sampling::Greedy, &mut rng),
        1
    );
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let logits = [0.5, 2.0, 1.9, -1.0];
    for _ in 0..50 {
        let k1 = Sampling::Sample {
            temperature: 1.0,
            top_k: Some(1),
            top_p: None,
        };
        assert_eq!(choose(&logits, &k1, &mut rng), 1);
        let p = Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: Some(1e-6),
        };
        assert_eq!(choose(&logits, &p, &mut rng), 1);
    }
}

#[test]
fn sampling_follows_the_softmax_and_respects_top_k() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let logits = [0.0f32, (2.0f32).ln(), -30.0];
    let all = Sampling::Sample {
        temperature: 1.0,
        top_k: None,
        top_p: None,
    };
    let n = 20_000;
    let ones = (0..n)
        .filter(|_| choose(&logits, &all, &mut rng) == 1)
        .count();
    // P(1) = 2/3.
    let p = ones as f64 / n as f64;
    assert!((p - 2.0 / 3.0).abs() < 0.02, "{p}");
    let k2 = Sampling::Sample {
        temperature: 5.0,
        top_k: Some(2),
        top_p: None,
    };
    assert!((0..2000).all(|_| choose(&logits, &k2, &mut rng) != 2));
}
