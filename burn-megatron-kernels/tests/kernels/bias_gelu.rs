//! Bias + GeLU (erf and tanh forms) against exact f64 values (forward, input and bias
//! gradients) and against Burn's own composition (forward), on Flex (reference path) and,
//! with a Cube feature (`wgpu` or `cuda`), the CubeCL kernel on the Cube device.

use crate::common;

use burn::tensor::activation::{gelu, gelu_approximate};
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron_kernels::{Gelu, bias_gelu};
use common::{max_abs_diff, to_vec, values};

/// Shapes as [rows, cols] (cols = bias size): a single element, sizes that are not
/// multiples of a cube, an empty tensor, and a long row.
const SHAPES: [[usize; 2]; 5] = [[1, 1], [3, 5], [37, 33], [0, 4], [4, 1000]];

/// (gelu(v), gelu'(v)) in f64.
fn exact_gelu(v: f64, form: Gelu) -> (f64, f64) {
    match form {
        Gelu::Erf => {
            let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (v * cdf, cdf + v * pdf)
        }
        Gelu::Tanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            let t = (k * (v + 0.044715 * v * v * v)).tanh();
            let d_inner = k * (1.0 + 3.0 * 0.044715 * v * v);
            (
                0.5 * v * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * d_inner,
            )
        }
    }
}

/// Exact values in f64 on the host: (gelu(x + b), grad x, grad b) for output gradient g.
fn exact(x: &[f32], b: &[f32], g: &[f32], form: Gelu) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let c = b.len();
    let (mut y, mut gx, mut gb) = (vec![], vec![], vec![0.0f64; c]);
    for (i, (&xi, &gi)) in x.iter().zip(g).enumerate() {
        let (value, slope) = exact_gelu(f64::from(xi) + f64::from(b[i % c]), form);
        y.push(value as f32);
        let d = f64::from(gi) * slope;
        gx.push(d as f32);
        gb[i % c] += d;
    }
    (y, gx, gb.into_iter().map(|v| v as f32).collect())
}

/// The fused op on `device` against exact host values: (max |Δ| forward, grad x, grad bias),
/// plus max |Δ| of the forward against Burn's own composition on the same device.
fn against_exact(device: &Device, shape: [usize; 2], scale: f32, form: Gelu) -> [f32; 4] {
    let [r, c] = shape;
    let (xv, bv, gv) = (
        values(r * c, 1, scale),
        values(c, 2, scale),
        values(r * c, 3, 1.0),
    );
    let (y_ref, gx_ref, gb_ref) = exact(&xv, &bv, &gv, form);
    let x = Tensor::<2>::from_data(TensorData::new(xv, shape), device).require_grad();
    let b = Tensor::<1>::from_data(TensorData::new(bv, [c]), device).require_grad();
    let g = Tensor::<2>::from_data(TensorData::new(gv, shape), device);
    let y = bias_gelu(x.clone(), b.clone(), form);
    // Burn 0.22.1's own unary kernels panic on empty Cube tensors (burn-cubecl
    // `is_nonoverlapping` underflows), so the composition is only compared when non-empty.
    let composed = (r * c > 0).then(|| {
        let v = x.clone().detach() + b.clone().detach().unsqueeze();
        match form {
            Gelu::Erf => gelu(v),
            Gelu::Tanh => gelu_approximate(v),
        }
    });
    let grads = (y.clone() * g).sum().backward();
    let gx = Tensor::<2>::from_inner(x.grad(&grads).expect("x is tracked"));
    let gb = Tensor::<1>::from_inner(b.grad(&grads).expect("bias is tracked"));
    let y = to_vec(y.detach());
    [
        max_abs_diff(&y, &y_ref),
        max_abs_diff(&to_vec(gx), &gx_ref),
        max_abs_diff(&to_vec(gb), &gb_ref),
        composed.map_or(0.0, |composed| max_abs_diff(&y, &to_vec(composed))),
    ]
}

fn check(device: &Device, what: &str) {
    for form in [Gelu::Erf, Gelu::Tanh] {
        for shape in SHAPES {
            for scale in [3.0, 30.0] {
                let [y, gx, gb, composed] = against_exact(device, shape, scale, form);
                // f32 rounding of values up to 2·scale, erf/tanh fits of |error| < 1.5e-7,
                // and bias gradients summed over up to 37 rows.
                let tol = 1e-6 * scale;
                let what = format!(
                    "{what} {form:?} {shape:?} ×{scale}: y {y} gx {gx} gb {gb} vs-composed {composed}"
                );
                assert!(
                    y <= tol && composed <= tol && gx <= 2e-6 && gb <= 2e-5,
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn reference_path_matches_exact_values_on_flex() {
    check(&common::flex(), "flex");
}

#[cfg(feature = "cube")]
#[test]
fn kernel_matches_exact_values_and_burns_composition_on_cube() {
    let device = common::cube_device("bias_gelu");
    check(&device, "cube");
}
