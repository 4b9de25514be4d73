use super::*;
use crate::tensor_parallel::RngRegion;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Distribution};

fn device() -> Device {
    Device::flex().autodiff()
}

type Mlp = (Linear, Linear);

fn mlp(device: &Device) -> Mlp {
    (
        LinearConfig::new(8, 32).init(device),
        LinearConfig::new(32, 8).init(device),
    )
}

/// Two linears with GeLU and a tracker's dropout between them.
fn body((fc1, fc2): &Mlp, x: Tensor<2>, rng: Option<&RngTracker>) -> Tensor<2> {
    let h = gelu(fc1.forward(x));
    let h = match rng {
        Some(rng) => rng.dropout(h, 0.3, RngRegion::Default).unwrap(),
        None => h,
    };
    fc2.forward(h)
}

fn values<const D: usize>(t: Option<Tensor<D>>) -> Vec<f32> {
    t.expect("a gradient").into_data().iter::<f32>().collect()
}

/// Loss and the gradients of the input and of every weight, with or without recomputation.
fn run(m: &Mlp, x: Tensor<2>, rng: Option<&RngTracker>, on: bool) -> Vec<Vec<f32>> {
    let y = if on {
        recompute(m, x.clone(), rng, body)
    } else {
        body(m, x.clone(), rng)
    };
    // A second use of a weight outside the region: its gradients add up.
    let loss = (y.powi_scalar(2).sum() + m.0.weight.val().sum()).reshape([1]);
    let grads = loss.backward();
    vec![
        values(Some(loss.inner())),
        values(x.grad(&grads)),
        values(m.0.weight.grad(&grads)),
        values(m.0.bias.as_ref().unwrap().grad(&grads)),
        values(m.1.weight.grad(&grads)),
    ]
}

#[test]
fn gradients_equal_the_run_without_recomputation() {
    let d = device();
    let m = mlp(&d);
    let x = Tensor::<2>::random([5, 8], Distribution::Normal(0.0, 1.0), &d).require_grad();
    // Bit-identical: the replay runs the same ops on the same values.
    assert_eq!(run(&m, x.clone(), None, true), run(&m, x, None, false));
}

#[test]
fn dropout_replays_the_same_masks() {
    let d = device();
    let m = mlp(&d);
    let x = Tensor::<2>::random([5, 8], Distribution::Normal(0.0, 1.0), &d).require_grad();
    let with = run(&m, x.clone(), Some(&RngTracker::new(11, 0)), true);
    let without = run(&m, x, Some(&RngTracker::new(11, 0)), false);
    assert_eq!(with, without);
    // The masks matter: another seed gives other gradients.
    let d2 = device();
    let x2 = Tensor::<2>::random([5, 8], Distribution::Normal(0.0, 1.0), &d2).require_grad();
    assert_ne!(
        run(&m, x2.clone(), Some(&RngTracker::new(11, 0)), true),
        run(&m, x2, Some(&RngTracker::new(12, 0)), true)
    );
}

#[test]
fn an_untracked_input_still_trains_the_parameters() {
    let d = device();
    let m = mlp(&d);
    let x = Tensor::<2>::random([5, 8], Distribution::Normal(0.0, 1.0), &d);
    let grads_of = |on: bool| {
        let y = if on {
            recompute(&m, x.clone(), None, body)
        } else {
            body(&m, x.clone(), None)
        };
        let grads = y.sum().backward();
        (
            values(m.0.weight.grad(&grads)),
            values(m.1.bias.as_ref().unwrap().grad(&grads)),
        )
    };
    assert_eq!(grads_of(true), grads_of(false));
}

#[test]
fn a_region_that_ignores_its_input_gives_it_a_zero_gradient() {
    let d = device();
    let m = mlp(&d);
    let x = Tensor::<2>::ones([2, 8], &d).require_grad();
    let y = recompute(&m, x.clone() * 2.0, None, |(_, fc2), x, _| {
        fc2.forward(x.zeros_like().narrow(1, 0, 8).repeat_dim(1, 4))
    });
    let grads = (y.sum() + x.clone().sum()).backward();
    assert_eq!(values(x.grad(&grads)), vec![1.0; 16]);
}

#[test]
fn inference_is_a_plain_call() {
    let d = Device::flex();
    let m = mlp(&d);
    let x = Tensor::<2>::ones([2, 8], &d);
    let a = recompute(&m, x.clone(), None, body).into_data();
    let b = body(&m, x, None).into_data();
    assert_eq!(a, b);
}

#[test]
fn a_parameter_free_region_passes_the_gradient_through() {
    let d = device();
    let x = Tensor::<2>::random([3, 4], Distribution::Normal(0.0, 1.0), &d).require_grad();
    let y = recompute_fn(x.clone(), None, |x: Tensor<2>, _| gelu(x).exp());
    let grads = y.sum().backward();
    let reference = {
        let x2 = x.clone().inner().autodiff().require_grad();
        let g = gelu(x2.clone()).exp().sum().backward();
        values(x2.grad(&g))
    };
    assert_eq!(values(x.grad(&grads)), reference);
}

#[test]
fn the_configuration_is_checked_as_megatron_checks_it() {
    let full = RecomputeConfig::new().with_granularity(Some(RecomputeGranularity::Full));
    assert!(full.check(4).unwrap_err().0.contains("--recompute-method"));
    let uniform = full
        .clone()
        .with_method(Some(RecomputeMethod::Uniform))
        .with_num_layers(Some(2));
    assert_eq!(uniform.check(4), Ok(()));
    assert!(
        uniform
            .check(1)
            .unwrap_err()
            .0
            .contains("between 1 and the 1 layers")
    );
    assert_eq!(
        uniform.layer_regions(5),
        vec![(0..2, true), (2..4, true), (4..5, true)]
    );
    let block = uniform.clone().with_method(Some(RecomputeMethod::Block));
    assert_eq!(
        block.layer_regions(3),
        vec![(0..1, true), (1..2, true), (2..3, false)]
    );
    let selective = RecomputeConfig::new().with_granularity(Some(RecomputeGranularity::Selective));
    assert_eq!(selective.check(4), Ok(()));
    assert!(selective.selects(RecomputeModule::CoreAttn));
    assert!(!selective.selects(RecomputeModule::Mlp));
    assert_eq!(selective.layer_regions(2), vec![(0..2, false)]);
    let norms = selective
        .clone()
        .with_modules(vec![RecomputeModule::Layernorm]);
    assert_eq!(norms.check(4), Ok(()));
    assert!(norms.selects(RecomputeModule::Layernorm));
    assert!(
        selective
            .with_num_layers(Some(1))
            .check(4)
            .unwrap_err()
            .0
            .contains("only to --recompute-granularity full")
    );
    assert_eq!(
        "mlp_act".parse::<RecomputeModule>(),
        Ok(RecomputeModule::MlpAct)
    );
    assert!("attn".parse::<RecomputeModule>().is_err());
    assert_eq!("mlp".parse::<RecomputeModule>(), Ok(RecomputeModule::Mlp));
}

#[test]
fn the_region_runs_again_in_backward_and_only_then() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let d = device();
    let m = mlp(&d);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let x = Tensor::<2>::ones([2, 8], &d).require_grad();
    let y = recompute(&m, x, None, move |m, x, rng| {
        counted.fetch_add(1, Ordering::SeqCst);
        body(m, x, rng)
    });
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the first forward");
    let _ = y.sum().backward();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the replay in backward");
}

/// `recompute_row_linear_input` (a gated unit's activation before a row-parallel layer with
/// its bias): the loss and the gradients of the stacked input, the weight and the bias are
/// the plain layer's, bit for bit; an input that does not split into the parts is refused.
#[test]
fn a_row_layer_input_region_gives_the_plain_gradients() {
    use crate::comm::{Comm, LocalWorld};
    use crate::tensor_parallel::RowParallelLinearConfig;
    use burn::tensor::activation::silu;
    use std::sync::Arc;
    let d = device();
    let tp: Comm = Arc::new(LocalWorld::new(1).communicator("tp", vec![0], 0).unwrap());
    let fc2 = RowParallelLinearConfig::new(16, 8)
        .with_bias_initializer(crate::tensor_parallel::MasterInit::KaimingUniform)
        .init(&tp, &d)
        .unwrap();
    let act = |p: Vec<Tensor<3>>| silu(p[0].clone()) * p[1].clone();
    let x = Tensor::<3>::random([6, 2, 16], Distribution::Normal(0.0, 1.0), &d).require_grad();
    let none: Option<Param<Tensor<1>>> = None;
    let run = |on: bool| {
        let y = if on {
            recompute_row_linear_input(&none, x.clone(), 2, move |_, p| act(p), &fc2)
                .unwrap()
                .0
        } else {
            fc2.forward(act(x.clone().chunk(2, 0)))
        };
        let loss = y.powi_scalar(2).sum();
        let grads = loss.backward();
        vec![
            values(Some(loss.inner())),
            values(x.grad(&grads)),
            values(fc2.weight.grad(&grads)),
            values(fc2.bias.as_ref().unwrap().grad(&grads)),
        ]
    };
    assert_eq!(run(true), run(false));
    let odd = Tensor::<3>::ones([5, 2, 16], &d).require_grad();
    let e = recompute_row_linear_input(&none, odd, 2, move |_, p| act(p), &fc2).unwrap_err();
    assert!(e.0.contains("(5) does not split into 2 equal parts"), "{e}");
}
