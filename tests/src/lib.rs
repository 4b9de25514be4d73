//! Helpers shared by the integration and parity tests under `tests/tests/`.

use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_megatron::models::TransformerLayerConfig;
use burn_megatron::tensor_parallel::MasterInit;

pub mod bert;
pub mod gpt;
pub mod mlp;

/// `layer` without dropout (hidden and attention), for comparisons that must be exact.
pub fn no_dropout(layer: TransformerLayerConfig) -> TransformerLayerConfig {
    let mut layer = layer.with_hidden_dropout(0.0);
    layer.attention.attention_dropout = 0.0;
    layer
}

/// A plain Burn `Linear` whose weight and bias are drawn from `seed` on the host (the same
/// on every rank and in every process).
pub fn seeded_linear(d_input: usize, d_output: usize, seed: u64, device: &Device) -> Linear {
    let w = MasterInit::KaimingUniform.values(d_input * d_output, d_input, seed);
    let b = MasterInit::Uniform {
        low: -0.2,
        high: 0.2,
    }
    .values(d_output, d_input, seed + 1);
    Linear {
        weight: Param::from_tensor(Tensor::from_data(
            TensorData::new(w, [d_input, d_output]),
            device,
        )),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(b, [d_output]),
            device,
        ))),
    }
}

/// A plain Burn `Embedding` drawn from `seed` on the host.
pub fn seeded_embedding(vocab: usize, dim: usize, seed: u64, device: &Device) -> Embedding {
    let w = MasterInit::Normal {
        mean: 0.0,
        std: 1.0,
    }
    .values(vocab * dim, dim, seed);
    Embedding {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [vocab, dim]), device)),
    }
}

/// A tensor's values as f32.
pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .try_to_vec()
        .expect("float data")
}

/// Asserts `a` and `b` agree element-wise within `tol` (absolute), naming the first
/// difference.
pub fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol,
            "{what}[{i}]: {x} vs {y} (tolerance {tol})"
        );
    }
}

/// A deterministic tensor of `shape` for step `step`, values in about [-1, 1].
pub fn data<const D: usize>(
    shape: [usize; D],
    step: usize,
    salt: usize,
    device: &Device,
) -> Tensor<D> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7919 + step * 104_729 + salt * 13) % 2003) as f32 / 1001.5) - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// Gives every parameter an id never registered in this process: what a model saved by
/// another process carries.
struct AnotherProcess;

impl burn::module::ModuleMapper for AnotherProcess {
    fn map_float<const D: usize>(&mut self, mut param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.id = burn::module::ParamId::new();
        param
    }
}

/// The parameter ids of `module`, in visiting order.
pub fn param_ids<M: burn::module::Module>(module: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// `saved` as a new process gets it back through Burn's own record API: written with
/// `save_file` to `path` under ids this process never registered, read with `load_file` into
/// `fresh` (which reads the file lazily: leave it in place). Checks that Burn restored the
/// saved ids, so nothing registered at `fresh`'s init describes them.
pub fn reload_as_another_process<M: burn::module::Module>(
    saved: M,
    fresh: M,
    path: &std::path::Path,
) -> M {
    let saved = saved.map(&mut AnotherProcess);
    let ids = param_ids(&saved);
    saved.save_file(path).expect("save_file");
    let loaded = fresh.load_file(path);
    assert_eq!(param_ids(&loaded), ids, "Burn's load keeps the saved ids");
    loaded
}

/// The directory of the test fixture `name` (`tests/fixtures/{name}`).
pub fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// Every tensor of a safetensors file (a fixture) as (shape, f32 or i64 values widened to
/// f64), by name.
pub fn read_safetensors(
    path: &std::path::Path,
) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    file.names()
        .into_iter()
        .map(|name| {
            let v = file.tensor(name).expect("listed");
            let values: Vec<f64> = match v.dtype() {
                safetensors::Dtype::F32 => v
                    .data()
                    .chunks(4)
                    .map(|c| f64::from(f32::from_le_bytes(c.try_into().expect("4 bytes"))))
                    .collect(),
                safetensors::Dtype::I64 => v
                    .data()
                    .chunks(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as f64)
                    .collect(),
                d => panic!("{name}: unexpected {d:?}"),
            };
            (name.to_string(), (v.shape().to_vec(), values))
        })
        .collect()
}

/// `model` with every parameter replaced by its gradient in `grads`, so that a function that
/// names, gathers and lays out parameters (a Hugging Face export, say) does the same for the
/// gradients.
///
/// # Panics
///
/// When a parameter has no gradient.
pub fn as_gradients<M: burn::module::Module>(model: &M, grads: &burn::optim::GradientsParams) -> M {
    struct ToGrad<'a>(&'a burn::optim::GradientsParams);
    impl burn::module::ModuleMapper for ToGrad<'_> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let g = self
                .0
                .get::<D>(p.id)
                .expect("every parameter has a gradient");
            p.map(|_| g)
        }
    }
    model.clone().map(&mut ToGrad(grads))
}

/// `f` on `tp` ranks as threads of this process, all one tensor-parallel group (no pipeline,
/// no data parallelism): the layout of every TP parity test.
pub fn tp_ranks<T, E, F>(tp: usize, f: F) -> Result<Vec<T>, burn_megatron::launch::LaunchError<E>>
where
    T: Send,
    E: std::fmt::Display + Send,
    F: Fn(burn_megatron::launch::RankContext) -> Result<T, E> + Sync,
{
    let config = burn_megatron::topology::ParallelConfig::new(tp, tp, 1);
    burn_megatron::launch::threads(&config, burn_megatron::launch::LaunchOptions::default(), f)
}
