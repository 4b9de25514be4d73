//! Burn's column layout (`LinearLayout::Col`, as PyTorch and ONNX imports build linears: the
//! record holds each weight `[out, in]`): a model of such linears, swapped for `dropin::nn`'s,
//! loads the record Burn's model saved whole and split at TP 2 and 4 (one layer
//! column-parallel, one row-parallel, one duplicated), gives Burn's output and gradients, and
//! saves back the record Burn's model loads, bit for bit; after an optimizer step too.

use super::Error;
use burn::module::Module;
use burn::nn::LinearLayout;
use burn::tensor::Device;
use burn::tensor::activation::relu;
use burn_megatron::comm::Comm;
use burn_megatron::dropin::{LoadOptions, RecordSource, TpPlan, load_sharded, nn, save_gathered};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;
use burn_megatron_tests::{data, values};

const D: usize = 8;
const FF: usize = 12;
const OUT: usize = 5;

/// The same model twice, over Burn's linears and over the drop-in ones.
macro_rules! mlp {
    ($name:ident, $linear:ty, $config:ty) => {
        #[derive(Module, Debug)]
        struct $name {
            up: $linear,
            down: $linear,
            head: $linear,
        }

        impl $name {
            fn new(device: &Device) -> Self {
                let linear = |i, o| {
                    <$config>::new(i, o)
                        .with_layout(LinearLayout::Col)
                        .init(device)
                };
                Self {
                    up: linear(D, FF),
                    down: linear(FF, D),
                    head: linear(D, OUT),
                }
            }

            fn forward(&self, x: burn::tensor::Tensor<3>) -> burn::tensor::Tensor<3> {
                self.head
                    .forward(self.down.forward(relu(self.up.forward(x))))
            }
        }
    };
}

mlp!(Plain, burn::nn::Linear, burn::nn::LinearConfig);
mlp!(Ours, nn::Linear, nn::LinearConfig);

/// The output, and the gradients of `sum(y · w)` (gathered).
fn run<M: Module>(
    forward: impl Fn(&M) -> burn::tensor::Tensor<3>,
    model: &M,
    tp: &Comm,
    d: &Device,
) -> (Vec<f32>, super::Values) {
    let y = forward(model);
    let grads = (y.clone() * data([2, 3, OUT], 0, 2, d)).sum().backward();
    let grads = burn::optim::GradientsParams::from_grads(grads, model);
    (values(y), gathered(model, Some(&grads), tp))
}

#[test]
fn linears_in_burns_column_layout_load_split_and_save_back_as_burns() -> Result<(), Error> {
    let dir = super::load::scratch("layout");
    let record = dir.join("plain.bpk");
    Plain::new(&Device::flex()).save_file(&record)?;
    let ad = Device::flex().autodiff();
    let plain = Plain::new(&ad).load_file(&record);
    let x = |d: &Device| data([2, 3, D], 0, 1, d);
    let (y_plain, g_plain) = run(|m: &Plain| m.forward(x(&ad)), &plain, &super::solo(), &ad);
    let source = RecordSource::from_path(&record);
    let options = LoadOptions::default();
    for tp in [1, 2, 4] {
        let saved = dir.join(format!("saved-{tp}.bpk"));
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            // TP 1 leaves the layers whole: their mappers read Burn's layout, into
            // weights already drawn (a forward draws them).
            let model = match tp {
                1 => {
                    let model = Ours::new(d);
                    model.forward(x(d));
                    model
                }
                _ => TpPlan::new()
                    .column(&["up"])?
                    .row(&["down"])?
                    .apply(Ours::new(d), g)?,
            };
            let (model, _) = load_sharded(model, &source, g, &options)?;
            let out = run(|m: &Ours| m.forward(x(d)), &model, g, d);
            save_gathered(&model, &saved, g)?;
            Ok::<_, Error>(out)
        })?;
        for (rank, (y, grads)) in out.iter().enumerate() {
            let what = format!("TP {tp}, rank {rank}");
            super::assert_parity(&what, (y, grads), (&y_plain, &g_plain));
        }
        // Burn's model loads what the split one saved, every weight as it was.
        let back = Plain::new(&Device::flex()).try_load_file(&saved)?;
        let want = gathered(
            &Plain::new(&Device::flex()).load_file(&record),
            None,
            &super::solo(),
        );
        assert_eq!(
            gathered(&back, None, &super::solo()),
            want,
            "TP {tp}: saved back"
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// After an optimizer step the layers keep Burn's column layout: the record the stepped
/// split model saves (the head whole, its mapper kept through the step) is the one Burn's
/// model writes after the same step, within rounding.
#[test]
fn column_layout_survives_an_optimizer_step() -> Result<(), Error> {
    use burn::optim::{AdamWConfig, GradientsParams};
    let dir = super::load::scratch("layout-step");
    let record = dir.join("plain.bpk");
    Plain::new(&Device::flex()).save_file(&record)?;
    let step = |loss: burn::tensor::Tensor<3>| loss.sum().backward();
    let ad = Device::flex().autodiff();
    let plain = Plain::new(&ad).load_file(&record);
    let grads =
        GradientsParams::from_grads(step(plain.forward(data([2, 3, D], 0, 1, &ad))), &plain);
    let plain = AdamWConfig::new().init().step(1e-2, plain, grads);
    let stepped = dir.join("stepped.bpk");
    plain.clone().save_file(&stepped)?;
    let saved = dir.join("saved.bpk");
    tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let model = TpPlan::new().column(&["up"])?.row(&["down"])?;
        let model = model.apply(Ours::new(d), g)?;
        let (model, _) = load_sharded(
            model,
            &RecordSource::from_path(&record),
            g,
            &LoadOptions::default(),
        )?;
        let grads =
            GradientsParams::from_grads(step(model.forward(data([2, 3, D], 0, 1, d))), &model);
        let model = AdamWConfig::new().init().step(1e-2, model, grads);
        save_gathered(&model, &saved, g)?;
        Ok::<_, Error>(())
    })?;
    let load = |path| -> Result<super::Values, Error> {
        let model = Plain::new(&Device::flex()).try_load_file(path)?;
        Ok(gathered(&model, None, &super::solo()))
    };
    let (got, want) = (load(&saved)?, load(&stepped)?);
    let (worst, name) = super::grad_diff(&got, &want);
    assert!(worst < 1e-5, "{name} off by {worst}");
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A column-layout layer's output width, drawn or not (Burn holds an undrawn one's weight
/// `[out, in]`), whole and split.
#[test]
fn a_column_layout_layer_knows_its_output_width_before_it_is_drawn() -> Result<(), Error> {
    let widths = tp_ranks(2, |ctx| {
        let (g, d) = (&ctx.groups.tp, &ctx.device);
        let model = Ours::new(d);
        let whole = model.head.d_output();
        let split = TpPlan::new().column(&["up"])?.apply(model, g)?;
        let drawn = Ours::new(d);
        drawn.forward(data([2, 3, D], 0, 1, d));
        Ok::<_, Error>([whole, split.up.d_output(), drawn.head.d_output()])
    })?;
    assert!(widths.iter().all(|w| *w == [OUT, FF, OUT]), "{widths:?}");
    Ok(())
}
