//! Chunked attention against the unfused composition the attention layer ran before it
//! (grouped products, the fused masked softmax, dropout over the whole probabilities,
//! weighted values), forward and the gradients of q, k and v: bit for bit in one block on
//! Flex, within f32 summation error in several (causal blocks multiply fewer keys; the key
//! and value gradients are sums over blocks), on Flex and the Cube device, with grouped
//! queries, padding, causal masks and dropout. And the dropout window: a block of a tensor
//! drops what the whole tensor drops there.

use crate::common;

use burn::tensor::{Bool, DType, Device, Tensor, TensorData};
use burn_megatron_kernels::{
    AttentionParams, KernelError, MaskWindow, batched_matmul, chunked_attention, dropout,
    scaled_masked_softmax,
};
use common::{relative, tensor, to_vec, values};

/// One case: `[b, heads, sq, d]` queries over `groups` key/value heads of `sk` keys (the
/// flash attention's tests take it too).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Case {
    pub(crate) b: usize,
    pub(crate) heads: usize,
    pub(crate) groups: usize,
    pub(crate) sq: usize,
    pub(crate) sk: usize,
    pub(crate) d: usize,
    pub(crate) padded: bool,
    pub(crate) causal: bool,
    pub(crate) dropout: f32,
}

const CASES: [Case; 5] = [
    // Multi-head, nothing masked.
    Case {
        b: 2,
        heads: 2,
        groups: 2,
        sq: 7,
        sk: 7,
        d: 4,
        padded: false,
        causal: false,
        dropout: 0.0,
    },
    // Grouped queries (two heads per group), causal, padded, dropout: GPT's training case.
    Case {
        b: 2,
        heads: 4,
        groups: 2,
        sq: 9,
        sk: 9,
        d: 8,
        padded: true,
        causal: true,
        dropout: 0.3,
    },
    // Multi-query, bidirectional with padding and dropout: BERT's.
    Case {
        b: 1,
        heads: 3,
        groups: 1,
        sq: 10,
        sk: 10,
        d: 5,
        padded: true,
        causal: false,
        dropout: 0.2,
    },
    // Fewer queries than keys, causal (new queries after a cache).
    Case {
        b: 1,
        heads: 2,
        groups: 1,
        sq: 5,
        sk: 12,
        d: 4,
        padded: false,
        causal: true,
        dropout: 0.1,
    },
    // Bidirectional, fewer keys than queries.
    Case {
        b: 2,
        heads: 2,
        groups: 1,
        sq: 8,
        sk: 3,
        d: 4,
        padded: true,
        causal: false,
        dropout: 0.0,
    },
];

pub(crate) const SEED: u64 = 0x5EED_A77E;

impl Case {
    pub(crate) fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    pub(crate) fn params(&self, query_chunk: usize) -> AttentionParams {
        AttentionParams {
            scale: self.scale(),
            causal: self.causal,
            dropout: self.dropout,
            seed: SEED,
            query_chunk,
        }
    }

    /// Batch 0 pads its last two keys, batch 1 its middle one: never every key a row sees
    /// (see the module docs of `chunked_attention` for rows that see only padding).
    pub(crate) fn pad_values(&self) -> Vec<bool> {
        let sk = self.sk;
        (0..self.b * sk)
            .map(|k| match k / sk {
                0 => k % sk + 2 >= sk && k % sk > 0,
                _ => k % sk == sk / 2 && sk > 1,
            })
            .collect()
    }

    pub(crate) fn padding(&self, device: &Device) -> Option<Tensor<2, Bool>> {
        self.padded.then(|| {
            Tensor::from_data(
                TensorData::new(self.pad_values(), [self.b, self.sk]),
                device,
            )
        })
    }

    /// (q, k, v, output gradient) in `dt`, tracked.
    pub(crate) fn inputs(&self, device: &Device, dt: DType) -> [Tensor<4>; 4] {
        let q = [self.b, self.heads, self.sq, self.d];
        let kv = [self.b, self.groups, self.sk, self.d];
        let t = |dims: [usize; 4], seed| {
            tensor(device, values(dims.iter().product(), seed, 1.5), dims, dt).0
        };
        [
            t(q, 1).require_grad(),
            t(kv, 2).require_grad(),
            t(kv, 3).require_grad(),
            t(q, 4),
        ]
    }
}

/// The unfused composition (the attention layer's path before the chunked op).
pub(crate) fn unfused(
    case: &Case,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    pad: Option<Tensor<2, Bool>>,
) -> Tensor<4> {
    let Case {
        b,
        heads,
        groups,
        sq,
        sk,
        d,
        ..
    } = *case;
    let per_group = heads / groups;
    let scores = batched_matmul(q.reshape([b, groups, per_group * sq, d]), k.swap_dims(2, 3));
    let probs = scaled_masked_softmax(
        scores.reshape([b, heads, sq, sk]),
        pad,
        case.scale(),
        case.causal,
    )
    .unwrap();
    let probs = dropout(probs, case.dropout, SEED).unwrap();
    batched_matmul(probs.reshape([b, groups, per_group * sq, sk]), v).reshape([b, heads, sq, d])
}

/// [output, dq, dk, dv] of `attend` on `case`'s inputs.
pub(crate) fn run(
    case: &Case,
    device: &Device,
    dt: DType,
    attend: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<2, Bool>>) -> Tensor<4>,
) -> [Vec<f32>; 4] {
    let [q, k, v, grad] = case.inputs(device, dt);
    let out = attend(q.clone(), k.clone(), v.clone(), case.padding(device));
    let grads = (out.clone() * grad).sum().backward();
    let g = |t: &Tensor<4>| to_vec(t.grad(&grads).expect("a gradient reaches every input"));
    [to_vec(out), g(&q), g(&k), g(&v)]
}

fn chunked(
    case: Case,
    query_chunk: usize,
) -> impl Fn(Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<2, Bool>>) -> Tensor<4> {
    move |q, k, v, pad| chunked_attention(q, k, v, pad, case.params(query_chunk)).unwrap()
}

pub(crate) const NAMES: [&str; 4] = ["output", "dq", "dk", "dv"];

#[test]
fn one_block_is_the_unfused_composition_bit_for_bit_on_flex() {
    let device = common::flex();
    for case in CASES {
        let want = run(&case, &device, DType::F32, |q, k, v, p| {
            unfused(&case, q, k, v, p)
        });
        let got = run(&case, &device, DType::F32, chunked(case, case.sq));
        for ((got, want), name) in got.iter().zip(&want).zip(NAMES) {
            assert_eq!(got, want, "{name} of {case:?}");
        }
    }
}

/// Blocks of one row, of three (the last one shorter) and of all rows but one, against the
/// unfused composition.
fn blocks_match_unfused(device: &Device, dt: DType, tol: f32) {
    for case in CASES {
        let want = run(&case, device, dt, |q, k, v, p| unfused(&case, q, k, v, p));
        for chunk in [1, 3, case.sq - 1] {
            let got = run(&case, device, dt, chunked(case, chunk));
            for ((got, want), name) in got.iter().zip(&want).zip(NAMES) {
                let err = relative(got, want);
                assert!(
                    err <= tol,
                    "{name} of {case:?} in blocks of {chunk} rows ({dt:?}): relative error {err:e} above {tol:e}"
                );
            }
        }
    }
}

#[test]
fn blocks_match_the_unfused_composition_on_flex() {
    blocks_match_unfused(&common::flex(), DType::F32, 1e-5);
}

#[cfg(feature = "cube")]
#[test]
fn blocks_match_the_unfused_composition_on_cube() {
    let device = common::cube_device("blocks_match_the_unfused_composition_on_cube");
    blocks_match_unfused(&device, DType::F32, 1e-4);
    // Half precision: both round the products' inputs and outputs to f16, in other orders.
    blocks_match_unfused(&device, DType::F16, 2e-2);
}

/// A block of a tensor (rows `row0..row0 + rows`, the first `cols` columns) dropped under
/// its window equals the whole tensor's dropout there.
fn window_matches_the_whole(device: &Device) {
    let (outer, rows_total, cols_total) = (3, 7, 6);
    let whole = Tensor::<3>::from_data(
        TensorData::new(
            values(outer * rows_total * cols_total, 5, 1.0),
            [outer, rows_total, cols_total],
        ),
        device,
    );
    let dropped_whole = dropout(whole.clone(), 0.4, SEED).unwrap();
    for (row0, rows, cols) in [(0, 7, 6), (2, 3, 4), (6, 1, 1), (1, 5, 6)] {
        let window = MaskWindow {
            rows,
            cols,
            total_rows: rows_total,
            total_cols: cols_total,
            row0,
        };
        let block = whole.clone().slice([0..outer, row0..row0 + rows, 0..cols]);
        let got = Tensor::<3>::from_dispatch(
            <burn::backend::Dispatch as burn_megatron_kernels::BiasDropoutAddOps>::dropout(
                block.into_dispatch(),
                0.4,
                SEED,
                window,
            ),
        );
        let want = dropped_whole
            .clone()
            .slice([0..outer, row0..row0 + rows, 0..cols]);
        assert_eq!(to_vec(got), to_vec(want), "window {window:?}");
    }
}

#[test]
fn a_dropout_window_drops_what_the_whole_tensor_drops_on_flex() {
    window_matches_the_whole(&Device::flex());
}

#[cfg(feature = "cube")]
#[test]
fn a_dropout_window_drops_what_the_whole_tensor_drops_on_cube() {
    window_matches_the_whole(&common::cube_device("dropout window"));
}

#[test]
fn bad_inputs_are_refused_before_any_work() {
    let device = Device::flex();
    let t = |dims: [usize; 4]| Tensor::<4>::zeros(dims, &device);
    let ok = AttentionParams::new(0.5);
    let attend = |q, k, v, pad, p| chunked_attention(q, k, v, pad, p).map(|_| ());
    let shape = |r: Result<(), KernelError>, what: &str| {
        assert!(matches!(r, Err(KernelError::Shape(_))), "{what}: {r:?}")
    };
    let argument = |r: Result<(), KernelError>, what: &str| {
        assert!(matches!(r, Err(KernelError::Argument(_))), "{what}: {r:?}")
    };
    let (q, kv) = ([1, 4, 3, 8], [1, 2, 3, 8]);
    assert!(attend(t(q), t(kv), t(kv), None, ok).is_ok());
    shape(
        attend(t(q), t([1, 3, 3, 8]), t([1, 3, 3, 8]), None, ok),
        "3 groups for 4 heads",
    );
    shape(
        attend(t(q), t(kv), t([1, 2, 4, 8]), None, ok),
        "k and v differ",
    );
    shape(
        attend(t(q), t([1, 2, 3, 4]), t([1, 2, 3, 4]), None, ok),
        "head dims differ",
    );
    shape(
        attend(t(q), t([2, 2, 3, 8]), t([2, 2, 3, 8]), None, ok),
        "batches differ",
    );
    shape(
        attend(t([1, 4, 0, 8]), t(kv), t(kv), None, ok),
        "no queries",
    );
    shape(
        attend(t(q), t([1, 2, 0, 8]), t([1, 2, 0, 8]), None, ok),
        "no keys",
    );
    let pad = Tensor::<2, Bool>::empty([1, 4], &device);
    shape(
        attend(t(q), t(kv), t(kv), Some(pad), ok),
        "padding not [b, sk]",
    );
    let causal = AttentionParams { causal: true, ..ok };
    shape(
        attend(t([1, 4, 5, 8]), t(kv), t(kv), None, causal),
        "causal, sq > sk",
    );
    argument(
        attend(
            t(q),
            t(kv),
            t(kv),
            None,
            AttentionParams {
                query_chunk: 0,
                ..ok
            },
        ),
        "chunk 0",
    );
    argument(
        attend(
            t(q),
            t(kv),
            t(kv),
            None,
            AttentionParams { dropout: 1.0, ..ok },
        ),
        "dropout 1",
    );
    argument(
        attend(t(q), t(kv), t(kv), None, AttentionParams::new(f32::NAN)),
        "NaN scale",
    );
}
