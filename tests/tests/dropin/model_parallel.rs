//! A checkpoint saved one file per model-parallel rank (`RecordSource::ModelParallel`): Burn's
//! encoder split over two files as Megatron splits it at TP 2 loads at TP 1, 2 and 4 as its
//! whole record does, each rank reading only the parts its shards overlap.

use super::load::{params, scratch, transposed, write_safetensors};
use super::{D_FF, D_MODEL, Error, config, encoder_record, plain_encoder, solo, split_encoder};
use burn::tensor::Device;
use burn_megatron::dropin::{LoadOptions, RecordSource, load_sharded};
use burn_megatron_tests::gpt::gathered;
use burn_megatron_tests::tp_ranks;
use std::path::Path;

/// A tensor by name: its shape and values.
pub(super) type Named = (String, Vec<usize>, Vec<f32>);

/// The two ranks' parts of `tensors`: the `i`-th split in two along the dimension `dim(i,
/// name, shape)` gives, or whole in both where it gives none.
pub(super) fn halves(
    tensors: &[Named],
    dim: impl Fn(usize, &str, &[usize]) -> Option<usize>,
) -> [Vec<Named>; 2] {
    [0, 1].map(|r| {
        (tensors.iter().enumerate())
            .map(|(i, (name, shape, v))| match dim(i, name, shape) {
                Some(d) => {
                    let (shape, v) = half(shape, v, d, r);
                    (name.clone(), shape, v)
                }
                None => (name.clone(), shape.clone(), v.clone()),
            })
            .collect()
    })
}

/// `parts` (rank `r`'s in `dir/{tag}.{r}.safetensors`) as a model-parallel checkpoint.
pub(super) fn write_parts(dir: &Path, tag: &str, parts: &[Vec<Named>]) -> RecordSource {
    let paths = (parts.iter().enumerate())
        .map(|(r, tensors)| {
            let path = dir.join(format!("{tag}.{r}.safetensors"));
            write_safetensors(&path, tensors);
            path
        })
        .collect();
    RecordSource::ModelParallel(paths)
}

/// Part `r` of 2 of `shape`'s tensor `v`, split along `dim`.
fn half(shape: &[usize], v: &[f32], dim: usize, r: usize) -> (Vec<usize>, Vec<f32>) {
    let inner: usize = shape[dim + 1..].iter().product();
    let (outer, n) = (v.len() / (shape[dim] * inner), shape[dim] / 2);
    let mut part = shape.to_vec();
    part[dim] = n;
    let values = (0..outer)
        .flat_map(|o| {
            let at = (o * shape[dim] + r * n) * inner;
            v[at..at + n * inner].iter().copied()
        })
        .collect();
    (part, values)
}

#[test]
fn a_model_parallel_checkpoint_loads_at_any_tp_size_reading_only_the_parts_it_needs()
-> Result<(), Error> {
    let config = config(true, 0.0);
    let dir = scratch("model-parallel");
    let bpk = encoder_record(&config, &dir, "encoder.bpk");
    let plain = plain_encoder(&config, &bpk, &Device::flex());
    let whole = gathered(&plain, None, &solo());
    // PyTorch's layout (`[out, in]` linears), each rank's part as Megatron holds it: the
    // column-parallel linears' rows and biases, the row-parallel ones' columns, the rest whole.
    let torch: Vec<Named> = (params(&plain).into_iter())
        .map(|(path, shape, v)| match shape.len() == 2 {
            true => (path, vec![shape[1], shape[0]], transposed(&shape, &v)),
            false => (path, shape, v),
        })
        .collect();
    let column = ["query", "key", "value", "linear_inner"];
    let split = |name: &str| -> Option<usize> {
        let row = name.contains(".output.") || name.contains(".linear_outer.");
        match column.iter().any(|c| name.contains(&format!(".{c}."))) {
            true => Some(0),
            false => (row && name.ends_with(".weight")).then_some(1),
        }
    };
    let source = write_parts(&dir, "mp_rank", &halves(&torch, |_, name, _| split(name)));
    let options = LoadOptions::default().with_transposed(r"\.weight$")?;
    // The largest split tensor, the feed-forward's, whole and one file's part of it.
    let largest = (D_MODEL * D_FF * 4) as u64;
    for tp in [1, 2, 4] {
        let out = tp_ranks(tp, |ctx| {
            let (g, d) = (&ctx.groups.tp, &ctx.device);
            let (encoder, report) =
                load_sharded(split_encoder(&config, g, 99, d)?, &source, g, &options)?;
            Ok::<_, Error>((gathered(&encoder, None, g), report))
        })?;
        for (rank, (weights, report)) in out.into_iter().enumerate() {
            assert_eq!(weights, whole, "TP {tp}, rank {rank}: the plain weights");
            // At TP 1 both parts of a tensor, else the one part its shard lies in.
            let read = if tp == 1 { largest } else { largest / 2 };
            assert_eq!(
                report.largest_whole_tensor_bytes, read,
                "TP {tp}, rank {rank}"
            );
        }
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
