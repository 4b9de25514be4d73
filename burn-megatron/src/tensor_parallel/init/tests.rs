use super::*;

#[test]
fn streams_are_reproducible_and_distinct() {
    let init = MasterInit::Normal {
        mean: 0.0,
        std: 1.0,
    };
    assert_eq!(init.values(8, 1, 1), init.values(8, 1, 1));
    assert_ne!(init.values(8, 1, 1), init.values(8, 1, 2));
    assert_ne!(derive_seed(1, "a.weight"), derive_seed(1, "b.weight"));
    assert_eq!(derive_seed(1, "a.weight"), derive_seed(1, "a.weight"));
}

#[test]
fn kaiming_bound_and_constant() {
    let v = MasterInit::KaimingUniform.values(1000, 16, 3);
    assert!(v.iter().all(|x| x.abs() <= 0.25));
    assert!(v.iter().any(|x| x.abs() > 0.2));
    assert_eq!(MasterInit::Constant(1.5).values(3, 1, 0), vec![1.5; 3]);
}

#[test]
fn slices() {
    let m: Vec<f32> = (0..6).map(|x| x as f32).collect(); // [2, 3]
    assert_eq!(slice_rows(&m, 3, 1, 1), vec![3., 4., 5.]);
    assert_eq!(slice_cols(&m, 3, 1, 2), vec![1., 2., 4., 5.]);
}
