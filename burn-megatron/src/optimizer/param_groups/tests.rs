use super::*;
use burn::module::Param;
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};

#[test]
fn biases_and_1d_params_get_no_weight_decay() {
    let device = Device::flex().autodiff();
    let model = Linear {
        weight: Param::from_tensor(Tensor::<2>::ones([2, 2], &device)),
        bias: Some(Param::from_tensor(Tensor::<1>::ones([2], &device))),
    };
    assert_eq!(
        one_dimensional_params(&model),
        vec![model.bias.as_ref().unwrap().id]
    );
    let adamw = AdamWConfig::new().with_weight_decay(0.5);
    let mut optim = megatron_param_groups(
        &model,
        adamw.build(),
        adamw.with_weight_decay(0.0).build(),
        None,
    );
    // Zero gradients: only decoupled weight decay moves a parameter, w ← w − lr·wd·w.
    let x = Tensor::<2>::zeros([1, 2], &device);
    let grads = GradientsParams::from_grads((model.forward(x) * 0.0).sum().backward(), &model);
    let model = optim.step(0.1, model, grads);
    let w: Vec<f32> = model.weight.val().into_data().try_to_vec().unwrap();
    let b: Vec<f32> = model.bias.unwrap().val().into_data().try_to_vec().unwrap();
    assert!(w.iter().all(|&v| (v - 0.95).abs() < 1e-6), "{w:?}");
    assert_eq!(b, vec![1.0, 1.0]);
}

#[test]
fn lr_mult_scales_the_inner_schedule() {
    let inner = burn::optim::lr_scheduler::constant::ConstantLr::new(0.2);
    let mut s = LrMultScheduler::new(inner, 0.5);
    assert!((s.step() - 0.1).abs() < 1e-12);
}
