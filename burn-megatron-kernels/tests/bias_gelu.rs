//! Bias + GeLU against exact f64 values (forward, input and bias gradients) and against
//! Burn's own composition (forward), on
//! Flex (reference path) and, with feature `wgpu`, the CubeCL kernel on wgpu (lavapipe).

use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor, TensorData};
use burn_megatron_kernels::bias_gelu;

/// Deterministic values in [-scale, scale].
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn max_diff(a: Tensor<2>, b: Tensor<2>) -> f32 {
    let a: Vec<f32> = a.into_data().iter::<f32>().collect();
    let b: Vec<f32> = b.into_data().iter::<f32>().collect();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Shapes as [rows, cols] (cols = bias size): a single element, sizes that are not
/// multiples of a cube, an empty tensor, and a long row.
const SHAPES: [[usize; 2]; 5] = [[1, 1], [3, 5], [37, 33], [0, 4], [4, 1000]];

/// Exact values in f64 on the host: (gelu(x + b), grad x, grad b) for output gradient g.
fn exact(x: &[f32], b: &[f32], g: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let c = b.len();
    let (mut y, mut gx, mut gb) = (vec![], vec![], vec![0.0f64; c]);
    for (i, (&xi, &gi)) in x.iter().zip(g).enumerate() {
        let v = f64::from(xi) + f64::from(b[i % c]);
        let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
        let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
        y.push((v * cdf) as f32);
        let d = f64::from(gi) * (cdf + v * pdf);
        gx.push(d as f32);
        gb[i % c] += d;
    }
    (y, gx, gb.into_iter().map(|v| v as f32).collect())
}

fn diff(a: Tensor<2>, b: &[f32]) -> f32 {
    let a: Vec<f32> = a.into_data().iter::<f32>().collect();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The fused op on `device` against exact host values: (max |Δ| forward, grad x, grad bias),
/// plus max |Δ| of the forward against Burn's own composition on the same device.
fn against_exact(device: &Device, shape: [usize; 2], scale: f32) -> (f32, f32, f32, f32) {
    let [r, c] = shape;
    let (xv, bv, gv) = (
        values(r * c, 1, scale),
        values(c, 2, scale),
        values(r * c, 3, 1.0),
    );
    let (y_ref, gx_ref, gb_ref) = exact(&xv, &bv, &gv);
    let x = Tensor::<2>::from_data(TensorData::new(xv, shape), device).require_grad();
    let b = Tensor::<1>::from_data(TensorData::new(bv, [c]), device).require_grad();
    let g = Tensor::<2>::from_data(TensorData::new(gv, shape), device);
    let y = bias_gelu(x.clone(), b.clone());
    // Burn 0.22.1's own unary kernels panic on empty Cube tensors (burn-cubecl
    // `is_nonoverlapping` underflows), so the composition is only compared when non-empty.
    let composed = (r * c > 0).then(|| gelu(x.clone().detach() + b.clone().detach().unsqueeze()));
    let grads = (y.clone() * g).sum().backward();
    let gx = Tensor::<2>::from_inner(x.grad(&grads).expect("x is tracked"));
    let gb = Tensor::<1>::from_inner(b.grad(&grads).expect("bias is tracked")).unsqueeze::<2>();
    (
        diff(y.clone().detach(), &y_ref),
        diff(gx, &gx_ref),
        diff(gb, &gb_ref),
        composed.map_or(0.0, |composed| max_diff(y.detach(), composed)),
    )
}

fn check(device: &Device, what: &str) {
    for shape in SHAPES {
        for scale in [3.0, 30.0] {
            let (y, gx, gb, composed) = against_exact(device, shape, scale);
            // f32 rounding of values up to 2·scale, erf fits of |error| < 1.5e-7, and bias
            // gradients summed over up to 37 rows.
            let tol = 1e-6 * scale;
            let what =
                format!("{what} {shape:?} ×{scale}: y {y} gx {gx} gb {gb} vs-composed {composed}");
            assert!(
                y <= tol && composed <= tol && gx <= 2e-6 && gb <= 2e-5,
                "{what}"
            );
        }
    }
}

#[test]
fn reference_path_matches_exact_values_on_flex() {
    check(&Device::flex().autodiff(), "flex");
}

#[cfg(feature = "wgpu")]
#[test]
fn kernel_matches_exact_values_and_burns_composition_on_wgpu() {
    let device = match burn_megatron_kernels::device::wgpu_cpu_device() {
        Ok(d) => d,
        Err(e) if std::env::var("BURN_MEGATRON_REQUIRE_WGPU").as_deref() != Ok("1") => {
            eprintln!("\n!!! SKIPPED: no wgpu adapter ({e}); install mesa-vulkan-drivers !!!\n");
            return;
        }
        Err(e) => panic!("BURN_MEGATRON_REQUIRE_WGPU=1 but no wgpu adapter: {e}"),
    };
    check(&device.autodiff(), "wgpu");
}
