//! FP32 master → bf16 / f16: bit-exact against `half` on special values (normals, ties,
//! subnormals, inf, NaN, overflow) and ~1e5 random bit patterns, widened to f32
//! (`round_to`) and native (`master_to_model`, where the device holds the dtype), on Flex
//! (reference path) and, with a Cube feature (`wgpu` or `cuda`), the CubeCL kernel on the Cube device.

use crate::common;

use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn::tensor::{bf16, f16};
use burn_megatron_kernels::{KernelError, master_to_model, master_to_model_segments, round_to};

/// f32 bit patterns that exercise every branch of both roundings.
fn special_bits() -> Vec<u32> {
    let mut v = vec![
        0x0000_0000,
        0x8000_0000, // ±0
        0x3f80_0000,
        0xbf80_0000, // ±1
        0x7f80_0000,
        0xff80_0000, // ±inf
        0x7fc0_0000,
        0xffc0_0000,
        0x7f80_0001,
        0x7fbf_ffff,
        0x7fff_ffff,
        0xff81_2345, // NaNs
        0x7f7f_ffff,
        0xff7f_ffff, // ±f32::MAX: bf16 and f16 overflow
        0x0000_0001,
        0x8000_0001,
        0x007f_ffff,
        0x0080_0000, // f32 subnormals, min normal
    ];
    // bf16 ties (the dropped half exactly 0x8000) with even and odd kept parts, and one
    // below/above.
    for kept in [0x3f80u32, 0x3f81, 0x4049, 0x7f7f, 0x0001, 0x807f] {
        for low in [0x7fff, 0x8000, 0x8001] {
            v.push((kept << 16) | low);
        }
    }
    // f16 around its edges: 65504, the 65520 tie, min normal 2⁻¹⁴, subnormals down to the
    // 2⁻²⁵ tie and below, and ties in the normal and subnormal ranges.
    for x in [
        65504.0f32,
        65519.996,
        65520.0,
        65536.0,
        6.103_515_6e-5,
        6.103_515e-5,
        5.960_464_5e-8,
        2.980_232_2e-8,
        2.980_232_5e-8,
        2.980_232e-8,
        1e-10,
        1.0 + 0.5 / 1024.0,
        1.0 + 1.5 / 1024.0,
        8.940_697e-8,
        1.490_116_1e-7,
        3.0,
        -3.0e-6,
        1e4,
        -1e5,
    ] {
        v.push(x.to_bits());
        v.push((-x).to_bits());
    }
    // Every f16 subnormal tie: (k + ½)·2⁻²⁴.
    for k in 0..1024u32 {
        v.push(((k as f32 + 0.5) * 5.960_464_5e-8).to_bits());
    }
    v
}

/// `n` pseudo-random f32 bit patterns (every class of value appears).
fn random_bits(n: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 16) as u32
        })
        .collect()
}

/// `half`'s rounding, widened back to f32 bits: what `round_to` must produce.
fn expected_widened(bits: u32, dtype: FloatDType) -> u32 {
    let x = f32::from_bits(bits);
    match dtype {
        FloatDType::BF16 => bf16::from_f32(x).to_f32().to_bits(),
        _ => f16::from_f32(x).to_f32().to_bits(),
    }
}

/// `half`'s 16 result bits.
fn expected_bits(bits: u32, dtype: FloatDType) -> u16 {
    let x = f32::from_bits(bits);
    match dtype {
        FloatDType::BF16 => bf16::from_f32(x).to_bits(),
        _ => f16::from_f32(x).to_bits(),
    }
}

fn master(device: &Device, bits: &[u32]) -> Tensor<1> {
    let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    Tensor::from_data(TensorData::new(values, [bits.len()]), device)
}

/// The first input whose result differs from `half`, as (input bits, got, expected).
fn first_mismatch(inputs: &[u32], got: &[u32], want: impl Fn(u32) -> u32) -> Option<String> {
    assert_eq!(inputs.len(), got.len());
    let bad: Vec<_> = inputs
        .iter()
        .zip(got)
        .filter(|&(&i, &g)| g != want(i))
        .collect();
    bad.first().map(|&(&i, &g)| {
        format!(
            "{} of {} differ; first: input {i:#010x} got {g:#010x} expected {:#010x}",
            bad.len(),
            inputs.len(),
            want(i)
        )
    })
}

fn check(device: &Device, what: &str) {
    let mut inputs = special_bits();
    inputs.extend(random_bits(100_000, 0x9e37_79b9_7f4a_7c15));
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        // Widened: exact equality of bits, NaN payloads included (no tolerance: the
        // rounding is specified bit for bit).
        let out = round_to(master(device, &inputs), dtype).expect("f32 master");
        assert_eq!(out.dtype(), DType::F32);
        let got: Vec<u32> = out.into_data().iter::<f32>().map(f32::to_bits).collect();
        if let Some(m) = first_mismatch(&inputs, &got, |b| expected_widened(b, dtype)) {
            panic!("{what} round_to {dtype:?}: {m}");
        }
        // Native, where the device holds the dtype; a clear error elsewhere.
        match master_to_model(master(device, &inputs), dtype) {
            Ok(model) => {
                assert_eq!(model.dtype(), DType::from(dtype), "{what}");
                let data = model.into_data();
                let got: Vec<u32> = match dtype {
                    FloatDType::BF16 => data.iter::<bf16>().map(|h| h.to_bits().into()).collect(),
                    _ => data.iter::<f16>().map(|h| h.to_bits().into()).collect(),
                };
                // A native store goes through the hardware's f32 → half conversion, and
                // lavapipe's turns every NaN into one canonical NaN: there NaN only has to
                // stay NaN (a marker replaces both sides); every other value must match bit
                // for bit.
                let is_nan = |h: u32| match dtype {
                    FloatDType::BF16 => bf16::from_bits(h as u16).is_nan(),
                    _ => f16::from_bits(h as u16).is_nan(),
                };
                let mark = |h: u32| if is_nan(h) { 0xdead_0000 } else { h };
                let canonical = |b: u32| mark(u32::from(expected_bits(b, dtype)));
                let got: Vec<u32> = got.into_iter().map(mark).collect();
                if let Some(m) = first_mismatch(&inputs, &got, canonical) {
                    panic!("{what} master_to_model {dtype:?}: {m}");
                }
                eprintln!(
                    "{what}: native {dtype:?} bit-exact on {} inputs",
                    inputs.len()
                );
            }
            Err(KernelError::Unsupported(e)) => {
                assert!(
                    !device.supports_dtype(dtype),
                    "{what}: refused {dtype:?}: {e}"
                );
                eprintln!("{what}: native {dtype:?} refused as expected: {e}");
            }
            Err(e) => panic!("{what}: unexpected error {e}"),
        }
    }
    // Empty and odd sizes go through the same paths.
    for n in [0, 1, 3, 37, 1000] {
        let bits = random_bits(n, n as u64 + 1);
        let got: Vec<u32> = round_to(master(device, &bits), FloatDType::BF16)
            .unwrap()
            .into_data()
            .iter::<f32>()
            .map(f32::to_bits)
            .collect();
        assert_eq!(
            first_mismatch(&bits, &got, |b| expected_widened(b, FloatDType::BF16)),
            None
        );
    }
}

#[test]
fn reference_path_is_bit_exact_with_half_on_flex() {
    check(&common::flex(), "flex");
}

#[test]
fn bad_inputs_are_refused_before_any_launch() {
    let device = common::flex();
    let x = master(&device, &[0x3f80_0000]);
    let e = round_to(x.clone(), FloatDType::F64).unwrap_err();
    assert!(matches!(e, KernelError::Argument(_)), "{e}");
    let e = round_to(x.clone().cast(DType::F16), FloatDType::BF16).unwrap_err();
    assert!(matches!(e, KernelError::Argument(_)), "{e}");
    let e = master_to_model_segments(x, &[2], FloatDType::BF16).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)), "{e}");
}

#[test]
fn segments_are_views_of_one_cast() {
    let device = common::flex();
    let bits = random_bits(10, 7);
    let parts = master_to_model_segments(master(&device, &bits), &[3, 0, 7], FloatDType::BF16)
        .expect("lengths match");
    let sizes: Vec<usize> = parts.iter().map(|p| p.dims()[0]).collect();
    assert_eq!(sizes, [3, 0, 7]);
    let got: Vec<u32> = Tensor::cat(parts, 0)
        .into_data()
        .iter::<bf16>()
        .map(|h| h.to_bits().into())
        .collect();
    let want = |b| u32::from(expected_bits(b, FloatDType::BF16));
    assert_eq!(first_mismatch(&bits, &got, want), None);
}

#[cfg(feature = "cube")]
#[test]
fn kernel_is_bit_exact_with_half_on_cube() {
    let device = common::cube_device("cast");
    check(&device, "cube");
}
