//! The 2-d GEMMs of the linear layers on Burn's CUDA tensors, by cuBLASLt (through cudarc),
//! queued between CubeCL's kernels by [`super::order`].
//!
//! cubek's matmul ran the GPT step's GEMMs at a ninth of cuBLAS's rate on an H200 (one
//! strategy for every shape, no Hopper warpgroup MMA). cuBLASLt picks a kernel per shape by
//! its heuristic, once per shape and layout (the plans are kept per thread).
//!
//! Burn's tensors are row-major and cuBLAS's column-major: `c = a·b` is computed as
//! `cᵀ = bᵀ·aᵀ`, each operand read in place, a transposed view as a transposed operand.
//! f32 stays IEEE f32 (`CUBLAS_COMPUTE_32F`) unless [`TF32_VAR`] asks for TF32 tensor cores
//! (inputs rounded to 10 mantissa bits, sums in f32); f16 and bf16 multiply and accumulate
//! in f32 (a split-K kernel may add its partial sums in the output's dtype, as PyTorch's
//! default allows too).

use super::order::{CudaServer, StreamOrder, on_our_stream};
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::RuntimeId;
use cudarc::cublaslt::{result, sys};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

mod plan;
use plan::{Key, Plan, blas_error};

/// The variable choosing the GEMM engine on CUDA: `cublaslt` (the default, where the library
/// loads) or `cubecl` (cubek's matmul, as Burn runs it).
pub const GEMM_VAR: &str = "BURN_MEGATRON_GEMM";
/// Set to `1`, f32 GEMMs run on TF32 tensor cores (each input rounded to a 10-bit mantissa,
/// about 1e-3 relative per product instead of 1e-7), as PyTorch's `allow_tf32` does.
pub const TF32_VAR: &str = "BURN_MEGATRON_ALLOW_TF32";

/// Whether [`TF32_VAR`] asks for TF32 (read once per process).
fn tf32() -> bool {
    static TF32: OnceLock<bool> = OnceLock::new();
    *TF32.get_or_init(|| std::env::var(TF32_VAR).is_ok_and(|v| v == "1"))
}

/// Which engine runs the linear layers' GEMMs on CUDA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GemmEngine {
    /// cuBLASLt.
    CublasLt,
    /// cubek's matmul; the reason cuBLASLt is not used.
    Cubecl(String),
}

/// 0: as [`GEMM_VAR`] says; 1: cuBLASLt where it loads; 2: cubek.
static OVERRIDE: AtomicU8 = AtomicU8::new(0);

/// Overrides [`GEMM_VAR`] for the rest of the process (`None`: back to it), so that a
/// benchmark compares the engines in one process: `Some(true)` cuBLASLt where it loads,
/// `Some(false)` cubek.
pub fn set_cublaslt(choice: Option<bool>) {
    OVERRIDE.store(
        match choice {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        },
        Ordering::Relaxed,
    );
}

/// The engine in use: [`set_cublaslt`]'s choice, else [`GEMM_VAR`]'s (read once), cuBLASLt
/// only where the library loads.
pub fn gemm_engine() -> GemmEngine {
    engine().clone()
}

/// [`gemm_engine`] without a copy: read on every GEMM.
fn engine() -> &'static GemmEngine {
    static LOADS: OnceLock<bool> = OnceLock::new();
    static MISSING: OnceLock<GemmEngine> = OnceLock::new();
    static OVERRIDDEN: OnceLock<GemmEngine> = OnceLock::new();
    static FROM_ENV: OnceLock<GemmEngine> = OnceLock::new();
    // SAFETY: loads and unloads the library; its initialisers need nothing.
    let loads = || *LOADS.get_or_init(|| unsafe { sys::is_culib_present() });
    let missing = || {
        MISSING.get_or_init(|| {
            GemmEngine::Cubecl(
                "libcublasLt could not be loaded (put the directory holding libcublasLt.so.13 \
                 or .12 on LD_LIBRARY_PATH)"
                    .into(),
            )
        })
    };
    match OVERRIDE.load(Ordering::Relaxed) {
        1 if loads() => return &GemmEngine::CublasLt,
        1 => return missing(),
        2 => {
            return OVERRIDDEN
                .get_or_init(|| GemmEngine::Cubecl("set_cublaslt(Some(false))".into()));
        }
        _ => {}
    }
    FROM_ENV.get_or_init(|| match std::env::var(GEMM_VAR).as_deref() {
        Ok("cubecl") => GemmEngine::Cubecl(format!("{GEMM_VAR}=cubecl")),
        Err(_) | Ok("") | Ok("cublaslt") if loads() => GemmEngine::CublasLt,
        Err(_) | Ok("") | Ok("cublaslt") => missing().clone(),
        Ok(other) => {
            GemmEngine::Cubecl(format!("{GEMM_VAR}={other} is not `cublaslt` or `cubecl`"))
        }
    })
}

/// GEMMs run by cuBLASLt so far, and those it failed and cubek ran instead.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GemmStats {
    /// Run by cuBLASLt.
    pub cublaslt: u64,
    /// Failed in cuBLASLt and run by cubek.
    pub fallbacks: u64,
    /// Why the first fallback happened.
    pub first_failure: Option<String>,
    /// Of those run by cuBLASLt, the ones that added their product to an f32 matrix in
    /// place (nothing else held it), writing no new one.
    pub accumulated_in_place: u64,
}

static RUN: AtomicU64 = AtomicU64::new(0);
static IN_PLACE: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
static FIRST_FAILURE: Mutex<Option<String>> = Mutex::new(None);

/// The counts so far in this process.
pub fn gemm_stats() -> GemmStats {
    GemmStats {
        cublaslt: RUN.load(Ordering::Relaxed),
        fallbacks: FALLBACKS.load(Ordering::Relaxed),
        first_failure: FIRST_FAILURE.lock().map(|f| f.clone()).unwrap_or(None),
        accumulated_in_place: IN_PLACE.load(Ordering::Relaxed),
    }
}

/// `a·b` (`a` `[..., m, k]`, `b` `[..., k, n]` with the same leading batch dims, one of f32,
/// f16, bf16), plus `acc` (2-d only: f32 `[m, n]`, the output then f32) by cuBLASLt, when the
/// tensors are CUDA's and the engine is cuBLASLt; `None` leaves it to the caller's matmul (a
/// failure is counted in [`gemm_stats`]). A contiguous `acc` that only the caller holds is
/// the output itself (cuBLASLt's in-place `C = D`): Megatron's main gradient grows where it
/// lies, with no second copy of it while the GEMM runs.
pub(crate) fn try_matmul(
    a: &CubeTensor,
    b: &CubeTensor,
    acc: Option<&CubeTensor>,
) -> Option<CubeTensor> {
    try_gemm(a, b, acc, false)
}

/// [`try_matmul`] of `a` and `b` into a new f32 output whatever their dtype (a weight
/// gradient's first micro-batch: no zeros to add to).
pub(crate) fn try_matmul_f32(a: &CubeTensor, b: &CubeTensor) -> Option<CubeTensor> {
    try_gemm(a, b, None, true)
}

fn try_gemm(
    a: &CubeTensor,
    b: &CubeTensor,
    acc: Option<&CubeTensor>,
    f32_out: bool,
) -> Option<CubeTensor> {
    let applies = a.device.runtime() == RuntimeId::Cuda
        && b.device == a.device
        && acc.is_none_or(|c| c.device == a.device)
        && a.dtype == b.dtype
        && matches!(a.dtype, DType::F32 | DType::F16 | DType::BF16)
        && acc.is_none_or(|c| c.dtype == DType::F32 && c.meta.shape().num_dims() == 2)
        && a.meta.shape().num_dims() >= 2
        && b.meta.shape().num_dims() == a.meta.shape().num_dims()
        && batch_dims(a) == batch_dims(b)
        && (acc.is_none() || a.meta.shape().num_dims() == 2)
        && a.meta.shape().num_elements() > 0
        && b.meta.shape().num_elements() > 0
        && *engine() == GemmEngine::CublasLt;
    if !applies {
        return None;
    }
    match matmul(a, b, acc, f32_out) {
        Ok(out) => {
            RUN.fetch_add(1, Ordering::Relaxed);
            Some(out)
        }
        Err(why) => {
            FALLBACKS.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut first) = FIRST_FAILURE.lock() {
                first.get_or_insert(why);
            }
            None
        }
    }
}

/// How cuBLASLt reads a row-major `[r, c]` matrix of Burn's as the column-major operand
/// `tᵀ` `[c, r]`: a row-major tensor is `tᵀ` as stored (op N), a transposed view is `t`
/// column-major (op T); a batch of them lies `batch_stride` elements apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Operand {
    pub(super) trans: bool,
    pub(super) rows: u64,
    pub(super) cols: u64,
    pub(super) ld: i64,
    pub(super) batch_stride: i64,
}

/// The leading (batch) dims of `t`: all but the last two.
fn batch_dims(t: &CubeTensor) -> Vec<usize> {
    let dims = t.meta.shape();
    dims[..dims.len().saturating_sub(2)].to_vec()
}

/// The batch of `t` as one run of matrices `stride` elements apart (its dims flattened in
/// order), or `None` when its strides do not flatten so.
fn batch_of(t: &CubeTensor) -> Option<(usize, usize)> {
    let (dims, strides) = (t.meta.shape(), t.meta.strides());
    let (mut count, mut stride) = (1usize, None::<usize>);
    for i in (0..dims.len() - 2).rev() {
        if dims[i] == 1 {
            continue;
        }
        match stride {
            None => stride = Some(strides[i]),
            Some(s) if strides[i] != s * count => return None,
            Some(_) => {}
        }
        count *= dims[i];
    }
    match stride {
        Some(0) if count > 1 => None,
        s => Some((count, s.unwrap_or(0))),
    }
}

fn operand(t: &CubeTensor) -> Option<Operand> {
    if t.meta.is_tiled() {
        return None;
    }
    let (_, batch_stride) = batch_of(t)?;
    let (dims, strides) = (t.meta.shape(), t.meta.strides());
    let n = dims.len();
    let (r, c, s0, s1) = (dims[n - 2], dims[n - 1], strides[n - 2], strides[n - 1]);
    let op = |trans, rows: usize, cols: usize, ld: usize| Operand {
        trans,
        rows: rows as u64,
        cols: cols as u64,
        ld: ld as i64,
        batch_stride: batch_stride as i64,
    };
    if (c == 1 || s1 == 1) && (r == 1 || s0 >= c) {
        return Some(op(false, c, r, if r == 1 { c } else { s0 }));
    }
    if (r == 1 || s0 == 1) && (c == 1 || s1 >= r) {
        return Some(op(true, r, c, if c == 1 { r } else { s1 }));
    }
    None
}

/// `t` as an operand, copied contiguous first when its strides are neither layout.
fn readable(t: &CubeTensor) -> Result<(CubeTensor, Operand), String> {
    if let Some(op) = operand(t) {
        return Ok((t.clone(), op));
    }
    let t = into_contiguous(t.clone());
    // A contiguous tensor is row-major matrices in a run; were it not, Burn's matmul runs.
    let op = operand(&t).ok_or("a contiguous copy is not a run of row-major matrices")?;
    Ok((t, op))
}

/// The largest power of two up to 256 dividing `ptr` (cuBLASLt's heuristic assumes 256 unless
/// told, and may pick a kernel whose vector loads need it).
fn alignment(ptr: u64) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

/// One thread's cuBLASLt state on one device: the handle, a workspace, the plans.
struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    /// The device's SMs (0 if the driver did not say).
    sms: i32,
    plans: HashMap<Key, Plan>,
}

/// The SMs a GEMM may use when its streams are ordered on the device: all but one. There,
/// CubeCL's stream waits for the GEMM with a one-thread polling kernel that starts with the
/// GEMM and holds a block slot on some SM until it ends; cuBLASLt's Hopper kernels are mostly
/// persistent, one block per SM with nearly all its shared memory, and the block that lands
/// on that SM would start only when another finishes (up to twice the time). Leaving one SM
/// to the poller costs 1/SMs of the GEMM's peak (PyTorch's `sm_carveout` does the same for
/// NCCL's kernels). Host order has no poller and gets every SM.
fn carve_out(sms: i32, order: StreamOrder) -> i32 {
    match order {
        StreamOrder::Device if sms > 1 => sms - 1,
        _ => 0,
    }
}

/// Hopper wants 32 MiB (NVIDIA's advice for cuBLASLt); earlier GPUs 4.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Plans kept per thread; past it they are dropped and made again (shapes that vary every
/// step, say).
const MAX_PLANS: usize = 4096;

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: made in `with_blas`, released once here.
        unsafe {
            let _ = result::destroy_handle(self.handle);
            let _ = cudarc::driver::result::free_sync(self.workspace);
        }
    }
}

thread_local! {
    /// This thread's cuBLASLt state per device, or why it could not be made (kept, so that
    /// every later GEMM falls back at once rather than trying again).
    static BLAS: RefCell<HashMap<u16, Result<Blas, String>>> = RefCell::new(HashMap::new());
    /// Problems cuBLASLt's heuristic had no kernel for on this thread (their keys without
    /// the SM target): cubek runs them without asking again, and without ordering streams
    /// for a GEMM that will not run.
    static NO_PLAN: RefCell<HashSet<Key>> = RefCell::new(HashSet::new());
}

/// Runs `f` with this thread's cuBLASLt state for `device` (its context current).
fn with_blas<R>(device: u16, f: impl FnOnce(&mut Blas) -> Result<R, String>) -> Result<R, String> {
    BLAS.with(|all| {
        let mut all = all.borrow_mut();
        let made = all.entry(device).or_insert_with(|| {
            // Said once: every later GEMM of this thread goes to cubek without a word.
            Blas::new(device).inspect_err(|why| {
                eprintln!(
                    "burn-megatron: warning: cuBLASLt on CUDA device {device}: {why}; this \
                     thread's GEMMs run on cubek"
                )
            })
        });
        match made {
            Ok(blas) => f(blas),
            Err(why) => Err(why.clone()),
        }
    })
}

impl Blas {
    fn new(device: u16) -> Result<Self, String> {
        let handle = result::create_handle().map_err(blas_error("handle"))?;
        // SAFETY: the device's context is current (see `on_our_stream`).
        let workspace = match unsafe { cudarc::driver::result::malloc_sync(WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: made above, released once here.
                let _ = unsafe { result::destroy_handle(handle) };
                return Err(format!("cuBLASLt workspace: {e:?}"));
            }
        };
        let sms = cudarc::driver::result::device::get(i32::from(device))
            .and_then(|d| {
                // SAFETY: a device the driver returned.
                unsafe {
                    cudarc::driver::result::device::get_attribute(
                        d,
                        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    )
                }
            })
            .unwrap_or(0);
        Ok(Blas {
            handle,
            workspace,
            workspace_bytes: WORKSPACE_BYTES,
            sms,
            plans: HashMap::new(),
        })
    }
}

fn matmul(
    a: &CubeTensor,
    b: &CubeTensor,
    acc: Option<&CubeTensor>,
    f32_out: bool,
) -> Result<CubeTensor, String> {
    let rank = a.meta.shape().num_dims();
    let (m, k) = (a.meta.shape()[rank - 2], a.meta.shape()[rank - 1]);
    let n = b.meta.shape()[rank - 1];
    let batch: usize = batch_dims(a).iter().product();
    if b.meta.shape()[rank - 2] != k || acc.is_some_and(|c| c.meta.shape().to_vec() != [m, n]) {
        return Err(format!(
            "shapes do not fit: a {:?}, b {:?}",
            a.meta.shape(),
            b.meta.shape()
        ));
    }
    // Before `readable`, whose clone would hold it too.
    let acc_unique = acc.is_some_and(CubeTensor::can_mut);
    let (a, a_op) = readable(a)?;
    let (b, b_op) = readable(b)?;
    let acc = acc.map(readable).transpose()?;
    if acc.as_ref().is_some_and(|(_, op)| op.trans) {
        return Err("the accumulated matrix is a transposed view".into());
    }
    let output = if acc.is_some() || f32_out {
        DType::F32
    } else {
        a.dtype
    };
    // D is C when only the caller holds C and C is laid out as D would be (row-major
    // [m, n], cuBLASLt's `Cdesc == Ddesc`, which in-place GEMMs need).
    let d_layout = Operand {
        trans: false,
        rows: n as u64,
        cols: m as u64,
        ld: n as i64,
        batch_stride: 0,
    };
    let in_place = acc_unique && acc.as_ref().is_some_and(|(_, op)| *op == d_layout);
    let out = match &acc {
        Some((c, _)) if in_place => c.clone(),
        _ => {
            let mut dims = batch_dims(&a);
            dims.extend([m, n]);
            empty_device_contiguous_dtype(a.client.clone(), a.device.clone(), dims.into(), output)
        }
    };
    let resource = |t: &CubeTensor| {
        t.client
            .get_resource::<CudaServer>(t.handle.clone())
            .map_err(|e| format!("device address: {e:?}"))
    };
    // Held until the GEMM is queued; CubeCL reuses the memory only for work queued after it.
    let (ra, rb, rd) = (resource(&a)?, resource(&b)?, resource(&out)?);
    let rc = acc.as_ref().map(|(c, _)| resource(c)).transpose()?;
    let (pa, pb, pd) = (ra.resource().ptr, rb.resource().ptr, rd.resource().ptr);
    let pc = rc.as_ref().map(|r| r.resource().ptr);
    // cᵀ [n, m] = bᵀ [n, k] · aᵀ [k, m]: cuBLASLt's A is our b, its B our a.
    let key = Key {
        inputs: a.dtype,
        output,
        a: b_op,
        b: a_op,
        c: acc.as_ref().map(|(_, op)| *op),
        m: n as u64,
        n: m as u64,
        k: k as u64,
        ldd: n as i64,
        batch,
        align: [
            alignment(pb),
            alignment(pa),
            alignment(pc.unwrap_or(pd)),
            alignment(pd),
        ],
        tf32: tf32(),
        sms: 0,
    };
    if NO_PLAN.with(|failed| failed.borrow().contains(&key)) {
        return Err("cuBLASLt's heuristic had no kernel for this problem (asked once)".into());
    }
    let device = a.device.to_id().index_id;
    let queued = std::cell::Cell::new(false);
    let ran = on_our_stream(&a, |stream, order| {
        with_blas(device, |blas| {
            let key = Key {
                sms: carve_out(blas.sms, order),
                ..key
            };
            if blas.plans.len() >= MAX_PLANS {
                blas.plans.clear();
            }
            if !blas.plans.contains_key(&key) {
                let plan = Plan::new(blas.handle, &key, blas.workspace_bytes)
                    // No kernel for the carve-out: every SM then (host order's plan).
                    .or_else(|why| match key.sms {
                        0 => Err(why),
                        _ => Plan::new(blas.handle, &Key { sms: 0, ..key }, blas.workspace_bytes),
                    })
                    .inspect_err(|_| {
                        NO_PLAN.with(|failed| {
                            let mut failed = failed.borrow_mut();
                            if failed.len() >= MAX_PLANS {
                                failed.clear();
                            }
                            failed.insert(Key { sms: 0, ..key });
                        })
                    })?;
                blas.plans.insert(key, plan);
            }
            let plan = &blas.plans[&key];
            let (alpha, beta) = (1.0f32, if pc.is_some() { 1.0f32 } else { 0.0 });
            let pc = pc.unwrap_or(pd);
            // SAFETY: the addresses are live allocations on this device holding the
            // layouts' elements (held above), ordered after their producers and before
            // their consumers by `on_our_stream`; the plan was made for these layouts.
            unsafe {
                result::matmul(
                    blas.handle,
                    plan.desc,
                    (&alpha as *const f32).cast(),
                    (&beta as *const f32).cast(),
                    pb as *const _,
                    plan.layouts[0],
                    pa as *const _,
                    plan.layouts[1],
                    pc as *const _,
                    plan.layouts[2],
                    pd as *mut _,
                    plan.layouts[3],
                    &plan.algo,
                    blas.workspace as *mut _,
                    blas.workspace_bytes,
                    stream.cu_stream() as _,
                )
                .map_err(blas_error("matmul"))
                .map(|()| queued.set(true))
            }
        })
    });
    drop((ra, rb, rc, rd));
    match ran {
        Ok(()) => {}
        // The product is in the accumulator already, and complete (`on_our_stream` drained
        // our stream on that failure): Burn's matmul would add it a second time.
        Err(why) if queued.get() && in_place => {
            eprintln!("burn-megatron: warning: ordering cuBLASLt's stream after a GEMM: {why}");
        }
        Err(why) => return Err(why),
    }
    if in_place {
        IN_PLACE.fetch_add(1, Ordering::Relaxed);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1010), 16);
    }
}
