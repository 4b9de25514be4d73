//! What the drop-in examples (`tp_llama_dropin`, `tp_bert_dropin`) compare a plain Burn model
//! and its tensor-parallel copy with: values and gradients gathered by module path, the
//! record paths both models share.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::comm::{Comm, LocalWorld, tensor::all_gather};
use burn_megatron::tensor_parallel::parallel_attrs;
use std::collections::BTreeMap;

/// Every float parameter's values by module path, split ones gathered over `tp` and cut to
/// their real size (a collective: every rank of `tp` calls it); with `grads`, their gradients instead. Plain
/// data, which rank threads may share.
pub fn by_path<M: Module>(
    model: &M,
    grads: Option<&GradientsParams>,
    tp: &Comm,
) -> BTreeMap<String, TensorData> {
    struct Gather<'a> {
        path: Vec<String>,
        grads: Option<&'a GradientsParams>,
        tp: &'a Comm,
        out: BTreeMap<String, TensorData>,
    }
    impl ModuleVisitor for Gather<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let value = match self.grads {
                Some(grads) => grads.get::<D>(p.id).expect("a gradient"),
                None => p.val(),
            };
            let attrs = parallel_attrs(p.id);
            let value = match attrs.split_dim() {
                Some(dim) => all_gather(&**self.tp, value, dim).expect("gather"),
                None => value,
            };
            // A padded vocabulary's tensor, cut to the plain model's.
            let value = match attrs.padding() {
                Some((dim, real)) => value.narrow(dim, 0, real),
                None => value,
            };
            self.out.insert(self.path.join("."), value.into_data());
        }
    }
    let mut gather = Gather {
        path: Vec::new(),
        grads,
        tp,
        out: BTreeMap::new(),
    };
    model.visit(&mut gather);
    gather.out
}

/// A communicator of one rank: the plain model's "group".
pub fn solo() -> Comm {
    let world = LocalWorld::new(1);
    std::sync::Arc::new(
        world
            .communicator("tp", vec![0], 0)
            .expect("a group of one"),
    )
}

/// Gradients are compared relative to their tensor's largest magnitude, or this when it is
/// smaller: the attention key bias's gradient is zero in exact arithmetic (a constant added
/// to every score of a query), about 1e-9 in f32.
const FLOOR: f32 = 1e-2;

/// The largest difference between `a` and `b` relative to `a`'s largest magnitude, or
/// 1e-2 (infinite when the shapes differ, NaN when a value is).
pub fn relative_difference(a: &TensorData, b: &TensorData) -> f32 {
    if a.shape() != b.shape() {
        return f32::INFINITY;
    }
    let max = |v: &mut dyn Iterator<Item = f32>| v.max_by(f32::total_cmp).unwrap_or(0.0);
    let scale = max(&mut a.iter::<f32>().map(f32::abs)).max(FLOOR);
    max(&mut a
        .iter::<f32>()
        .zip(b.iter())
        .map(|(x, y): (f32, f32)| (x - y).abs()))
        / scale
}

/// The largest [`relative_difference`] over the tensors of `plain`, with its path; a tensor
/// `parallel` lacks counts as infinitely far.
pub fn worst(
    plain: &BTreeMap<String, TensorData>,
    parallel: &BTreeMap<String, TensorData>,
) -> (f32, String) {
    let far = |(path, a): (&String, &TensorData)| {
        let d = parallel
            .get(path)
            .map_or(f32::INFINITY, |b| relative_difference(a, b));
        (d, path.clone())
    };
    let worst = plain.iter().map(far).max_by(|x, y| x.0.total_cmp(&y.0));
    match plain.len() == parallel.len() {
        true => worst.unwrap_or((0.0, String::new())),
        false => (f32::INFINITY, "(another set of parameters)".into()),
    }
}

/// Tensors by module path, as [`by_path`] gathers them.
pub type ByPath = BTreeMap<String, TensorData>;

/// `steps` AdamW steps (learning rate 3e-3, weight decay 0.01) on what `loss` computes: the
/// trained model, the losses, and the first step's gradients gathered by path over `tp`.
pub fn train<M: Module, E>(
    mut model: M,
    steps: usize,
    tp: &Comm,
    loss: impl Fn(&M) -> Result<Tensor<1>, E>,
) -> Result<(M, Vec<f32>, ByPath), E> {
    let mut optim = burn::optim::AdamWConfig::new()
        .with_weight_decay(0.01)
        .init();
    let (mut losses, mut grads0) = (Vec::new(), BTreeMap::new());
    for step in 0..steps {
        let l = loss(&model)?;
        losses.push(l.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(l.backward(), &model);
        if step == 0 {
            grads0 = by_path(&model, Some(&grads), tp);
        }
        model = optim.step(3e-3, model, grads);
    }
    Ok((model, losses, grads0))
}

/// The loss table the examples print (`layout`: the split one's, `TP=2`), and the largest
/// difference.
pub fn print_losses(layout: &str, single: &[f32], parallel: &[f32]) -> f32 {
    let loss = format!("{layout} loss");
    println!(" step    TP=1 loss {loss:>12}     |diff|");
    for (step, (a, b)) in single.iter().zip(parallel).enumerate() {
        println!("{step:>5} {a:>12.6} {b:>12.6} {:>10.2e}", (a - b).abs());
    }
    let worst = single.iter().zip(parallel).map(|(a, b)| (a - b).abs());
    let worst = worst.fold(0f32, |m, d| if d.is_nan() { d } else { m.max(d) });
    println!("largest loss difference: {worst:.2e}");
    worst
}

/// The bytes of `model`'s float parameters on this rank (its shards, for a split model).
pub fn param_bytes<M: Module>(model: &M) -> u64 {
    struct Bytes(u64);
    impl ModuleVisitor for Bytes {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val();
            self.0 += (t.shape().num_elements() * t.dtype().size()) as u64;
        }
    }
    let mut bytes = Bytes(0);
    model.visit(&mut bytes);
    bytes.0
}
