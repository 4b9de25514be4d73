//! The flash kernels' CUDA C++ for an H100/H200-class device (sm_90), made without a GPU:
//! each kernel is expanded as a launch would expand it, with the device properties CubeCL's
//! CUDA runtime reads from such a card, and handed to the CUDA C++ compiler that runtime
//! uses. What a machine with NVRTC (a CUDA toolkit, or PyTorch's `nvidia-cuda-nvrtc` wheel)
//! and no GPU can then check: that every kernel compiles for the card, and what ptxas says of
//! its registers and spills.

use super::FLASH_QUERY_BLOCK;
use super::cube::{AttnLaunch, flash_dkv_kernel, flash_dq_kernel, flash_forward_kernel};
use super::tensor_core::{flash_tc_dkv_kernel, flash_tc_dq_kernel, flash_tc_forward_kernel};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use cubecl::cuda::{CudaCompilationOptions, CudaCompiler, CudaRuntime};
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{
    DeviceIdentity, DeviceProperties, HardwareProperties, MemoryDeviceProperties, VectorSize,
    features::Plane,
};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::zspace::{Shape, Strides};
use cubecl_common::device::{DeviceId, ServiceId};
use cubecl_common::profile::TimingMethod;
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaCmmaCompiler;
use cubecl_cpp::register_supported_types;
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures, register_wmma_features};
use cubecl_environment::stream::StreamId;
use cubecl_runtime::compiler::Compiler;
use cubecl_runtime::kernel::CubeKernel;
use cubecl_runtime::runtime::Runtime;
use std::sync::Arc;

/// One kernel's CUDA C++.
#[derive(Clone, Debug)]
pub struct FlashSource {
    /// Which kernel and variant.
    pub name: String,
    /// The source, as NVRTC would receive it.
    pub source: String,
}

/// An sm_90 card as CubeCL's CUDA runtime describes it: 32-wide warps, 227 KiB of opt-in
/// shared memory, WMMA for f16/bf16/tf32.
fn sm90() -> (DeviceProperties, CompilationOptions) {
    let arch = CudaArchitecture {
        version: 90,
        tensor_cores: true,
    };
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: 227 << 10,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Default::default(),
        MemoryDeviceProperties::new(1 << 30, 512),
        hardware,
        TimingMethod::Device,
        DeviceIdentity {
            name: "sm_90 (described, no device)".into(),
            fingerprint: "ptx_sm90".into(),
            physical: None,
        },
    );
    register_supported_types(&mut props);
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::Sync);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    register_wmma_features(
        CudaCmmaCompiler::Cpp.supported_cmma_combinations(&arch),
        &mut props,
    );
    let options = CompilationOptions {
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: true,
            ..Default::default()
        },
        ..Default::default()
    };
    (props, options)
}

/// The flash kernels' CUDA C++ for `dtype` inputs of head dimension `head_dim` (a causal,
/// padded, dropout variant of each): the scalar kernels, and the tensor-core ones where they
/// take `dtype` and `head_dim`.
///
/// # Errors
///
/// A kernel that does not expand or does not translate, with the compiler's words.
pub fn flash_cuda_sources(dtype: DType, head_dim: usize) -> Result<Vec<FlashSource>, String> {
    let (props, options) = sm90();
    let props = Arc::new(props);
    let target = Arc::new(<CudaRuntime as Runtime>::target_properties());
    let service = ServiceId::of::<()>(DeviceId {
        type_id: 0,
        index_id: 0,
    });
    let arg = |dims: &[usize]| {
        let strides: Vec<usize> = (0..dims.len())
            .map(|i| dims[i + 1..].iter().product())
            .collect();
        let handle = Handle::new(service, StreamId::current(), 4);
        // SAFETY: the argument is only registered for the kernel's expansion, never launched.
        unsafe { TensorArg::from_raw_parts(handle, Strides::new(&strides), Shape::from(dims)) }
    };
    let d = head_dim;
    let (q, kv, rows, pad) = ([2, 4, 64, d], [2, 2, 64, d], [2, 4, 64], [2, 64]);
    let attn = |tile: u32| AttnLaunch::new(4, 2, 64, 64, 0.1, 1, 2, 3, 1.1, tile);
    let types = [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(DType::U8),
    ];
    let count = || CubeCount::Static(2, 4, 2);
    let (props_, target_) = (|| props.clone(), || target.clone());
    let mut kernels: Vec<(String, Box<dyn CubeKernel>)> = Vec::new();
    let tile = 16usize;
    let units = CubeDim::new_1d(FLASH_QUERY_BLOCK as u32);
    kernels.push((
        "scalar forward".into(),
        Box::new(flash_forward_kernel::create_dummy_kernel(
            props_(),
            target_(),
            count(),
            units,
            arg(&q),
            arg(&kv),
            arg(&kv),
            arg(&pad),
            arg(&q),
            arg(&rows),
            attn(tile as u32),
            d,
            tile,
            true,
            true,
            true,
            types,
        )),
    ));
    kernels.push((
        "scalar dq".into(),
        Box::new(flash_dq_kernel::create_dummy_kernel(
            props_(),
            target_(),
            count(),
            units,
            arg(&q),
            arg(&kv),
            arg(&kv),
            arg(&pad),
            arg(&q),
            arg(&q),
            arg(&rows),
            arg(&q),
            arg(&rows),
            attn(tile as u32),
            d,
            tile,
            true,
            true,
            true,
            types,
        )),
    ));
    kernels.push((
        "scalar dk dv".into(),
        Box::new(flash_dkv_kernel::create_dummy_kernel(
            props_(),
            target_(),
            count(),
            units,
            arg(&q),
            arg(&kv),
            arg(&kv),
            arg(&pad),
            arg(&q),
            arg(&rows),
            arg(&rows),
            arg(&kv),
            arg(&kv),
            attn(tile as u32),
            d,
            tile,
            true,
            true,
            true,
            types,
        )),
    ));
    if matches!(dtype, DType::F16 | DType::BF16) && d.is_multiple_of(16) && d <= 128 {
        let planes = CubeDim::new_2d(32, 4);
        kernels.push((
            "tensor-core forward".into(),
            Box::new(flash_tc_forward_kernel::create_dummy_kernel(
                props_(),
                target_(),
                count(),
                planes,
                arg(&q),
                arg(&kv),
                arg(&kv),
                arg(&pad),
                arg(&q),
                arg(&rows),
                attn(16),
                d,
                true,
                true,
                true,
                false,
                types,
            )),
        ));
        kernels.push((
            "tensor-core dq".into(),
            Box::new(flash_tc_dq_kernel::create_dummy_kernel(
                props_(),
                target_(),
                count(),
                planes,
                arg(&q),
                arg(&kv),
                arg(&kv),
                arg(&pad),
                arg(&q),
                arg(&q),
                arg(&rows),
                arg(&q),
                arg(&rows),
                attn(16),
                d,
                true,
                true,
                true,
                false,
                types,
            )),
        ));
        kernels.push((
            "tensor-core dk dv".into(),
            Box::new(flash_tc_dkv_kernel::create_dummy_kernel(
                props_(),
                target_(),
                count(),
                planes,
                arg(&q),
                arg(&kv),
                arg(&kv),
                arg(&pad),
                arg(&q),
                arg(&rows),
                arg(&rows),
                arg(&kv),
                arg(&kv),
                attn(16),
                d,
                true,
                true,
                true,
                false,
                types,
            )),
        ));
    }
    let compile_options = CudaCompilationOptions {
        cpp: options,
        arch: Some(SmArch::new(90, true)),
        ptx_version: None,
    };
    kernels
        .into_iter()
        .map(|(name, kernel)| {
            let definition = cubecl_runtime::kernel::define_kernel(kernel.as_ref())
                .map_err(|e| format!("{name}: {e}"))?;
            let source = CudaCompiler::default()
                .compile(definition, &compile_options)
                .map_err(|e| format!("{name}: {e}"))?
                .to_string();
            Ok(FlashSource {
                name: format!("{name} ({dtype:?}, head dim {d})"),
                source,
            })
        })
        .collect()
}

/// What ptxas reported of one kernel compiled for sm_90a.
#[derive(Clone, Debug)]
pub struct NvrtcReport {
    /// Registers per thread.
    pub registers: Option<u32>,
    /// Bytes of spill stores and loads.
    pub spills: Option<(u32, u32)>,
    /// NVRTC's whole log.
    pub log: String,
}

/// Compiles `source` for sm_90a with NVRTC (loaded at run time: `libnvrtc.so*` on the
/// loader's path), with CUDA's headers from `include`, as CubeCL's CUDA runtime does, and
/// ptxas's verbose report.
///
/// # Errors
///
/// No NVRTC on the machine, or the compiler's log when it refuses the source.
pub fn nvrtc_compile_sm90(source: &str, include: &std::path::Path) -> Result<NvrtcReport, String> {
    use cudarc::nvrtc::result as nvrtc;
    // SAFETY: only tries to `dlopen` each candidate name.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("no NVRTC (libnvrtc.so) on the loader's path".into());
    }
    let source = std::ffi::CString::new(source).map_err(|e| e.to_string())?;
    let options = [
        "--gpu-architecture=sm_90a".to_string(),
        format!("--include-path={}", include.display()),
        "-lineinfo".to_string(),
        "--ptxas-options=-v".to_string(),
    ];
    let program = nvrtc::create_program(&source, None).map_err(|e| e.to_string())?;
    // SAFETY: `program` is live until destroyed below; the options outlive the call.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(program) }
        .map(|raw| {
            let bytes: Vec<u8> = raw
                .iter()
                .map(|&c| c as u8)
                .take_while(|&c| c != 0)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { nvrtc::destroy_program(program) };
    if compiled.is_err() {
        return Err(log);
    }
    let number_before = |text: &str, unit: &str| -> Option<u32> {
        let at = text.find(unit)?;
        text[..at].split_whitespace().last()?.parse().ok()
    };
    let registers = log
        .lines()
        .find(|l| l.contains("registers"))
        .and_then(|l| number_before(l, "registers"));
    let spills = log
        .lines()
        .find(|l| l.contains("spill stores"))
        .and_then(|l| {
            Some((
                number_before(l, "bytes spill stores")?,
                number_before(l, "bytes spill loads")?,
            ))
        });
    Ok(NvrtcReport {
        registers,
        spills,
        log,
    })
}
