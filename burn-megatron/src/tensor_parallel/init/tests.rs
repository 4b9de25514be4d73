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

/// A padded vocabulary's rows (embedding) and columns (output layer, weight and bias) are
/// drawn as zeros, as a checkpoint's load fills them, and its real ones as without padding;
/// its ids stop at the real vocabulary.
#[test]
fn padded_vocabulary_layers_draw_their_padding_as_zeros() {
    use crate::comm::{Comm, LocalWorld};
    use crate::tensor_parallel::{ColumnParallelLinearConfig, VocabParallelEmbeddingConfig};
    use burn::tensor::Device;
    let world = LocalWorld::new(1);
    let tp: Comm = std::sync::Arc::new(world.communicator("tp", vec![0], 0).unwrap());
    let device = Device::flex();
    let values = |t: burn::tensor::Tensor<2>| t.into_data().iter::<f32>().collect::<Vec<_>>();
    let table = |real| {
        let config = VocabParallelEmbeddingConfig::new(8, 3).with_unpadded_size(real);
        values(config.with_seed(5).init(&tp, &device).unwrap().weight.val())
    };
    // A padding row is no token: the id check stops at the real vocabulary.
    let layer = VocabParallelEmbeddingConfig::new(8, 3)
        .with_unpadded_size(Some(5))
        .init(&tp, &device)
        .unwrap();
    let ids = burn::tensor::Tensor::<2, burn::tensor::Int>::from_ints([[4, 5]], &device);
    let e = layer.checked_ids(ids.clone()).unwrap_err().to_string();
    assert!(e.contains("token id 5"), "{e}");
    let clamped = layer.with_id_check(crate::tensor_parallel::IdCheck::Clamp);
    let clamped = clamped.checked_ids(ids).unwrap().into_data();
    assert_eq!(clamped.iter::<i64>().collect::<Vec<_>>(), vec![4, 4]);
    let (whole, padded) = (table(None), table(Some(5)));
    assert_eq!(padded[..15], whole[..15]);
    assert!(padded[15..].iter().all(|&x| x == 0.0) && whole[15..].iter().any(|&x| x != 0.0));
    let output = |real| {
        let config = ColumnParallelLinearConfig::new(3, 8)
            .with_bias_initializer(MasterInit::Normal {
                mean: 0.0,
                std: 1.0,
            })
            .with_unpadded_size(real);
        let layer = config.with_seed(6).init(&tp, &device).unwrap();
        let bias = layer
            .bias
            .unwrap()
            .val()
            .into_data()
            .iter::<f32>()
            .collect::<Vec<_>>();
        (values(layer.weight.val()), bias)
    };
    let ((w, b), (pw, pb)) = (output(None), output(Some(5)));
    for r in 0..3 {
        assert_eq!(pw[r * 8..r * 8 + 5], w[r * 8..r * 8 + 5]);
        assert!(pw[r * 8 + 5..(r + 1) * 8].iter().all(|&x| x == 0.0));
    }
    assert_eq!(pb[..5], b[..5]);
    assert!(pb[5..].iter().all(|&x| x == 0.0) && b[5..].iter().any(|&x| x != 0.0));
}
