use super::*;
use burn::tensor::Device;

#[derive(Module, Debug)]
struct Five {
    w: Param<Tensor<5>>,
    b: Param<Tensor<1>>,
}

/// A rank-5 parameter (a 3-d convolution's weight) is seen, read, taken and put back
/// like any other; before, ranks above 4 were silently skipped.
#[test]
fn parameters_of_any_rank_are_handled() {
    let device = Device::flex().autodiff();
    let model = Five {
        w: Param::from_tensor(Tensor::ones([2, 1, 2, 1, 3], &device)),
        b: Param::from_tensor(Tensor::ones([2], &device)),
    };
    let loss = (model.w.val() * 3.0).sum() + model.b.val().sum();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    let params = float_params(&model);
    assert_eq!(params, vec![(model.w.id, 5), (model.b.id, 1)]);
    let sum = |g: Tensor<1>| g.sum().into_scalar::<f32>();
    assert_eq!(with_flat(&grads, model.w.id, 5, sum), Some(36.0));
    // The global norm counts it: √(12 · 3² + 2 · 1²).
    let solo: crate::comm::Comm = std::sync::Arc::new(
        crate::comm::LocalWorld::new(1)
            .communicator("mp", vec![0], 0)
            .unwrap(),
    );
    let norm = crate::optimizer::global_grad_norm(
        &model,
        &grads,
        0,
        &solo,
        crate::optimizer::NormType::L2,
    )
    .unwrap();
    assert!((norm - 110f64.sqrt()).abs() < 1e-5, "{norm}");
    update_flat::<()>(&mut grads, model.w.id, 5, |g| Ok(g * 0.5)).unwrap();
    let w = grads.get::<5>(model.w.id).unwrap();
    assert_eq!(w.dims(), [2, 1, 2, 1, 3]);
    assert_eq!(w.sum().into_scalar::<f32>(), 18.0);
    let (flat, dims) = take_flat(&mut grads, model.w.id, 5).unwrap();
    assert_eq!((flat.dims(), dims.len()), ([12], 5));
    assert!(grads.get::<5>(model.w.id).is_none());
}
