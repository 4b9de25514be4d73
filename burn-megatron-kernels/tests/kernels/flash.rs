//! Flash attention against the unfused composition (grouped products, the fused masked
//! softmax, dropout over the whole probabilities, weighted values) on the same device:
//! the output and the gradients of q, k and v, with grouped queries, padding, causal masks
//! (fewer queries than keys too) and dropout, at sizes that span several query blocks and
//! key tiles (and a head dimension whose tiles are shorter than a block). The rows'
//! log-sum-exp against one summed in f64 on the host. Attention over blocks of keys merged
//! by their log-sum-exps, each block's backward from the merged statistics (ring
//! attention's use), against the composition over all the keys.

use crate::common;

use crate::attention::{Case, NAMES, run, unfused};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::{
    AttentionParams, FLASH_MAX_HEAD_DIM, KernelError, MASKED_SCORE, flash_attention,
    flash_attention_backward, flash_attention_with_lse,
};
use common::{relative, to_vec};

const CASES: [Case; 5] = [
    // GPT's training case: grouped queries, causal, padded, dropout; three query blocks.
    Case {
        b: 2,
        heads: 4,
        groups: 2,
        sq: 70,
        sk: 70,
        d: 16,
        padded: true,
        causal: true,
        dropout: 0.2,
    },
    // BERT's: multi-query, bidirectional, padded, dropout.
    Case {
        b: 1,
        heads: 3,
        groups: 1,
        sq: 45,
        sk: 45,
        d: 24,
        padded: true,
        causal: false,
        dropout: 0.1,
    },
    // New queries after a cache: fewer queries than keys, causal.
    Case {
        b: 1,
        heads: 2,
        groups: 2,
        sq: 20,
        sk: 75,
        d: 8,
        padded: false,
        causal: true,
        dropout: 0.0,
    },
    // Bidirectional, fewer keys than queries.
    Case {
        b: 2,
        heads: 2,
        groups: 1,
        sq: 40,
        sk: 9,
        d: 8,
        padded: true,
        causal: false,
        dropout: 0.0,
    },
    // A wide head: shared-memory tiles of 16 rows, two per block.
    Case {
        b: 1,
        heads: 2,
        groups: 1,
        sq: 40,
        sk: 40,
        d: 160,
        padded: true,
        causal: true,
        dropout: 0.1,
    },
];

/// The flash op's parameters for `case` (it does not read the query chunk).
fn params(case: &Case) -> AttentionParams {
    case.params(usize::MAX)
}

fn matches_unfused(cases: &[Case], device: &Device, dt: DType, tol: f32) {
    for &case in cases {
        let want = run(&case, device, dt, |q, k, v, p| unfused(&case, q, k, v, p));
        let got = run(&case, device, dt, |q, k, v, p| {
            flash_attention(q, k, v, p, params(&case)).unwrap()
        });
        for ((got, want), name) in got.iter().zip(&want).zip(NAMES) {
            let err = relative(got, want);
            assert!(
                err <= tol,
                "{name} of {case:?} ({dt:?}): relative error {err:e} above {tol:e}"
            );
        }
    }
}

#[test]
fn flash_matches_the_unfused_composition_on_flex() {
    matches_unfused(&CASES, &common::flex(), DType::F32, 1e-5);
}

#[cfg(feature = "cube")]
#[test]
fn flash_matches_the_unfused_composition_on_cube() {
    let device = common::cube_device("flash_matches_the_unfused_composition_on_cube");
    matches_unfused(&CASES, &device, DType::F32, 1e-4);
    // Half precision, GPT's case (each dtype compiles every kernel again: minutes on a cold
    // lavapipe for all five): the composition rounds scores and probabilities to f16, flash
    // keeps them in f32.
    matches_unfused(&CASES[..1], &device, DType::F16, 2e-2);
}

/// Each row's log-sum-exp of its scaled, masked scores over the keys its 32-row block sees,
/// in f64 from the inputs as stored.
fn host_lse(case: &Case, q: &[f32], k: &[f32]) -> Vec<f32> {
    let Case {
        b,
        heads,
        groups,
        sq,
        sk,
        d,
        ..
    } = *case;
    let pad = case.pad_values();
    let scale = f64::from(case.scale());
    let mut out = Vec::with_capacity(b * heads * sq);
    for bi in 0..b {
        for h in 0..heads {
            let g = h / (heads / groups);
            for i in 0..sq {
                let keys = match case.causal {
                    true => ((i / 32 + 1) * 32).min(sq) + sk - sq,
                    false => sk,
                };
                let scores: Vec<f64> = (0..keys)
                    .map(|j| {
                        let hidden =
                            (case.causal && j + sq > i + sk) || (case.padded && pad[bi * sk + j]);
                        let dot: f64 = (0..d)
                            .map(|c| {
                                let qv = q[((bi * heads + h) * sq + i) * d + c];
                                let kv = k[((bi * groups + g) * sk + j) * d + c];
                                f64::from(qv) * f64::from(kv)
                            })
                            .sum();
                        if hidden {
                            f64::from(MASKED_SCORE)
                        } else {
                            dot * scale
                        }
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                out.push((max + sum.ln()) as f32);
            }
        }
    }
    out
}

fn lse_matches_the_host(device: &Device, tol: f32) {
    for case in CASES {
        let [q, k, v, _] = case.inputs(device, DType::F32);
        let want = host_lse(&case, &to_vec(q.clone()), &to_vec(k.clone()));
        let (_, lse) =
            flash_attention_with_lse(q, k, v, case.padding(device), params(&case)).unwrap();
        assert_eq!(lse.dims(), [case.b, case.heads, case.sq]);
        let err = relative(&to_vec(lse), &want);
        assert!(err <= tol, "log-sum-exp of {case:?}: {err:e} above {tol:e}");
    }
}

#[test]
fn log_sum_exp_matches_the_host_on_flex() {
    lse_matches_the_host(&common::flex(), 1e-5);
}

#[cfg(feature = "cube")]
#[test]
fn log_sum_exp_matches_the_host_on_cube() {
    lse_matches_the_host(
        &common::cube_device("log_sum_exp_matches_the_host_on_cube"),
        1e-5,
    );
}

/// Keys in two blocks (a split inside a key tile), each attended with its log-sum-exp; the
/// outputs merged by their log-sum-exps; each block's backward from the merged output and
/// log-sum-exp; `dq` summed, `dk` and `dv` concatenated: the composition over every key.
fn merged_blocks_match_the_unfused_composition(device: &Device, dt: DType, tol: f32) {
    let case = Case {
        b: 2,
        heads: 4,
        groups: 2,
        sq: 37,
        sk: 45,
        d: 32,
        padded: true,
        causal: false,
        dropout: 0.0,
    };
    let want = run(&case, device, dt, |q, k, v, p| unfused(&case, q, k, v, p));
    let [q, k, v, grad] = case.inputs(device, dt);
    let pad = case.padding(device).expect("the case is padded");
    let blocks = [(0, 20), (20, case.sk - 20)];
    let keys = |t: &Tensor<4>, (at, n): (usize, usize)| t.clone().narrow(2, at, n);
    let padding = |(at, n): (usize, usize)| Some(pad.clone().narrow(1, at, n));
    let [(o0, l0), (o1, l1)] = blocks.map(|blk| {
        flash_attention_with_lse(
            q.clone(),
            keys(&k, blk),
            keys(&v, blk),
            padding(blk),
            params(&case),
        )
        .unwrap()
    });
    let max = l0.clone().max_pair(l1.clone());
    let (w0, w1) = ((l0 - max.clone()).exp(), (l1 - max.clone()).exp());
    let lse = max + (w0.clone() + w1.clone()).log();
    let weight = |w: Tensor<3>| (w / (w0.clone() + w1.clone())).unsqueeze_dim::<4>(3);
    let wide = |t: Tensor<4>| t.cast(DType::F32);
    let out = (wide(o0) * weight(w0.clone()) + wide(o1) * weight(w1.clone())).cast(dt);
    let [(dq0, dk0, dv0), (dq1, dk1, dv1)] = blocks.map(|blk| {
        let (out, lse, grad) = (out.clone(), lse.clone(), grad.clone());
        let (k, v) = (keys(&k, blk), keys(&v, blk));
        flash_attention_backward(q.clone(), k, v, padding(blk), out, lse, grad, params(&case))
            .unwrap()
    });
    let got = [
        to_vec(out),
        to_vec(dq0 + dq1),
        to_vec(Tensor::cat(vec![dk0, dk1], 2)),
        to_vec(Tensor::cat(vec![dv0, dv1], 2)),
    ];
    for ((got, want), name) in got.iter().zip(&want).zip(NAMES) {
        let err = relative(got, want);
        assert!(
            err <= tol,
            "{name} ({dt:?}): relative error {err:e} above {tol:e}"
        );
    }
}

#[test]
fn merged_blocks_match_the_unfused_composition_on_flex() {
    merged_blocks_match_the_unfused_composition(&common::flex(), DType::F32, 1e-5);
}

/// The kernels as they are chosen: f32 on the scalar kernels; on CUDA also f16 on the tensor
/// cores (elsewhere f16 would only compile the scalar kernels again, minutes on a cold
/// lavapipe, for the same code).
#[cfg(feature = "cube")]
#[test]
fn merged_blocks_match_the_unfused_composition_on_cube() {
    let device = common::cube_device("merged_blocks_match_the_unfused_composition_on_cube");
    merged_blocks_match_the_unfused_composition(&device, DType::F32, 1e-4);
    if common::on_cuda() {
        merged_blocks_match_the_unfused_composition(&device, DType::F16, 2e-2);
    }
}

/// The backward refuses statistics that do not fit the queries.
#[test]
fn backward_statistics_of_the_wrong_shape_are_refused() {
    let device = Device::flex();
    let t = |h, s| Tensor::<4>::zeros([1, h, s, 8], &device);
    let lse = |s| Tensor::<3>::zeros([1, 2, s], &device);
    let p = AttentionParams::new(0.1);
    let r = flash_attention_backward(t(2, 3), t(1, 4), t(1, 4), None, t(2, 3), lse(4), t(2, 3), p);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    let r = flash_attention_backward(t(2, 3), t(1, 4), t(1, 4), None, t(2, 4), lse(3), t(2, 3), p);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    let half = lse(3).cast(DType::F16);
    let r = flash_attention_backward(t(2, 3), t(1, 4), t(1, 4), None, t(2, 3), half, t(2, 3), p);
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
}

#[test]
fn head_dims_above_the_limit_are_refused() {
    let device = Device::flex();
    let d = FLASH_MAX_HEAD_DIM + 1;
    let t = |h| Tensor::<4>::zeros([1, h, 3, d], &device);
    let r = flash_attention(t(2), t(1), t(1), None, AttentionParams::new(0.1));
    assert!(matches!(r, Err(KernelError::Unsupported(_))), "{r:?}");
    let r = flash_attention(t(2), t(3), t(3), None, AttentionParams::new(0.1));
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
}

/// Head dimensions the tensor-core kernels take (multiples of 16 up to 128), with several
/// column tiles and product steps.
const TENSOR_CORE_CASES: [Case; 3] = [
    Case {
        b: 1,
        heads: 4,
        groups: 2,
        sq: 48,
        sk: 48,
        d: 64,
        padded: true,
        causal: true,
        dropout: 0.1,
    },
    Case {
        b: 2,
        heads: 2,
        groups: 2,
        sq: 40,
        sk: 40,
        d: 32,
        padded: true,
        causal: false,
        dropout: 0.0,
    },
    Case {
        b: 1,
        heads: 2,
        groups: 1,
        sq: 20,
        sk: 50,
        d: 128,
        padded: false,
        causal: true,
        dropout: 0.0,
    },
];

/// The tensor-core kernels against the unfused composition: on CUDA on the matrix
/// instructions (f16 and bf16; they must run there), elsewhere their schedule with emulated
/// products (f16 and f32; wgpu has no bf16), which checks everything but the instructions
/// themselves. The case of head dimension 128 needs more shared memory than lavapipe's 32 KiB
/// and runs the scalar kernels there (counted, and said).
#[cfg(feature = "cube")]
#[test]
fn tensor_core_kernels_match_the_unfused_composition_on_cube() {
    use burn_megatron_kernels::{
        FlashKernels, flash_kernels_on_this_thread, thread_flash_launches,
    };
    let device = common::cube_device("tensor_core_kernels_match_the_unfused_composition_on_cube");
    let cuda = common::on_cuda();
    let (kernels, dtypes): (_, &[(DType, f32)]) = match cuda {
        true => (
            FlashKernels::Auto,
            &[(DType::F16, 2e-2), (DType::BF16, 6e-2)],
        ),
        false => (
            FlashKernels::Emulated,
            &[(DType::F16, 2e-2), (DType::F32, 1e-4)],
        ),
    };
    // This thread only: the flash tests beside this one keep the kernels they chose.
    let _kernels = flash_kernels_on_this_thread(kernels);
    for &(dt, tol) in dtypes {
        let before = thread_flash_launches();
        matches_unfused(&TENSOR_CORE_CASES, &device, dt, tol);
        let after = thread_flash_launches();
        let ran = |f: fn(&burn_megatron_kernels::FlashLaunches) -> u64| f(&after) - f(&before);
        let (tc, emulated, scalar) = (
            ran(|n| n.tensor_cores),
            ran(|n| n.emulated),
            ran(|n| n.scalar),
        );
        eprintln!("flash {dt:?}: {tc} calls on tensor cores, {emulated} emulated, {scalar} scalar");
        match cuda {
            true => assert!(
                tc > 0 && scalar == 0,
                "CUDA left the tensor cores for {dt:?}"
            ),
            false => assert!(emulated > 0, "the emulated schedule did not run for {dt:?}"),
        }
    }
}
