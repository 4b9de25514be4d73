//! A cuBLASLt plan: the descriptor, the four layouts and the heuristic's algorithm for one
//! problem, made once per thread and kept (see [`super`]).

use super::Operand;
use burn::tensor::DType;
use cudarc::cublaslt::{result, sys};

fn cuda_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        _ => sys::cudaDataType_t::CUDA_R_32F,
    }
}

/// Everything that decides cuBLASLt's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub(super) inputs: DType,
    pub(super) output: DType,
    pub(super) a: Operand,
    pub(super) b: Operand,
    pub(super) c: Option<Operand>,
    pub(super) m: u64,
    pub(super) n: u64,
    pub(super) k: u64,
    pub(super) ldd: i64,
    /// Matrices in the batch (1: a plain product), the output's `m·n` apart.
    pub(super) batch: usize,
    pub(super) align: [u32; 4],
    pub(super) tf32: bool,
    /// SMs the GEMM may use (0: all), see [`super::carve_out`].
    pub(super) sms: i32,
}

/// A descriptor, its four layouts and the algorithm cuBLASLt's heuristic chose.
pub(super) struct Plan {
    pub(super) desc: sys::cublasLtMatmulDesc_t,
    pub(super) layouts: [sys::cublasLtMatrixLayout_t; 4],
    pub(super) algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created in `Plan::new`, destroyed once here.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = result::destroy_matrix_layout(l);
            }
        }
    }
}

pub(super) fn blas_error(what: &str) -> impl Fn(result::CublasError) -> String + '_ {
    move |e| format!("cuBLASLt {what}: {e:?}")
}

impl Plan {
    pub(super) fn new(
        handle: sys::cublasLtHandle_t,
        key: &Key,
        workspace: usize,
    ) -> Result<Self, String> {
        let compute = if key.inputs == DType::F32 && key.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
            .map_err(blas_error("descriptor"))?;
        let mut plan = Self {
            desc,
            layouts: [std::ptr::null_mut(); 4],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let layout = |dtype, rows, cols, ld| {
            result::create_matrix_layout(cuda_type(dtype), rows, cols, ld)
                .map_err(blas_error("layout"))
        };
        plan.layouts[0] = layout(key.inputs, key.a.rows, key.a.cols, key.a.ld)?;
        plan.layouts[1] = layout(key.inputs, key.b.rows, key.b.cols, key.b.ld)?;
        plan.layouts[3] = layout(key.output, key.m, key.n, key.ldd)?;
        plan.layouts[2] = match key.c {
            Some(c) => layout(key.output, key.m, key.n, c.ld)?,
            None => layout(key.output, key.m, key.n, key.ldd)?,
        };
        if key.batch > 1 {
            let count = i32::try_from(key.batch).map_err(|_| "batch over i32".to_string())?;
            let output_stride = (key.m * key.n) as i64;
            let strides = [
                key.a.batch_stride,
                key.b.batch_stride,
                key.c.map_or(output_stride, |c| c.batch_stride),
                output_stride,
            ];
            use sys::cublasLtMatrixLayoutAttribute_t as L;
            for (layout, stride) in plan.layouts.into_iter().zip(strides) {
                // SAFETY: live layouts; each attribute gets a value of its documented type.
                unsafe {
                    result::set_matrix_layout_attribute(
                        layout,
                        L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&count as *const i32).cast(),
                        4,
                    )
                    .and_then(|_| {
                        result::set_matrix_layout_attribute(
                            layout,
                            L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            (&stride as *const i64).cast(),
                            8,
                        )
                    })
                }
                .map_err(blas_error("batch"))?;
            }
        }
        // SAFETY: a live descriptor; each attribute gets a value of its documented type.
        unsafe {
            let set_desc = |attr, value: i32| {
                result::set_matmul_desc_attribute(
                    desc,
                    attr,
                    (&value as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )
            };
            let attrs = sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA;
            set_desc(attrs, i32::from(key.a.trans)).map_err(blas_error("transa"))?;
            let attrs = sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB;
            set_desc(attrs, i32::from(key.b.trans)).map_err(blas_error("transb"))?;
            if key.sms > 0 {
                let attrs =
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET;
                set_desc(attrs, key.sms).map_err(blas_error("SM count target"))?;
            }
        }
        let pref = result::create_matmul_pref().map_err(blas_error("preference"))?;
        // SAFETY: live descriptors; each attribute gets a value of its documented type.
        let chosen = unsafe {
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let bytes = workspace as u64;
            let set_pref = |attr, value: *const std::ffi::c_void, size| {
                result::set_matmul_pref_attribute(pref, attr, value, size)
            };
            let mut status = set_pref(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                8,
            );
            let aligns = [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            for (attr, align) in aligns.into_iter().zip(&key.align) {
                status = status.and_then(|_| set_pref(attr, (align as *const u32).cast(), 4));
            }
            let chosen = status.map_err(blas_error("preference")).and_then(|_| {
                result::get_matmul_algo_heuristic(
                    handle,
                    desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[3],
                    pref,
                )
                .map_err(blas_error("heuristic (no kernel for this problem)"))
            });
            let _ = result::destroy_matmul_pref(pref);
            chosen?
        };
        plan.algo = chosen.algo;
        Ok(plan)
    }
}
