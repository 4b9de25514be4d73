//! `nvrtc`: the flash attention kernels' CUDA C++ for sm_90a (H100/H200), made as CubeCL's
//! CUDA runtime would make it and compiled by NVRTC, with ptxas's registers and spills per
//! kernel. It needs NVRTC and CUDA's headers (`CUDA_PATH`, else `/usr/local/cuda`), not a GPU:
//! PyTorch's `nvidia-cuda-nvrtc` wheel is enough on a CPU machine. Each source is written to
//! `--out` as `<kernel>.cu`.

use crate::Report;

/// Every flash kernel at the dtypes and head dimensions of the bf16 benchmark's models (GPT
/// 128, BERT-large 64) and f32.
pub fn flash(report: &mut Report, out: &std::path::Path) {
    #[cfg(feature = "cuda")]
    {
        use burn::tensor::DType;
        use burn_megatron_kernels::{flash_cuda_sources, nvrtc_compile_sm90};
        let cuda = std::env::var("CUDA_PATH").unwrap_or_else(|_| "/usr/local/cuda".into());
        let include = std::path::Path::new(&cuda).join("include");
        if !include.join("cuda_fp16.h").exists() {
            report.skip(
                "nvrtc flash kernels",
                format!("no CUDA headers in {} (set CUDA_PATH)", include.display()),
            );
            return;
        }
        for (dtype, d) in [(DType::BF16, 128), (DType::BF16, 64), (DType::F32, 128)] {
            let sources = match flash_cuda_sources(dtype, d) {
                Ok(sources) => sources,
                Err(e) => {
                    report.fail(&format!("nvrtc flash kernels {dtype:?} {d}"), e);
                    continue;
                }
            };
            for s in sources {
                let name = format!("nvrtc {}", s.name);
                // The source beside the logs, for reading what the card was given.
                let file: String = s
                    .name
                    .chars()
                    .map(|c| if c.is_alphanumeric() { c } else { '_' })
                    .collect();
                let _ = std::fs::write(out.join(format!("{file}.cu")), &s.source);
                match nvrtc_compile_sm90(&s.source, &include) {
                    Ok(r) => {
                        let spills = r.spills.map_or("?".into(), |(st, ld)| {
                            format!("{st} B spill stores, {ld} B spill loads")
                        });
                        let registers = r.registers.map_or("?".into(), |n| n.to_string());
                        report.pass(&name, format!("sm_90a: {registers} registers, {spills}"));
                    }
                    Err(log) if log.starts_with("no NVRTC") => {
                        report.skip("nvrtc flash kernels", log);
                        return;
                    }
                    Err(log) => {
                        let head: Vec<&str> = log.lines().take(12).collect();
                        report.fail(&name, head.join(" | "));
                    }
                }
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    report.skip("nvrtc flash kernels", "built without the `cuda` feature");
}
