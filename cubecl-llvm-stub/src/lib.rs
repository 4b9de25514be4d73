//! burn-megatron's stand-in for `cubecl-llvm` 0.11.3: the items `cubecl-cuda` 0.11.3 names,
//! with the same paths and signatures, and no LLVM.
//!
//! `cubecl-cuda` compiles kernels through CUDA C++ and NVRTC when cubecl's `cuda-cpp` feature
//! is on (burn-megatron's `cuda` feature turns it on); the LLVM backend is then never
//! selected, and this crate only has to make `cubecl-cuda` compile and link. Should the LLVM
//! backend be selected anyway, [`PlironCompiler`] refuses every kernel with an error naming
//! the feature, and a CUDA device reports no PTX version ([`nvptx::ptx_version::PtxVersion`]).
//!
//! What the LLVM path would have given over NVRTC: PTX emitted in-process without the CUDA
//! toolkit's `libnvrtc` at run time, and a PTX version picked from the driver. NVRTC needs
//! `libnvrtc` on the machine, and compiles CUDA C++ (slower to compile, the same kernels).

use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::{CompilationError, Compiler};
use cubecl_runtime::kernel::{BufferIOAttr, KernelDefinition};

/// The error every compilation through the stand-in returns.
pub const NO_LLVM: &str = "this build has no LLVM backend (burn-megatron replaces cubecl-llvm \
    with a stand-in): CUDA kernels compile through CUDA C++ and NVRTC, which cubecl's \
    `cuda-cpp` feature selects";

/// Where the LLVM backend would emit code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// The host (the real crate's JIT).
    #[default]
    Cpu,
    /// NVIDIA GPUs, through PTX.
    Nvptx,
}

/// The LLVM compiler's options; only the fields `cubecl-cuda` sets.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// AMD architecture (`None` for NVIDIA).
    pub arch: Option<u32>,
    /// The NVIDIA architecture.
    pub sm_arch: Option<cubecl_ir::nvidia::SmArch>,
    /// The PTX version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Scalars and metadata in the kernel parameter block.
    pub grid_constants: bool,
}

/// A compiled PTX module, as the real crate's.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX.
    pub ptx: Vec<core::ffi::c_char>,
    /// The kernel's entry point.
    pub entrypoint: String,
    /// The IR, for logs and cache keys.
    pub ir: String,
    /// Shared memory per launch, in bytes.
    pub shared_memory_size: usize,
    /// Each buffer binding's access.
    pub io: Vec<BufferIOAttr>,
}

/// What a compilation produces. The stand-in never produces one.
#[derive(Clone, Debug)]
pub enum PlironArtifact {
    /// PTX for the CUDA driver.
    NvptxCode(NvptxModule),
}

impl core::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => f.write_str(&module.ir),
        }
    }
}

/// The LLVM compiler, which here refuses every kernel ([`NO_LLVM`]).
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// Where it would emit code.
    pub target: LlvmTarget,
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &PlironOptions,
    ) -> Result<PlironArtifact, CompilationError> {
        Err(CompilationError::Generic {
            reason: NO_LLVM.to_string(),
            backtrace: BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        match self.target {
            LlvmTarget::Cpu => "mlir",
            LlvmTarget::Nvptx => "llvm",
        }
    }
}

/// NVIDIA specifics.
pub mod nvptx {
    /// The PTX ISA version.
    pub mod ptx_version {
        /// A PTX ISA version. The stand-in emits no PTX, so it knows none a driver loads.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest PTX version a driver loads: `None` here, which is also what the real
            /// crate answers for a driver it does not know (it then leaves LLVM's default).
            pub fn for_driver(_driver: i32) -> Option<Self> {
                None
            }
        }

        impl core::fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }
    }
}

/// Items shared by the targets.
pub mod shared {
    /// Device features each LLVM target can lower.
    pub mod lowered_features {
        use cubecl_ir::DeviceProperties;

        /// A GPU target of the LLVM backend.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA, through PTX.
            Nvptx,
        }

        /// Removes the device features `target`'s LLVM backend cannot compile. Nothing here:
        /// the stand-in compiles nothing, so what the device advertises stays as the CUDA C++
        /// backend sees it.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}
